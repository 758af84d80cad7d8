"""Save, resume, continue: bit for bit the uninterrupted run, for each update backend, schedule and precision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.checkpoint import CheckpointCorruptError, latest_checkpoint
from lightning_smartinf.errors import ConfigError

CASES = {
    "host-vertical-overlap": ({"update": {"host_adam": "torch"}, "schedule": {"kind": "vertical", "micro_batches": 2,
                                                                             "overlap": 0.5}}, "32-true"),
    "host-vertical-eager": ({"update": {"host_adam": "torch"}, "schedule": {"kind": "vertical", "micro_batches": 2,
                                                                           "eager_update": True}}, "32-true"),
    "smart-bf16": ({"update": {"backend": "smart", "devices": 2}}, "bf16-mixed"),
    "host-fp16-loss-scaling": ({"update": {"host_adam": "torch"}}, "16-mixed"),
    "host-deepspeed-adam": ({"update": {"host_adam": "deepspeed"}}, "32-true"),
    "host-deepspeed-adam-bf16-vertical-overlap": ({"update": {"host_adam": "deepspeed"}, "schedule": {
        "kind": "vertical", "micro_batches": 2, "overlap": 0.5}}, "bf16-mixed"),
    "smart-8bit-state": ({"update": {"backend": "smart", "devices": 2}, "offload": {"state_precision": "8bit"}},
                         "bf16-mixed"),
    "host-8bit-state-on-disk-vertical": ({"update": {"host_adam": "deepspeed"}, "offload": {
        "state_precision": "8bit", "host_memory_budget": "0"}, "schedule": {"kind": "vertical", "micro_batches": 2}},
        "bf16-mixed"),
}  # fmt: skip


def train(root: Path, steps: int, settings: dict[str, Any], precision: str, resume: Path | None = None,
          samples: int = 16) -> Any:  # fmt: skip
    offload = {"nvme_path": str(root / "state"), "subgroup_size": 4096, "io_backend": "threads",
               **settings.get("offload", {})}  # fmt: skip
    strategy = SmartInfinityStrategy(offload=offload, **{k: v for k, v in settings.items() if k != "offload"})
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, precision=precision, logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(make_module(seed=1 if resume else 0), token_loader(samples=samples), ckpt_path=resume)
    state = strategy.consolidated_state_dict()
    strategy.close()
    return state


@pytest.mark.parametrize("case", CASES)
def test_resume_equals_uninterrupted(case: str, tmp_path: Path) -> None:
    settings, precision = CASES[case]
    expected = train(tmp_path / "straight", 6, settings, precision)
    train(tmp_path / "split", 4, settings, precision)
    resume = latest_checkpoint(tmp_path / "split" / "ckpts")
    assert resume is not None and resume.name.endswith("step=4.ckpt")
    got = train(tmp_path / "split", 6, settings, precision, resume=resume)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_resume_refuses_a_damaged_checkpoint_before_loading_anything(tmp_path: Path) -> None:
    settings, precision = CASES["host-fp16-loss-scaling"]
    train(tmp_path / "first", 2, settings, precision)
    checkpoint = latest_checkpoint(tmp_path / "first" / "ckpts")
    assert checkpoint is not None
    victim = next((checkpoint / "offload").rglob("exp_avg/sg000002"))
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(CheckpointCorruptError, match="exp_avg/sg000002: contents altered"):
        train(tmp_path / "second", 4, settings, precision, resume=checkpoint)


def test_resume_from_a_mid_run_save_with_the_default_optimizer(tmp_path: Path) -> None:
    """DeepSpeed's CPU Adam (the default host update), resumed from the step-6 save of a 10-step run. Its running
    product of beta2=0.95 leaves pow(0.95, n) in float32 from step 6, so a resume there shows whether
    the corrections depend on the step alone (update/cpu_adam.py); before that fix this differed. Two batches an
    epoch: a plain DataLoader restarts its epoch on resume, so every save falls on an epoch's end."""
    settings: dict[str, Any] = {"update": {"host_adam": "deepspeed"}}
    expected = train(tmp_path / "straight", 10, settings, "32-true", samples=8)
    train(tmp_path / "split", 10, settings, "32-true", samples=8)
    mid = next(p for p in (tmp_path / "split" / "ckpts").iterdir() if p.name.endswith("step=6.ckpt"))
    got = train(tmp_path / "resumed", 10, settings, "32-true", resume=mid, samples=8)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_resume_with_another_configuration_names_what_differs(tmp_path: Path) -> None:
    settings, precision = CASES["host-fp16-loss-scaling"]
    train(tmp_path / "first", 2, settings, precision)
    checkpoint = latest_checkpoint(tmp_path / "first" / "ckpts")
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state2"), "subgroup_size": 4096,
                                              "io_backend": "threads"}, **settings)  # fmt: skip
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with pytest.raises(ConfigError, match=r"another configuration: optimizer adamw \(this run: sgd\)"):
        trainer.fit(make_module("sgd"), token_loader(samples=16), ckpt_path=checkpoint)
    strategy.close()


def test_resume_with_another_state_precision_is_refused(tmp_path: Path) -> None:
    settings, precision = CASES["host-8bit-state-on-disk-vertical"]
    train(tmp_path / "first", 2, settings, precision)
    checkpoint = latest_checkpoint(tmp_path / "first" / "ckpts")
    with pytest.raises(ConfigError, match=r"offload.state_precision=8bit \(this run: fp32; a resume keeps"):
        fp32 = {k: v for k, v in settings.items() if k != "offload"}
        train(tmp_path / "second", 4, fp32, precision, resume=checkpoint)
    other = {**settings, "offload": {**settings["offload"], "fp32_embedding_state": False}}
    with pytest.raises(ConfigError, match=r"other parameters keeping fp32 state beside the 8-bit state \(offload."):
        train(tmp_path / "third", 4, other, precision, resume=checkpoint)
