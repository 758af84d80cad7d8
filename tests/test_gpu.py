"""On a CUDA device (scripts/gpu_check.sh runs these where a GPU is lent; they skip elsewhere): the engine's
device copies and its page-locked staging are exact against plain Lightning on the same GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module, relative_error, token_loader

from lightning_smartinf import SmartInfinityStrategy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def fit_cuda(module: pl.LightningModule, strategy: Any, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, **kwargs)  # fmt: skip
    trainer.fit(module, token_loader())
    return trainer


@pytest.mark.parametrize("schedule", [{"kind": "horizontal"}, {"kind": "vertical", "micro_batches": 2, "overlap": 0.5}])
def test_fp32_on_the_gpu_equals_plain_lightning(tmp_path: Path, schedule: dict[str, Any]) -> None:
    reference = make_module("adamw")
    fit_cuda(reference, "auto", precision="32-true")
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096},
                                     update={"host_adam": "torch"}, schedule=schedule)  # fmt: skip
    module = make_module("adamw")
    trainer = fit_cuda(module, strategy, precision="32-true")
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference.cpu()) < 1e-5
    assert all(p.device.type == "cuda" for p in module.parameters() if p.device.type != "meta")


def test_staging_buffers_are_page_locked_for_the_gpu(smart) -> None:
    """Host-to-device copies from pinned memory run asynchronously at full link speed."""
    trainer = fit_cuda(make_module("adamw"), smart(io_backend="aio"), precision="bf16-mixed")
    pool = trainer.strategy.engine.params.pool
    raw = pool.acquire(4096)
    try:
        assert raw.is_pinned()
    finally:
        pool.release(raw)
