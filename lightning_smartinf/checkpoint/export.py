"""A checkpoint's fp32 masters consolidated into one plain state dict, without the model's code or the strategy.

The manifest's layout says where each parameter sits in its block's flat buffer and which subgroup file holds
which range; the masters are read straight from those files. Buffers come from Lightning's part of the
checkpoint. The result loads with ``module.load_state_dict`` into the module that was trained.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from lightning_smartinf.checkpoint.manifest import ENGINE_STATE, TRAINER_STATE, CheckpointError, verify_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _master_files(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.glob("state*/master/sg*")}


def _parts(manifest: Any) -> list[tuple[dict[str, Any], Path]]:
    """(layout, engine-state directory) of each rank that saved the checkpoint (one without data parallelism)."""
    root = manifest.path / ENGINE_STATE
    if "ranks" in manifest.meta:
        return [(meta["signature"]["layout"], root / f"rank{r}") for r, meta in enumerate(manifest.meta["ranks"])]
    return [(manifest.meta["engine"]["signature"]["layout"], root)]


def consolidated_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Every parameter (and buffer) of the checkpointed module by name, plus Lightning's trainer state; the slices
    of a data-parallel run's ranks are put back together."""
    manifest = verify_checkpoint(path)
    parts = [(layout, _master_files(root)) for layout, root in _parts(manifest)]
    layout = parts[0][0]
    state: dict[str, torch.Tensor] = {}
    for index, block in enumerate(layout["blocks"]):
        flat = torch.zeros(block["numel"], dtype=torch.float32)
        for part_layout, masters in parts:
            for key, owner, _, offset, numel in part_layout["subgroups"]:
                if owner != index:
                    continue
                if key not in masters:
                    raise CheckpointError(f"{manifest.path} holds no master file for subgroup {key}")
                values = np.fromfile(masters[key], dtype=np.float32, count=numel)
                flat[offset : offset + numel] = torch.from_numpy(values)
        for name, offset, numel, shape in block["params"]:
            state[name] = flat[offset : offset + numel].view(shape).to(dtype).clone()
    for alias, name in layout.get("aliases", {}).items():
        state[alias] = state[name].clone()
    trainer_state = torch.load(manifest.path / TRAINER_STATE, weights_only=False, map_location="cpu")
    state.update({k: v.detach().clone() for k, v in trainer_state.get("state_dict", {}).items()})
    return state, trainer_state


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def export_safetensors(checkpoint: Path, out: Path, dtype: str = "bf16") -> tuple[Path, int]:
    """Write ``out`` (a .safetensors file, or a directory to hold model.safetensors); return it and its tensors'
    element count. The file's metadata carries the module's hyper-parameters when it saved them."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    state, trainer_state = consolidated_state_dict(checkpoint, DTYPES[dtype])
    target = out / "model.safetensors" if out.suffix != ".safetensors" else out
    target.parent.mkdir(parents=True, exist_ok=True)
    hyper = {k: _jsonable(v) for k, v in dict(trainer_state.get("hyper_parameters") or {}).items()}
    metadata = {
        "format": "pt",
        "source": str(Path(checkpoint).absolute()),
        "global_step": str(trainer_state.get("global_step", 0)),
        "dtype": dtype,
        "hyper_parameters": json.dumps(hyper, default=str),
    }
    partial = target.with_name(f".{target.name}.partial")
    save_file({k: v.contiguous() for k, v in state.items()}, str(partial), metadata=metadata)
    partial.replace(target)
    return target, sum(v.numel() for v in state.values())
