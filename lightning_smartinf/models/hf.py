"""A Hugging Face causal LM as the command line trains it (``model=hf``): built from its config with parameters on
meta, given values block by block by the engine (the checkpoint's through ``init_from``, or the model's own
``_init_weights``), trained on next-token batches, and written back as a ``save_pretrained`` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_smartinf.ecosystem.hf import build_model, with_lora
from lightning_smartinf.models.loss import inputs, next_token_loss, tokens_in_batch
from lightning_smartinf.models.optim import configure


class HFCausalLM(pl.LightningModule):
    """``self.model``: the transformers model ``config`` describes; its names, less the ``model.`` prefix, are the
    checkpoint's."""

    PREFIX = "model."

    def __init__(self, config: Any, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0, optimizer: str = "adamw",
                 source: Path | None = None, lora: dict[str, Any] | None = None,
                 base_dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters({"config": config.to_dict(), "lr": lr, "weight_decay": weight_decay,
                                   "betas": tuple(betas), "warmup_steps": warmup_steps, "optimizer": optimizer,
                                   "source": str(source) if source else None, "lora": lora})  # fmt: skip
        model = build_model(config, base_dtype)
        model.config.use_cache = False  # training: no key/value cache per forward
        self.model = with_lora(model, lora, source) if lora is not None else model
        self.lr, self.weight_decay, self.betas = lr, weight_decay, (betas[0], betas[1])
        self.warmup_steps, self.optimizer_name = warmup_steps, optimizer

    @property
    def config(self) -> Any:
        return self.model.config

    def init_weights(self, module: nn.Module) -> None:
        """The init route of a model trained from scratch on meta: the library's own ``_init_weights``."""
        self.model._init_weights(module)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(b, t) ids -> (b, t, vocab) logits."""
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]

    def tokens_in_batch(self, batch: Any) -> int:
        return tokens_in_batch(batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        return next_token_loss(self(inputs(batch)), batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return configure(self.parameters(), self.optimizer_name, self.lr, self.betas, self.weight_decay,
                         self.warmup_steps)  # fmt: skip
