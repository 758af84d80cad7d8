"""A GPT LightningModule with GPT-3 shapes: pre-LayerNorm blocks, causal scaled_dot_product_attention, tied head.

Every recipe trains this module. Its transformer blocks sit in one ``nn.ModuleList``, which is what the
horizontal schedule streams; embeddings, the final norm and the tied head stay resident.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lightning_smartinf.checkpoint.trainer_state import allow_legacy
from lightning_smartinf.engine.meta import building_on_meta
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.models.loss import inputs, next_token_loss, tokens_in_batch
from lightning_smartinf.models.optim import configure


@dataclass
class GPTConfig:
    """Shape of the network. Parameters: 12 * n_layer * n_embd^2 + (vocab_size + block_size) * n_embd + ..."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Model width."""
    vocab_size: int = 256
    """Token ids; 256 covers the byte-level tokenizer, GPT-3 recipes use 50304 for its shapes."""
    block_size: int = 256
    """Longest sequence (position embeddings)."""
    dropout: float = 0.0
    """Dropout after attention and MLP."""
    bias: bool = True
    """Bias in Linear and LayerNorm layers, as in GPT-2/3."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if self.vocab_size < 256:
            raise ConfigError(f"model.vocab_size={self.vocab_size} must be >= 256 for byte-level tokens")

    def num_params(self) -> int:
        d, layer_bias = self.n_embd, (13 if self.bias else 0)
        per_layer = 12 * d * d + layer_bias * d
        return self.n_layer * per_layer + (self.vocab_size + self.block_size) * d + (2 if self.bias else 1) * d


# Checkpoints of versions before the trainer state became plain data pickled this config: their trainer state may
# rebuild it (checkpoint/trainer_state.py), and only that load.
allow_legacy(GPTConfig)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> 3 x (b, n_head, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rng = torch.get_rng_state()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        if not building_on_meta():  # else the engine initializes it, block by block (engine/materialize.py)
            # the layers' default inits drew from the RNG; rewind it, so that init_weights draws what the engine's
            # block-by-block init of a meta-built GPT draws, in the same order: the same values either way
            torch.set_rng_state(rng)
            with torch.no_grad():
                self.apply(self.init_weights)

    def init_weights(self, module: nn.Module) -> None:
        """GPT-2's init of one submodule (``apply`` order, children first): N(0, 0.02) for Linear and Embedding,
        ones/zeros for LayerNorm, and the residual projections of a Block rescaled by 1/sqrt(2 n_layer). The same
        function initializes an eager model and, block by block, a meta-built one (``engine/materialize.py``)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, Block):
            for weight in (module.attn.proj.weight, module.out.weight):
                nn.init.normal_(weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(b, t) token ids -> (b, t, n_embd) hidden states."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, n_embd) -> (b, t, vocab) logits; the head is tied to the token embedding."""
        return F.linear(self.ln_f(x), self.wte.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GPTModule(pl.LightningModule):
    """Next-token prediction on (b, t+1) token windows, with AdamW and optional linear warmup."""

    def __init__(
        self,
        model: GPTConfig | dict | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # in every checkpoint, so an export can rebuild the module (from_safetensors)
        self.cfg = GPTConfig(**model) if isinstance(model, dict) else model or GPTConfig()  # a checkpoint's: a dict
        self.gpt = GPT(self.cfg)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, (betas[0], betas[1])
        self.warmup_steps = warmup_steps
        self.optimizer_name = optimizer

    @classmethod
    def from_safetensors(cls, path: str | Path) -> GPTModule:
        """The module an ``smartinf-export`` file describes, with its weights loaded (no strategy needed)."""
        with safe_open(str(path), "pt") as f:
            hyper = json.loads((f.metadata() or {}).get("hyper_parameters", "{}"))
        if "model" not in hyper:
            raise ConfigError(f"{path} has no GPT hyper-parameters: build the GPTModule yourself and load_state_dict")
        module = cls(**{**hyper, "model": GPTConfig(**hyper["model"])})
        module.load_state_dict(load_file(str(path)))
        return module

    def init_weights(self, module: nn.Module) -> None:
        """The init route of a meta-built GPT (``trainer.init_module(empty_init=True)``): GPT's own."""
        self.gpt.init_weights(module)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def tokens_in_batch(self, batch: Any) -> int:
        """Tokens predicted in a (b, t+1) batch: b * t (read by the progress monitor)."""
        return tokens_in_batch(batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        return next_token_loss(self(inputs(batch)), batch)

    # -- the vertical-schedule protocol (docs/vertical.md) -----------------------------------------------------------
    def vertical_pre(self, batch: Any) -> torch.Tensor:
        """Resident layers before the blocks: (b, t+1) tokens -> (b, t, n_embd)."""
        return self.gpt.embed(inputs(batch))

    def vertical_loss(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        """Resident layers after the blocks, and the loss."""
        return next_token_loss(self.gpt.head(hidden), batch)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)  # the mean over ranks when data parallel
        return loss

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(inputs(batch)).argmax(-1)

    def configure_optimizers(self) -> Any:
        return configure(self.parameters(), self.optimizer_name, self.lr, self.betas, self.weight_decay,
                         self.warmup_steps)  # fmt: skip
