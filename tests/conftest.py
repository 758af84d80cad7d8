"""Shared fixtures: tiny GPT modules, random token data, and Trainers (plain and smart_infinity) on CPU."""

from __future__ import annotations

import os

# PoCL reads this once, at the first platform query of the process: three CPU devices for the SmartUpdate tests.
os.environ.setdefault("POCL_DEVICES", "pthread pthread pthread")

import logging  # noqa: E402
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_smartinf
from lightning_smartinf.models.gpt import GPTConfig, GPTModule

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile DeepSpeed's ops here, once, before any test: otherwise the first command-line test would compile them
    inside a subprocess with a timeout, and a build killed part-way leaves a lock that hangs every later load."""
    from lightning_smartinf.ops import build_all, build_lock

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("building DeepSpeed's ops (first run on a machine only: a few minutes)")
        for name in ("async_io", "cpu_adam"):
            if (lock := build_lock(name)) is not None:
                reporter.write_line(f"found {lock}: waiting if a build holds it, removing it if none does")
    loaded = build_all()
    if reporter is not None:
        reporter.write_line(f"DeepSpeed ops ready: {', '.join(loaded) or 'none compatible'}")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def token_loader(samples: int = 64, seq_len: int = 16, batch_size: int = 4, seed: int = 0) -> DataLoader[Any]:
    data = torch.randint(0, 256, (samples, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return DataLoader(data, batch_size=batch_size)  # type: ignore[arg-type]


def make_module(optimizer: str = "adamw", seed: int = 0, **kwargs: Any) -> GPTModule:
    torch.manual_seed(seed)
    return GPTModule(TINY, optimizer=optimizer, lr=kwargs.pop("lr", 1e-2), **kwargs)


def fit(
    module: pl.LightningModule,
    strategy: Any = "auto",
    max_steps: int = 10,
    loader: DataLoader[Any] | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, loader if loader is not None else token_loader())
    return trainer


def relative_error(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    """||ours - ref|| / ||ref|| over all parameters together."""
    ref = dict(reference.named_parameters())
    diff = torch.cat([(ours[n].float() - ref[n].detach().float()).reshape(-1) for n in ref])
    base = torch.cat([ref[n].detach().float().reshape(-1) for n in ref])
    return float(diff.norm() / base.norm())


@pytest.fixture
def smart(tmp_path: Path) -> Callable[..., lightning_smartinf.SmartInfinityStrategy]:
    """A factory of strategies with their state under the test's tmp_path (thread I/O, torch Adam: no compiles)."""

    def build(**offload: Any) -> lightning_smartinf.SmartInfinityStrategy:
        update = {"host_adam": "torch", **offload.pop("update", {})}
        settings = {"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads", **offload}
        settings["nvme_path"] = str(settings["nvme_path"])
        return lightning_smartinf.SmartInfinityStrategy(offload=settings, update=update)

    build.root = tmp_path  # type: ignore[attr-defined]
    return build


def aio_is_pinned(buffer: torch.Tensor) -> bool:
    """DeepSpeed's own answer: whether its aio reads and writes ``buffer`` in place (no per-request bounce buffer)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from lightning_smartinf.ops import load_op

    return bool(load_op(AsyncIOBuilder()).aio_handle(1 << 20, 8, False, True, 1).is_pinned(buffer))
