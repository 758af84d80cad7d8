"""Tiny Hugging Face checkpoints made locally, for tests and the worked example (docs/fine_tuning.md): a byte-level
BPE tokenizer trained in seconds on this Python's standard library source, and a random-init model of a real
architecture (Llama, Qwen2 with tied embeddings, Mistral) saved by ``save_pretrained`` in shards. Nothing is
downloaded.

    python -m lightning_smartinf.ecosystem.tiny OUT --arch llama --vocab 512
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.ecosystem.hf import require_transformers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A minimal chat template: each turn ``<|role|>content<|end|>`` (the roles and markers are the BPE's specials)."""
SPECIALS = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]

SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
}  # fmt: skip


def stdlib_texts(limit_bytes: int) -> Iterator[str]:
    """This Python's standard library source, file by file, up to about ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        yield text
        seen += len(text)
        if seen >= limit_bytes:
            return


def make_tokenizer(out: Path, vocab: int = 512, sample_bytes: int = 2_000_000) -> Any:
    """A byte-level BPE with ``vocab`` ids, EOS ``<|end|>`` and a chat template, saved under ``out``."""
    transformers = require_transformers("a tiny tokenizer")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(stdlib_texts(sample_bytes), trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def make_model(out: Path, arch: str = "llama", vocab: int = 512, seed: int = 0, shard: str = "100KB",
               **overrides: Any) -> Any:  # fmt: skip
    """A random-init ``arch`` model (``SHAPES``) saved under ``out`` in shards of ``shard``."""
    transformers = require_transformers("a tiny model")
    values = {**SHAPES[arch], "vocab_size": vocab, **overrides}
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size=shard)
    return model


def make_checkpoint(out: Path, arch: str = "llama", vocab: int = 512, seed: int = 0, shard: str = "100KB") -> Path:
    """Tokenizer and model in one ``save_pretrained`` directory, as a model hub's would be."""
    tokenizer = make_tokenizer(out, vocab)
    make_model(out, arch, len(tokenizer), seed, shard, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_checkpoint(args.out, args.arch, args.vocab, args.seed)
    print(f"wrote {args.out}: a {args.arch} checkpoint and its tokenizer")


if __name__ == "__main__":
    main()
