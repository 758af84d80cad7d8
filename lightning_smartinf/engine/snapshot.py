"""Saving and restoring an engine's offloaded state as a directory of files beside Lightning's checkpoint.

The state files of each subgroup (fp32 master and optimizer state) are copied as they stand at a step boundary,
with ``engine.json`` describing the layout they belong to; restoring checks that layout, copies them back and
rebuilds the 16-bit parameters from the masters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.engine.engine import OffloadEngine

MANIFEST = "engine.json"


def _signature(engine: OffloadEngine) -> dict[str, Any]:
    return {
        "subgroups": [[sg.block, sg.param_group, sg.offset, sg.numel] for sg in engine.layout.subgroups],
        "optimizer": engine.rule.name if engine.rule else None,
        "state_directories": len(_state_dirs(engine)),
    }


def _state_dirs(engine: OffloadEngine) -> list[Path]:
    return engine.updater.state_directories() if engine.updater else []


def save_engine_state(engine: OffloadEngine, directory: Path) -> None:
    engine.wait_step()  # consistent as of a step boundary
    directory.mkdir(parents=True, exist_ok=True)
    kinds = ("master", *(engine.rule.state_kinds if engine.rule else ()))
    for index, state_dir in enumerate(_state_dirs(engine)):
        for kind in kinds:
            if (state_dir / kind).is_dir():
                shutil.copytree(state_dir / kind, directory / f"state{index}" / kind, dirs_exist_ok=True)
    manifest = {
        "signature": _signature(engine),
        "step_count": engine.step_count,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest))


def load_engine_state(engine: OffloadEngine, directory: Path) -> None:
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{directory} holds no {MANIFEST}: not a smart_infinity checkpoint")
    manifest = json.loads(manifest_path.read_text())
    if manifest["signature"] != _signature(engine):
        raise ValueError(
            f"checkpoint {directory} was written for another model, optimizer or offload.subgroup_size; "
            "resume with the configuration it was saved with"
        )
    for index, state_dir in enumerate(_state_dirs(engine)):
        saved = directory / f"state{index}"
        for kind_dir in saved.iterdir() if saved.is_dir() else ():
            shutil.copytree(kind_dir, state_dir / kind_dir.name, dirs_exist_ok=True)
    engine.step_count = manifest["step_count"]
    if engine.scaler is not None and manifest["loss_scaler"]:
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    engine.republish_params()
