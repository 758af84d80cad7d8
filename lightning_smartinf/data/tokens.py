"""Text tokenized once into memory-mapped token files, so a corpus larger than RAM trains with bounded memory and a
second run starts at once.

A corpus is the files ``data.path`` names (a text file, a ``.jsonl`` file, or a directory of them). Text files are
read in blocks of whole lines, encoded in batches, and appended to ``train.tokens`` or ``val.tokens`` (a file is in
val when crc32 of its relative path % 100 < val_percent; a single file's last val_percent of tokens are). Each
document ends with the tokenizer's EOS, so packed windows see where one ends. JSONL rows are ``{"text": ...}`` (text),
``{"prompt": ..., "response": ...}`` or ``{"messages": [...]}`` (instruction data: one example per row, the loss
masked on the prompt, ``.mask`` beside the tokens and ``.starts`` holding each example's offset); row i of a single
file is in val when crc32(i) % 100 < val_percent.

The cache directory's name is a hash of the tokenizer's fingerprint, the split rule and every file's path, size and
modification time, so a changed file or another tokenizer builds a new cache, never a stale read. A cache appears
under its name only when complete (built in a ``.partial`` directory, then renamed), so a killed build is redone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_smartinf.data.tokenizer import Tokenizer
from lightning_smartinf.errors import ConfigError, NotWritableError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
BLOCK_BYTES = 1 << 20
"""Text read and encoded per batch (whole lines): bounds the build's memory whatever the corpus size."""
PIECE_BYTES = 16 << 10
"""One text of an encode batch: fast tokenizers encode a batch's texts in parallel."""
SPLITS = ("train", "val")


@dataclass
class Split:
    """One split's tokens (memory-mapped) and, for instruction data, its loss mask and examples' start offsets."""

    tokens: np.ndarray
    mask: np.ndarray | None = None
    starts: np.ndarray | None = None


@dataclass
class TokenCache:
    directory: Path
    kind: str
    """``text`` (packed windows) or ``instruction`` (one example per sample, prompt masked)."""
    splits: dict[str, Split]
    meta: dict[str, Any]


