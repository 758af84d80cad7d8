"""Shared test helpers: tiny GPT modules, random token data, Trainers on CPU, and comparisons against torch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_smartinf.models.gpt import GPTConfig, GPTModule

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)


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
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, loader if loader is not None else token_loader(), ckpt_path=ckpt_path)
    return trainer


def relative_error(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    """||ours - ref|| / ||ref|| over all parameters together."""
    ref = dict(reference.named_parameters())
    diff = torch.cat([(ours[n].float() - ref[n].detach().float()).reshape(-1) for n in ref])
    base = torch.cat([ref[n].detach().float().reshape(-1) for n in ref])
    return float(diff.norm() / base.norm())


def aio_is_pinned(buffer: torch.Tensor) -> bool:
    """DeepSpeed's own answer: whether its aio reads and writes ``buffer`` in place (no per-request bounce buffer)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from lightning_smartinf.ops import load_op

    return bool(load_op(AsyncIOBuilder()).aio_handle(1 << 20, 8, False, True, 1).is_pinned(buffer))
