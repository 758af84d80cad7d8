"""Local Hugging Face checkpoint directories: what ``model=hf model.path=DIR`` reads, and what the run writes back.

Nothing here downloads: a path that is not a local directory is an error, and transformers is always called with
``local_files_only``. Weights are read only from safetensors (a ``pytorch_model.bin`` is a pickle, which loading
would run as code). ``transformers`` is an optional extra; without it, the one-line error names the extra.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.errors import ConfigError, MissingPathError

EXTRA = "pip install 'lightning-smartinf[hf]'"
CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""What ``save_pretrained`` of a tokenizer writes (fast and slow forms): copied beside the fine-tuned weights."""


def require_transformers(what: str) -> Any:
    """The ``transformers`` module, or a one-line error naming the extra that brings it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs Hugging Face transformers, an optional extra: {EXTRA}") from None
    return transformers


def local_dir(path: str, key: str) -> Path:
    """``path`` as an existing local directory (never a hub id: nothing is downloaded)."""
    found = Path(path).expanduser()
    if not found.exists():
        raise MissingPathError(f"{key}={path!r} is not a local directory (nothing is downloaded: give the directory "
                               "that save_pretrained wrote)")  # fmt: skip
    if not found.is_dir():
        raise MissingPathError(f"{key}={path!r} is a file; give the directory that save_pretrained wrote")
    return found


def checkpoint_dir(path: str) -> Path:
    """``model.path``: a local ``save_pretrained`` directory with config.json and safetensors weights."""
    found = local_dir(path, "model.path")
    if not (found / CONFIG).is_file():
        raise MissingPathError(f"model.path={path!r} has no config.json: give a directory that save_pretrained wrote")
    if not any((found / name).is_file() for name in WEIGHTS):
        pickled = sorted(p.name for p in found.glob("*.bin"))
        hint = (f"; it holds {', '.join(pickled)} (pickle, which loading would run as code): convert it to "
                "safetensors once with save_pretrained(..., safe_serialization=True)") if pickled else ""
        raise MissingPathError(f"model.path={path!r} holds no safetensors weights (model.safetensors or "
                               f"model.safetensors.index.json){hint}")  # fmt: skip
    return found


def load_config(path: Path | None, overrides: dict[str, Any] | None) -> Any:
    """The model's ``PretrainedConfig``: ``path``'s config.json, or (training from scratch) one built from
    ``overrides``, a recipe's ``model.config`` whose ``model_type`` names the architecture."""
    transformers = require_transformers("model=hf")
    if path is not None:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    values = dict(overrides or {})
    kind = values.pop("model_type", None)
    if kind is None:
        raise ConfigError("model=hf needs model.path=DIR (a local save_pretrained directory) or a recipe's "
                          "model.config with a model_type (e.g. recipe=llama3_8b)")  # fmt: skip
    try:
        return transformers.AutoConfig.for_model(kind, **values)
    except ValueError as err:
        raise ConfigError(f"model.config.model_type={kind!r}: {err}") from None


def build_model(config: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM ``config`` describes, with parameters in ``dtype``: fp32 for training (the engine's masters;
    16-bit copies stream), the checkpoint's 16-bit dtype for a frozen base (stored and streamed as it is)."""
    transformers = require_transformers("model=hf")
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def with_lora(model: Any, lora: dict[str, Any], source: Path | None) -> Any:
    """``get_peft_model(model, LoraConfig(**lora))``: the base frozen, adapters on ``lora["target_modules"]``; a
    target that matches no module is PEFT's error, on one line."""
    try:
        import peft
    except ImportError:
        raise ConfigError("peft=lora needs PEFT, an optional extra: pip install 'lightning-smartinf[peft]'") from None
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM",
                             base_model_name_or_path=str(source) if source else None)  # fmt: skip
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        raise ConfigError(f"peft.target_modules={list(lora['target_modules'])}: {' '.join(str(err).split())}") from None


def saved_dtype(config: Any) -> str:
    """The dtype a fine-tuned directory is written in: the source's (``dtype`` in config.json), else bf16."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "bfloat16"
    return {"float32": "fp32", "float16": "fp16"}.get(name, "bf16")


def finish_directory(out: Path, config: Any, dtype: str, tokenizer_dir: Path | None) -> None:
    """Make ``out`` (shards already written by the engine's export) a directory ``from_pretrained`` loads: the
    config beside the weights (none for an adapter directory), and the tokenizer's files copied from where the run
    took them."""
    if config is not None:
        config.dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(dtype, torch.bfloat16)
        config.save_pretrained(out)
    if tokenizer_dir is None:
        return
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


def context_length(config: Any) -> int | None:
    """The longest sequence the model's positions cover (``max_position_embeddings`` and its aliases)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def describe(config: Any) -> str:
    """One line: architecture and shape, for the start-up log."""
    values = config.to_dict()
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    shape = ", ".join(f"{k}={values[k]}" for k in keys if k in values)
    return f"{values.get('model_type', '?')} ({shape})"
