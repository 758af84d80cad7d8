"""Checkpoints written behind training (``offload.async_save``): the state of the step boundary, whatever the
steps after it rewrite meanwhile; a failed one stops training and keeps the checkpoint before it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smartinf import SmartInfinityStrategy, trace
from lightning_smartinf.checkpoint import CheckpointError, manifest, verify_checkpoint

SLOW_COPY_S = 0.02


def train(root: Path, async_save: bool, steps: int = 6, keep: int = -1, update: str = "host") -> Any:
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": str(root / "state"), "subgroup_size": 4096, "io_backend": "threads",
                 "async_save": async_save, "host_memory_budget": "0"},
        update={"backend": update, "host_adam": "torch", "devices": 2},
        schedule={"kind": "horizontal"},  # the step in line: the next one meets the copies still running
    )  # fmt: skip
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, precision="32-true", logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_top_k=keep)],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    try:
        trainer.fit(make_module(), token_loader(samples=32))
        return strategy.consolidated_state_dict(), strategy.last_save
    finally:
        strategy.close()


def offloaded_hashes(checkpoint: Path) -> dict[str, str]:
    """SHA-256 of every engine state file (masters and optimizer moments) the checkpoint lists."""
    files = verify_checkpoint(checkpoint).files
    return {name: record.sha256 for name, record in files.items() if name.startswith("offload/")}


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint file copy takes a while, so the next step reaches subgroups not yet copied."""
    original = manifest.copy_file

    def copy_file(source: Path, target: Path, *args: Any) -> Any:
        time.sleep(SLOW_COPY_S)
        return original(source, target, *args)

    monkeypatch.setattr(manifest, "copy_file", copy_file)


@pytest.mark.parametrize("update", ["host", "smart"])
def test_a_background_save_holds_the_step_boundary(update: str, slow_copies: None, tmp_path: Path) -> None:
    expected, foreground = train(tmp_path / "foreground", async_save=False, update=update)
    tracer = trace.start()
    try:
        got, background = train(tmp_path / "background", async_save=True, update=update)
    finally:
        trace.stop()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    for step in (2, 4, 6):
        name = f"epoch=0-step={step}.ckpt"
        saved = offloaded_hashes(tmp_path / "background" / "ckpts" / name)
        assert saved and saved == offloaded_hashes(tmp_path / "foreground" / "ckpts" / name), step
    waits = [e for e in tracer.events if e.name.startswith("wait for the checkpoint's copy")]
    assert waits, "the step never met a subgroup still being copied: the test did not exercise the fence"
    assert background.stalled < background.seconds  # training waited for the snapshot, not the writing
    assert foreground.stalled >= foreground.seconds


def test_a_failed_background_save_stops_training_and_keeps_the_one_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    original = manifest.copy_file

    def copy_file(source: Path, target: Path, *args: Any) -> Any:
        if "step=4" in str(target):
            raise OSError(5, "Input/output error (injected)")
        return original(source, target, *args)

    monkeypatch.setattr(manifest, "copy_file", copy_file)
    with pytest.raises(CheckpointError, match=r"background save of .*step=4\.ckpt failed: .*Input/output error"):
        train(tmp_path, async_save=True, keep=1)
    kept = [p.name for p in (tmp_path / "ckpts").iterdir()]
    assert kept == ["epoch=0-step=2.ckpt"], kept  # its removal, queued after the failed save, did not run
    verify_checkpoint(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
