"""Which model ``smartinf-train`` builds, with which tokenizer, and where its weights come from and go.

``model.kind=gpt``: the shipped GPT shaped by the recipe; its vocabulary follows ``data.tokenizer`` (rounded up to
a multiple of 64, as the GPT-3 recipes round 50,257 to 50,304) unless ``model.vocab_size`` is set on the command
line. ``model=hf``: a transformers causal LM from ``model.path`` (a local ``save_pretrained`` directory: its config,
its weights through ``init_from``, its tokenizer) or from a recipe's ``model.config`` (from scratch, the model's own
init), written back at the end as a ``save_pretrained`` directory that ``from_pretrained`` loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_smartinf.cli.config import TrainConfig
from lightning_smartinf.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from lightning_smartinf.ecosystem.hf import (
    TOKENIZER_FILES,
    checkpoint_dir,
    context_length,
    describe,
    finish_directory,
    load_config,
    saved_dtype,
)
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.models.gpt import GPTModule

log = logging.getLogger("smartinf-train")
VOCAB_MULTIPLE = 64


@dataclass
class ModelSpec:
    """What the run builds (``build``, called on meta), reads its weights from, and tokenizes with."""

    build: Callable[[], pl.LightningModule]
    tokenizer: Tokenizer
    init_from: str | None
    hf_config: Any = None
    lora: bool = False
    merge: bool = False

    def write_back(self, strategy: SmartInfinityStrategy, out: Path) -> Path:
        """The trained model as a ``save_pretrained`` directory: shards streamed from the engine's masters (one
        block in memory), the config and the tokenizer beside them. With LoRA, the adapter as PEFT writes it; with
        ``peft.merge`` also the merged model at ``out`` (adapters folded in block by block), the adapter beside."""
        if self.lora:
            adapter = self._write_adapter(strategy, out.with_name("adapter") if self.merge else out)
            if not self.merge:
                return adapter
        dtype = saved_dtype(self.hf_config)
        strategy.export(out, dtype=dtype, strip_prefix="model.", merge_adapters=self.merge)
        if strategy.is_global_zero:
            finish_directory(out, self.hf_config, dtype, self.tokenizer.source)
        return out

    def _write_adapter(self, strategy: SmartInfinityStrategy, out: Path) -> Path:
        """PEFT's adapter directory (adapter_config.json naming the base directory, adapter_model.safetensors),
        from the engine's masters, which hold only the adapters; ``from_pretrained`` of it loads base and adapter."""
        masters = strategy.consolidated_state_dict()
        module = strategy.lightning_module
        if strategy.is_global_zero and module is not None:
            state = {name.removeprefix("model."): value for name, value in masters.items()}
            peft_model: Any = module.model
            peft_model.save_pretrained(out, state_dict=state)
            finish_directory(out, None, "", self.tokenizer.source)
        return out


def choose_model(cfg: TrainConfig, explicit: frozenset[str] = frozenset()) -> ModelSpec:
    """The model and tokenizer ``cfg`` asks for, every mismatch between them an error before anything is written."""
    if cfg.peft.kind != "none" and cfg.model.kind != "hf":
        raise ConfigError(f"peft={cfg.peft.kind} adapts a Hugging Face model: add model=hf model.path=DIR")
    o = cfg.optim
    hyper: dict[str, Any] = {"lr": o.lr, "weight_decay": o.weight_decay, "betas": (o.betas[0], o.betas[1]),
             "warmup_steps": o.warmup_steps, "optimizer": o.name}  # fmt: skip
    if cfg.model.kind == "hf":
        return _hf(cfg, hyper)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    shape = cfg.model.shape()
    if cfg.data.tokenizer is not None and "model.vocab_size" not in explicit:
        shape.vocab_size = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        log.info("model.vocab_size=%d: data.tokenizer's %d ids, rounded up to a multiple of %d",
                 shape.vocab_size, tokenizer.vocab_size, VOCAB_MULTIPLE)  # fmt: skip
    _check_vocab(tokenizer, shape.vocab_size, "model.vocab_size")
    if isinstance(tokenizer, ByteTokenizer) and shape.vocab_size > 4 * tokenizer.vocab_size:
        log.warning("recipe %s declares %s token ids, but data.tokenizer is bytes (ids 0-255): %.1f%% of the "
                    "embedding never trains; give data.tokenizer=DIR (a local Hugging Face tokenizer)",
                    cfg.recipe_name, f"{shape.vocab_size:,}", 100 * (1 - 256 / shape.vocab_size))  # fmt: skip
    if cfg.data.seq_len > shape.block_size:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context, "
                          f"model.block_size={shape.block_size}")  # fmt: skip
    return ModelSpec(lambda: GPTModule(shape, **hyper), tokenizer, cfg.model.init_from)


def _hf(cfg: TrainConfig, hyper: dict[str, Any]) -> ModelSpec:
    from lightning_smartinf.models.hf import HFCausalLM

    lora: dict[str, Any] | None = None
    if cfg.peft.kind == "lora":
        if not cfg.model.path:
            raise ConfigError("peft=lora trains adapters over pretrained weights: give model.path=DIR")
        p = cfg.peft
        lora = {"r": p.r, "alpha": p.alpha, "dropout": p.dropout, "target_modules": list(p.target_modules)}
    source = checkpoint_dir(cfg.model.path) if cfg.model.path else None
    config = load_config(source, cfg.model.config)
    if source is not None and cfg.model.config:
        log.info("model.path=%s: its config.json describes the model; the recipe's model.config is not used", source)
    tokenizer = _hf_tokenizer(cfg, source)
    _check_vocab(tokenizer, config.vocab_size, f"the model's vocab_size ({source or 'model.config'})")
    context = context_length(config)
    if context is not None and cfg.data.seq_len > context:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context, "
                          f"max_position_embeddings={context}")  # fmt: skip
    log.info("model=hf: %s%s%s", describe(config), f", weights from {source}" if source else ", from scratch",
             f", LoRA r={lora['r']} on {', '.join(lora['target_modules'])}" if lora else "")  # fmt: skip
    # a LoRA base trained in bf16 stays in the checkpoint's bf16: stored, streamed and read at 2 bytes a weight
    base_dtype = torch.float32
    if lora is not None and cfg.trainer.precision.startswith("bf16") and saved_dtype(config) == "bf16":
        base_dtype = torch.bfloat16
    return ModelSpec(lambda: HFCausalLM(config, source=source, lora=lora, base_dtype=base_dtype, **hyper),
                     tokenizer, str(source) if source else None, config, lora is not None,
                     lora is not None and cfg.peft.merge)  # fmt: skip


def _hf_tokenizer(cfg: TrainConfig, source: Path | None) -> Tokenizer:
    """``data.tokenizer``, else the model directory's own tokenizer, else bytes (from scratch, no tokenizer)."""
    if cfg.data.tokenizer is not None:
        return HFTokenizer(cfg.data.tokenizer)
    if source is not None and any((source / name).is_file() for name in TOKENIZER_FILES):
        return HFTokenizer(str(source), "model.path")
    if source is not None:
        raise ConfigError(f"model.path={source} holds no tokenizer files: give data.tokenizer=DIR")
    return ByteTokenizer()


def _check_vocab(tokenizer: Tokenizer, vocab_size: int, what: str) -> None:
    if tokenizer.vocab_size > vocab_size:
        where = tokenizer.source or "bytes"
        raise ConfigError(f"the tokenizer ({where}) has {tokenizer.vocab_size:,} ids, more than {what}="
                          f"{vocab_size:,}: use the model's own tokenizer, or a larger vocabulary")  # fmt: skip
