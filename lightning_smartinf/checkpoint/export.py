"""A checkpoint's fp32 masters as plain safetensors (or a state dict), without the model's code or the strategy.

The manifest's layout says where each parameter sits in its block's flat buffer and which subgroup file holds
which range; the masters are read straight from those files. Buffers come from Lightning's part of the
checkpoint. The result loads with ``module.load_state_dict`` into the module that was trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_smartinf.checkpoint.manifest import ENGINE_STATE, TRAINER_STATE, CheckpointError, verify_checkpoint
from lightning_smartinf.checkpoint.shards import Planned, write_file, write_sharded
from lightning_smartinf.checkpoint.trainer_state import load as load_trainer_state
from lightning_smartinf.core import FROZEN
from lightning_smartinf.ecosystem.adapters import Merge, merge_block, merged_name
from lightning_smartinf.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WHOLE, MERGED, ADAPTERS = "whole", "merged", "adapters"
MODES = {
    WHOLE: "every parameter and buffer, named as in the module (a LoRA model's base and adapters apart)",
    MERGED: "LoRA adapters merged into their base weights, named as PEFT's merge_and_unload names the model",
    ADAPTERS: "the trained parameters alone (a LoRA model's adapters)",
}


def _files(root: Path, pattern: str) -> dict[str, Path]:
    return {p.name: p for p in root.glob(pattern)}


def _parts(manifest: Any) -> list[tuple[dict[str, Any], Path]]:
    """(layout, engine-state directory) of each rank that saved the checkpoint (one without data parallelism).
    A checkpoint written before checkpoints held the frozen parameters of the streamed blocks (a LoRA base) has no
    values for them: refused."""
    root = manifest.path / ENGINE_STATE
    if "ranks" in manifest.meta:
        parts = [(meta["signature"]["layout"], root / f"rank{r}") for r, meta in enumerate(manifest.meta["ranks"])]
    else:
        parts = [(manifest.meta["engine"]["signature"]["layout"], root)]
    frozen = parts[0][0].get("frozen", [])
    if frozen and "frozen_layout" not in parts[0][0]:
        raise CheckpointError(
            f"{manifest.path} holds no values for the {len(frozen)} frozen parameters of its streamed blocks "
            f"({frozen[0][0]}, ...): it was written before checkpoints held them. Export the trained model from "
            "the live run with trainer.strategy.export(DIR), or resume it and save a new checkpoint"
        )
    return parts


def _gather(flat: torch.Tensor, layout: dict[str, Any], index: int, files: dict[str, Path], what: str,
            path: Path) -> None:  # fmt: skip
    """Fill ``flat`` (block ``index``'s buffer) with the subgroups of one saved rank's ``layout`` it holds."""
    for key, owner, _, offset, numel in layout["subgroups"]:
        if owner != index:
            continue
        if key not in files:
            raise CheckpointError(f"{path} holds no {what} file for subgroup {key}")
        values = np.fromfile(files[key], dtype=np.uint8, count=numel * flat.element_size())
        flat[offset : offset + numel] = torch.from_numpy(values).view(flat.dtype)


def _block_tensors(manifest: Any, index: int) -> dict[str, torch.Tensor]:
    """Block ``index``'s parameters by name, from the files of every rank that saved it (one block in memory): the
    trained ones from their fp32 masters, then the frozen ones (a LoRA base) in their own dtype."""
    parts = _parts(manifest)
    block = parts[0][0]["blocks"][index]
    flat = torch.zeros(block["numel"], dtype=torch.float32)
    for layout, root in parts:
        _gather(flat, layout, index, _files(root, "state*/master/sg*"), "master", manifest.path)
    tensors = {name: flat[offset : offset + numel].view(shape) for name, offset, numel, shape in block["params"]}
    fixed = parts[0][0].get("frozen_layout")
    if fixed is not None and index < len(fixed["blocks"]) and fixed["blocks"][index]["params"]:
        frozen_block = fixed["blocks"][index]
        values = torch.zeros(frozen_block["numel"], dtype=getattr(torch, fixed["dtype"]))
        for layout, root in parts:
            _gather(values, layout["frozen_layout"], index, _files(root, f"{FROZEN}/sg*"), "frozen", manifest.path)
        tensors.update({name: values[offset : offset + numel].view(shape)
                        for name, offset, numel, shape in frozen_block["params"]})  # fmt: skip
    return tensors


def _merges(layout: dict[str, Any]) -> list[Merge]:
    return [Merge(base, a, b, float(scaling), bool(transpose)) for base, a, b, scaling, transpose in
            layout.get("merges", [])]  # fmt: skip


def with_aliases(params: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str],
                 extra: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Every parameter (block by block), then the second names of shared ones, then buffers and frozen
    parameters: the order ``plan_tensors`` lays them out in."""
    kept: dict[str, torch.Tensor] = {}
    wanted = set(aliases.values())
    for name, tensor in params:
        if name in wanted:
            kept[name] = tensor
        yield name, tensor
    for alias, name in aliases.items():
        yield alias, kept[name]
    yield from extra.items()


def _checkpoint_tensors(manifest: Any, layout: dict[str, Any], extra: dict[str, torch.Tensor], dtype: torch.dtype,
                        mode: str = WHOLE) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The checkpoint's tensors block by block, in ``_plan``'s order (see ``MODES``)."""
    merges = _merges(layout) if mode == MERGED else []
    rename = merged_name if mode == MERGED else (lambda name: name)

    def params() -> Iterator[tuple[str, torch.Tensor]]:
        for index in range(len(layout["blocks"])):
            tensors = _block_tensors(manifest, index)
            if mode == ADAPTERS:
                trained = {p[0] for p in layout["blocks"][index]["params"]}
                tensors = {k: v for k, v in tensors.items() if k in trained}
            for name, value in (merge_block(tensors, merges) if merges else tensors).items():
                yield rename(name), value.to(dtype)

    aliases = {} if mode == ADAPTERS else {rename(a): rename(n) for a, n in layout.get("aliases", {}).items()}
    return with_aliases(params(), aliases, {rename(k): v for k, v in extra.items()} if mode != ADAPTERS else {})


def _plan(layout: dict[str, Any], extra: dict[str, torch.Tensor], dtype: torch.dtype, mode: str) -> list[Planned]:
    """What an export of ``layout`` in ``mode`` writes, in ``_checkpoint_tensors``' order."""
    fixed = layout.get("frozen_layout", {"blocks": []})
    adapters = {name for m in _merges(layout) for name in (m.lora_a, m.lora_b)} if mode == MERGED else set()
    rename = merged_name if mode == MERGED else (lambda name: name)
    params: list[tuple[str, tuple[int, ...]]] = []
    for index, block in enumerate(layout["blocks"]):
        names = [(p[0], tuple(p[3])) for p in block["params"]]
        if mode != ADAPTERS and index < len(fixed["blocks"]):
            names += [(p[0], tuple(p[3])) for p in fixed["blocks"][index]["params"]]
        params += [(rename(n), shape) for n, shape in names if n not in adapters]
    if mode == ADAPTERS:
        return plan_tensors(params, {}, {}, dtype)
    aliases = {rename(a): rename(n) for a, n in layout.get("aliases", {}).items()}
    return plan_tensors(params, aliases, {rename(k): v for k, v in extra.items()}, dtype)


def plan_tensors(params: Iterable[tuple[str, tuple[int, ...]]], aliases: dict[str, str],
                 extra: dict[str, torch.Tensor], dtype: torch.dtype) -> list[Planned]:  # fmt: skip
    """The export's tensors in ``with_aliases`` order: floating-point ones in ``dtype``, others as they are."""
    plan = [Planned(name, dtype, shape) for name, shape in params]
    shapes = {p.name: p.shape for p in plan}
    plan += [Planned(alias, dtype, shapes[name]) for alias, name in aliases.items()]
    plan += [Planned(k, dtype if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in extra.items()]
    return plan


def write_tensors(out: Path, plan: list[Planned], tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int,
                  metadata: dict[str, str], strip_prefix: str) -> list[Path]:  # fmt: skip
    """``out`` as one .safetensors file, or a directory in save_pretrained's layout; names without ``strip_prefix``."""
    renamed = [Planned(p.name.removeprefix(strip_prefix), p.dtype, p.shape) for p in plan]
    stream = ((name.removeprefix(strip_prefix), t) for name, t in tensors)
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        return [write_file(out, renamed, stream, metadata)]
    return write_sharded(out, renamed, stream, max_shard_bytes, metadata)


def consolidated_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Every parameter (and buffer) of the checkpointed module by name, plus Lightning's trainer state; the slices
    of a data-parallel run's ranks are put back together (in memory: for tests and small models)."""
    manifest = verify_checkpoint(path)
    layout = _parts(manifest)[0][0]
    trainer_state = load_trainer_state(manifest.path / TRAINER_STATE)
    extra = {k: v.detach().clone() for k, v in trainer_state.get("state_dict", {}).items()}
    state = {name: t.clone() for name, t in _checkpoint_tensors(manifest, layout, extra, dtype)}
    return state, trainer_state


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def export_safetensors(checkpoint: Path, out: Path, dtype: str = "bf16", max_shard_bytes: int = 2_000_000_000,
                       strip_prefix: str = "", mode: str = WHOLE) -> tuple[list[Path], int]:  # fmt: skip
    """Write ``out`` (a .safetensors file, or a directory to hold model.safetensors or shards with an index, as
    ``save_pretrained`` lays them out) one tensor at a time; return the files and the tensors' element count.
    ``strip_prefix`` turns the LightningModule's names into the library model's (``model.`` for an HF model held
    as ``self.model``); ``mode``: see ``MODES``. The metadata carries the module's hyper-parameters when it saved
    them."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if mode not in MODES:
        raise ConfigError(f"export mode {mode!r} is not one of {', '.join(MODES)}")
    manifest = verify_checkpoint(checkpoint)
    layout = _parts(manifest)[0][0]
    if mode == MERGED and not layout.get("merges"):
        raise ConfigError(f"--merge: {manifest.path} holds no LoRA adapters to merge (its model has no lora_A/lora_B "
                          "layers); export it without --merge")  # fmt: skip
    trainer_state = load_trainer_state(manifest.path / TRAINER_STATE)
    extra = dict(trainer_state.get("state_dict", {}))
    target_dtype = DTYPES[dtype]
    plan = _plan(layout, extra, target_dtype, mode)
    hyper = {k: _jsonable(v) for k, v in dict(trainer_state.get("hyper_parameters") or {}).items()}
    metadata = {
        "format": "pt",
        "source": str(Path(checkpoint).absolute()),
        "global_step": str(trainer_state.get("global_step", 0)),
        "dtype": dtype,
        "hyper_parameters": json.dumps(hyper, default=str),
    }
    tensors = _checkpoint_tensors(manifest, layout, extra, target_dtype, mode)
    files = write_tensors(out, plan, tensors, max_shard_bytes, metadata, strip_prefix)
    numel = sum(math.prod(p.shape) for p in plan)
    return files, numel