def cache_key(files: list[Path], root: Path, tokenizer: Tokenizer, val_percent: int) -> str:
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, tokenizer.fingerprint, val_percent]).encode())
    for f in files:
        st = f.stat()
        digest.update(f"{f.relative_to(root) if f != root else f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def open_cache(files: list[Path], root: Path, tokenizer: Tokenizer, val_percent: int,
               cache_dir: Path) -> TokenCache:  # fmt: skip
    """The corpus's token cache under ``cache_dir``, built first if absent."""
    directory = cache_dir / f"tokens-{cache_key(files, root, tokenizer, val_percent)}"
    if not (directory / "meta.json").is_file():
        _build(files, root, tokenizer, val_percent, directory)
    else:
        log.info("tokens: cached in %s", directory)
    meta = json.loads((directory / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for name in SPLITS:
        tokens = _map(directory / f"{name}.tokens", dtype)
        if meta["kind"] == "instruction":
            splits[name] = Split(tokens, _map(directory / f"{name}.mask", np.dtype(np.uint8)),
                                 np.fromfile(directory / f"{name}.starts", dtype=np.int64))  # fmt: skip
        else:
            splits[name] = Split(tokens)
    return TokenCache(directory, meta["kind"], splits, meta)


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _Writer:
    """Appends one split's ids (and mask, and example starts) to its files."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.tokens = (directory / f"{name}.tokens").open("wb")
        self.mask = (directory / f"{name}.mask").open("wb")
        self.starts: list[int] = []
        self.count = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, example: bool = False) -> None:
        if example:
            self.starts.append(self.count)
        self.tokens.write(np.asarray(ids, dtype=self.dtype).tobytes())
        if mask is not None:
            self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.count += len(ids)

    def close(self, directory: Path, name: str) -> None:
        self.tokens.close()  # closing twice is allowed: a single text file's split closes its files first
        self.mask.close()
        np.asarray(self.starts + [self.count], dtype=np.int64).tofile(directory / f"{name}.starts")


class _Progress:
    """Rows, tokens and tokens/s every few seconds while a cache is built, and once at the end."""

    def __init__(self, every: float = 5.0) -> None:
        self.started = self.shown = time.perf_counter()
        self.rows = self.tokens = 0
        self.every = every

    def add(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        if time.perf_counter() - self.shown >= self.every:
            self.shown = time.perf_counter()
            log.info("tokenizing: %s", self.line())

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return (f"{self.rows:,} rows, {self.tokens:,} tokens in {seconds:.1f} s "
                f"({self.tokens / seconds:,.0f} tokens/s)")  # fmt: skip


def _build(files: list[Path], root: Path, tokenizer: Tokenizer, val_percent: int, directory: Path) -> None:
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as err:
        raise NotWritableError(f"the token cache cannot be written under {directory.parent} ({err.strerror}): "
                               "set data.cache_dir to a writable directory") from None  # fmt: skip
    log.info("tokenizing %d file(s) under %s into %s", len(files), root, directory)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    writers = {name: _Writer(staging, name, dtype) for name in SPLITS}
    progress = _Progress()
    kinds: set[str] = set()
    try:
        for f in files:
            if f.suffix.lower() == ".jsonl":
                kinds |= _add_rows(f, tokenizer, writers, val_percent if len(files) == 1 else None,
                                   _held_out(f, root, val_percent), progress)  # fmt: skip
            else:
                kinds.add("text")
                _add_text(f, tokenizer, writers, len(files) > 1 and _held_out(f, root, val_percent), progress)
        if len(kinds) > 1:
            raise ConfigError(f"data.path={root} mixes plain text and instruction rows: train on one kind at a time")
        kind = kinds.pop() if kinds else "text"
        if kind == "text" and len(files) == 1:
            _cut_single_text(staging, writers, val_percent)
        for name, writer in writers.items():
            writer.close(staging, name)
        total = sum(w.count for w in writers.values())
        if total == 0:
            raise ConfigError(f"data.path={root}: the corpus holds no tokens (empty files?)")
        meta = {"kind": kind, "dtype": dtype.name, "tokenizer": tokenizer.fingerprint, "vocab_size":
                tokenizer.vocab_size, "files": len(files), "rows": progress.rows,
                **{f"{name}_tokens": w.count for name, w in writers.items()},
                "seconds": round(time.perf_counter() - progress.started, 3)}  # fmt: skip
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        staging.rename(directory)
    except BaseException:
        for name, writer in writers.items():
            writer.close(staging, name)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("tokenized: %s", progress.line())


def _held_out(f: Path, root: Path, val_percent: int) -> bool:
    rel = f.relative_to(root).as_posix() if f != root else f.name
    return zlib.crc32(rel.encode()) % 100 < val_percent


def _blocks(path: Path) -> Iterator[list[bytes]]:
    """``path``'s bytes in pieces of whole lines, about BLOCK_BYTES per list."""
    with path.open("rb") as f:
        rest = b""
        while True:
            data = f.read(BLOCK_BYTES)
            if not data:
                break
            data = rest + data
            cut = data.rfind(b"\n") + 1 or len(data)
            rest = data[cut:]
            yield _pieces(data[:cut])
        if rest:
            yield _pieces(rest)


def _pieces(data: bytes) -> list[bytes]:
    pieces, start = [], 0
    while start < len(data):
        end = data.rfind(b"\n", start, start + PIECE_BYTES) + 1 if start + PIECE_BYTES < len(data) else len(data)
        end = end if end > start else min(start + PIECE_BYTES, len(data))
        pieces.append(data[start:end])
        start = end
    return pieces


def _add_text(f: Path, tokenizer: Tokenizer, writers: dict[str, _Writer], val: bool, progress: _Progress) -> None:
    writer = writers["val" if val else "train"]
    for pieces in _blocks(f):
        ids = tokenizer.encode_batch(list(pieces))
        for chunk in ids:
            writer.add(chunk)
        progress.add(sum(p.count(b"\n") for p in pieces), sum(len(c) for c in ids))
    if tokenizer.eos_id is not None:
        writer.add(np.asarray([tokenizer.eos_id]))


def _cut_single_text(staging: Path, writers: dict[str, _Writer], val_percent: int) -> None:
    """One text file (all written to train): its last val_percent of tokens become the validation split, moved
    in blocks (the file may be larger than memory)."""
    train, val = writers["train"], writers["val"]
    train.tokens.close()
    val.tokens.close()
    cut = train.count * (100 - val_percent) // 100
    with (staging / "train.tokens").open("r+b") as source, (staging / "val.tokens").open("wb") as target:
        source.seek(cut * train.dtype.itemsize)
        shutil.copyfileobj(source, target, BLOCK_BYTES)
        source.truncate(cut * train.dtype.itemsize)
    train.count, val.count = cut, train.count - cut


def _add_rows(f: Path, tokenizer: Tokenizer, writers: dict[str, _Writer], row_split: int | None, val: bool,
              progress: _Progress) -> set[str]:  # fmt: skip
    """One JSONL file's rows; ``row_split``: split rows by crc32 of their number (a single file)."""
    kinds: set[str] = set()
    with f.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = _row(f, number, line)
            held = zlib.crc32(str(number).encode()) % 100 < row_split if row_split is not None else val
            writer = writers["val" if held else "train"]
            if "text" in row:
                kinds.add("text")
                (ids,) = tokenizer.encode_batch([str(row["text"])])
                writer.add(ids)
                if tokenizer.eos_id is not None:
                    writer.add(np.asarray([tokenizer.eos_id]))
            else:
                kinds.add("instruction")
                ids, mask = _example(f, number, row, tokenizer)
                writer.add(ids, mask, example=True)
            progress.add(1, len(ids))
    return kinds


def _row(f: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ConfigError(f"{f}:{number}: not a JSON object ({err})") from None
    if not isinstance(row, dict) or not ({"text"} <= row.keys() or {"prompt", "response"} <= row.keys()
                                         or "messages" in row):  # fmt: skip
        keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{f}:{number}: a row needs \"text\", \"prompt\" and \"response\", or \"messages\"; "
                          f"this one has {keys}")  # fmt: skip
    return row


def _example(f: Path, number: int, row: dict[str, Any], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """An instruction row's ids and loss mask (True on the response, and the EOS that ends it)."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise ConfigError(f"{f}:{number}: \"messages\" must be a list of {{\"role\", \"content\"}} objects")
        chat_ids, trained = tokenizer.chat(messages)
        return np.asarray(chat_ids, dtype=np.int64), np.asarray(trained, dtype=bool)
    prompt, response = tokenizer.encode_batch([str(row["prompt"]), str(row["response"])])
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids = np.concatenate([prompt, response, np.asarray(end, dtype=np.int64)])
    mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(response) + len(end), bool)])
    return ids, mask
