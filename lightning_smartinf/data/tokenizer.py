"""Tokenizers the data pipeline takes: bytes (the tiny recipe's default) or a Hugging Face tokenizer from a local
directory (``data.tokenizer=DIR``; for ``model=hf`` the model's own). Both encode whole texts to id lists and say
what identifies them, so a token cache built with one is never read with another."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lightning_smartinf.ecosystem.hf import TOKENIZER_FILES, local_dir, require_transformers
from lightning_smartinf.errors import ConfigError


class Tokenizer(Protocol):
    vocab_size: int
    """Ids run from 0 to vocab_size - 1."""
    eos_id: int | None
    """Appended after each document (packing keeps documents apart), and pads instruction examples."""
    fingerprint: str
    """What identifies the vocabulary and rules, for the token cache's key."""
    source: Path | None
    """The directory the tokenizer came from (its files are copied beside a fine-tuned model)."""

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        """Each text's ids (bytes are UTF-8; invalid sequences become U+FFFD for a vocabulary of text)."""
        ...

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """A conversation's ids, and for each whether the loss counts it (the assistant's turns)."""
        ...


class ByteTokenizer:
    """Bytes as ids 0-255: no vocabulary to ship, every text encodes."""

    vocab_size: int = 256
    eos_id: int | None = None
    fingerprint: str = "bytes"
    source: Path | None = None

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        return _chat_without_template(self, messages)


class HFTokenizer:
    """``AutoTokenizer.from_pretrained(DIR, local_files_only=True)``: a fast (Rust) tokenizer encodes in batches."""

    def __init__(self, path: str, key: str = "data.tokenizer") -> None:
        directory = local_dir(path, key)
        transformers = require_transformers(f"{key}={path}")
        try:
            self.hf = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{key}={path!r} holds no tokenizer transformers can load: {err}") from None
        self.source: Path | None = directory
        self.vocab_size: int = len(self.hf)
        self.eos_id: int | None = self.hf.eos_token_id
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                digest.update(name.encode() + (directory / name).read_bytes())
        self.fingerprint: str = f"hf-{digest.hexdigest()[:16]}"

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        decoded = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(ids, dtype=np.int64) for ids in self.hf(decoded, add_special_tokens=False)["input_ids"]]

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """With a chat template: the conversation rendered by it; the assistant's turns are the tokens the
        template adds for each assistant message (rendering the prefix up to it, then through it)."""
        if not getattr(self.hf, "chat_template", None):
            return _chat_without_template(self, messages)
        ids: list[int] = []
        mask: list[bool] = []
        for i, message in enumerate(messages):
            upto = self.hf.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
            if isinstance(upto, dict):  # some versions return a BatchEncoding
                upto = upto["input_ids"]
            added = list(upto[len(ids) :])
            ids += added
            mask += [message.get("role") == "assistant"] * len(added)
        return ids, mask


def _chat_without_template(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """No template: ``role: content`` lines, the assistant's trained."""
    ids: list[int] = []
    mask: list[bool] = []
    for message in messages:
        role, content = message.get("role", "user"), str(message.get("content", ""))
        head, body = (a.tolist() for a in tokenizer.encode_batch([f"{role}: ", f"{content}\n"]))
        ids += head + body
        mask += [False] * len(head) + [role == "assistant"] * len(body)
    return ids, mask


def load_tokenizer(path: str | None) -> Tokenizer:
    """``data.tokenizer``: null for bytes, or a local directory with a Hugging Face tokenizer."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
