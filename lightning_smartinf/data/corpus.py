"""The default corpus (this Python's standard library source) or the user's text and instruction data, as token
windows for training.

Nothing is downloaded and nothing is copied into the repository: the standard library is located with
``sysconfig``. Files are split into train and validation by a hash of their relative path, so the split is the
same on every machine with the same files. The default corpus with the byte-level tokenizer is read into memory
(ids 0-255); any other corpus or tokenizer goes through the memory-mapped token cache (``data/tokens.py``).
"""

from __future__ import annotations

import logging
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_smartinf.data.tokenizer import ByteTokenizer, Tokenizer
from lightning_smartinf.data.tokens import Split, open_cache
from lightning_smartinf.errors import ConfigError, MissingPathError

log = logging.getLogger(__name__)
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".html", ".csv", ".yaml", ".yml",
                 ".toml"}  # fmt: skip
CACHE_NAME = ".smartinf_cache"
"""The token cache's directory beside the data (``data.cache_dir`` puts it elsewhere); never read as data."""
IGNORE_INDEX = -100
"""Label of a position the loss skips (a prompt token, padding), as torch's cross_entropy and HF models take it."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_files(path: str | None) -> tuple[Path, list[Path]]:
    """The root and sorted text files of ``data.path`` (a file or directory), or of the standard library."""
    if path is None:
        root = stdlib_root()
        files = [f for f in root.rglob("*.py") if "site-packages" not in f.parts and "dist-packages" not in f.parts]
        return root, sorted(files)
    root = Path(path).expanduser()
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise MissingPathError(f"data.path={path!r} is neither a file nor a directory")
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                   and CACHE_NAME not in f.relative_to(root).parts)  # fmt: skip
    if not files:
        raise MissingPathError(f"data.path={path!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return root, files


def load_split(path: str | None, val_percent: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 token arrays; a file is in val when crc32(its relative path) % 100 < val_percent."""
    root, files = collect_files(path)
    train: list[bytes] = []
    val: list[bytes] = []
    for f in files:
        rel = f.relative_to(root).as_posix() if f != root else f.name
        target = val if zlib.crc32(rel.encode()) % 100 < val_percent else train
        target.append(f.read_bytes())
    if len(files) == 1:  # one file: split its bytes instead
        data = train[0] if train else val[0]
        cut = len(data) * (100 - val_percent) // 100
        train, val = [data[:cut]], [data[cut:]]
    return (np.frombuffer(b"".join(train), dtype=np.uint8), np.frombuffer(b"".join(val), dtype=np.uint8))


class TokenWindows(Dataset[torch.Tensor]):
    """``num_samples`` windows of ``seq_len + 1`` tokens at offsets fixed by ``seed``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, num_samples: int, seed: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise ConfigError(f"the corpus split has {len(tokens)} tokens, fewer than data.seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len = tokens, seq_len
        self.offsets = np.random.default_rng(seed).integers(0, len(tokens) - seq_len - 1, size=num_samples)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.offsets[i])
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class Examples(Dataset[dict[str, torch.Tensor]]):
    """Instruction examples, one per sample (``num_samples`` drawn with a fixed seed): ``tokens`` (seq_len + 1 ids,
    truncated or padded) and ``labels`` (seq_len next-token targets, IGNORE_INDEX on the prompt and the padding)."""

    def __init__(self, split: Split, seq_len: int, num_samples: int, seed: int, pad_id: int) -> None:
        assert split.starts is not None and split.mask is not None
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        count = len(split.starts) - 1
        self.order = np.random.default_rng(seed).integers(0, count, size=num_samples) if count else np.zeros(0, int)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        assert self.split.starts is not None and self.split.mask is not None
        e = int(self.order[i])
        start, end = int(self.split.starts[e]), int(self.split.starts[e + 1])
        end = min(end, start + self.seq_len + 1)
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        tokens[: end - start] = self.split.tokens[start:end]
        trained = np.zeros(self.seq_len + 1, dtype=bool)
        trained[: end - start] = self.split.mask[start:end]
        labels = np.where(trained[1:], tokens[1:], IGNORE_INDEX)  # (seq_len,): the target of each position
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels)}


class ResumableLoader(DataLoader[torch.Tensor]):
    """A sequential DataLoader that Lightning checkpoints mid-epoch (it calls ``state_dict``/``load_state_dict`` on
    loaders that have them): a resumed run continues with the sample after the last one trained, not the epoch's
    first, so resuming reproduces the data order of an uninterrupted run. Data parallel: rank ``rank`` of ``world``
    takes samples ``s + rank, s + rank + world, ...`` from the epoch's (or the resume's) start ``s``, as an
    unshuffled DistributedSampler, every rank the same count. The position is kept in samples, not batches, so a run
    resumed on another number of ranks (or with another batch size) neither skips nor repeats a sample."""

    def __init__(
        self, dataset: Dataset[torch.Tensor], batch_size: int, num_workers: int, rank: int = 0, world: int = 1
    ) -> None:
        self.rank, self.world = rank, world
        self._skip = 0  # samples (of all ranks) to skip at the next __iter__ (set by load_state_dict)
        self._start = 0  # the sample the current pass began at
        self._consumed = 0  # samples of all ranks taken in the current pass, as of this rank's batches
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, sampler=_FromSampler(self))

    def __iter__(self) -> Iterator[torch.Tensor]:  # type: ignore[override]
        self._start, self._skip = self._skip, 0
        self._consumed = self._start
        left = len(self._indices())
        for batch in super().__iter__():
            took = min(self.batch_size or 1, left)  # the last batch may be short
            left -= took
            self._consumed += took * self.world
            yield batch

    def _indices(self) -> range:
        """This rank's samples in the current pass."""
        return range(self._start + self.rank, len(self.sampler) * self.world, self.world)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "samples_consumed" in state:
            self._skip = state["samples_consumed"]
        else:  # written before positions were kept in samples, by a run with this batch size and rank count
            self._skip = state["batches_consumed"] * (self.batch_size or 1) * self.world


class _FromSampler(Sampler[int]):
    """This rank's indices in order, from the loader's resume point on."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.dataset) // self.loader.world  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.loader._indices())


def default_cache_dir(path: str | None) -> Path:
    """Beside the data (``.smartinf_cache`` in its directory); the standard library's in the user's cache."""
    if path is None:
        return Path("~/.cache/lightning_smartinf").expanduser()
    root = Path(path).expanduser()
    return (root if root.is_dir() else root.parent) / CACHE_NAME


class TextDataModule(pl.LightningDataModule):
    """Train and validation samples of ``data.path``: packed windows of text, or instruction examples (batches
    of ``{"tokens", "labels"}``); validation may be empty (a small instruction file), training may not."""

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_percent: int = 5,
        train_samples: int = 1_000_000,
        val_samples: int = 256,
        num_workers: int = 0,
        seed: int = 1234,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.val_percent, self.train_samples, self.val_samples = val_percent, train_samples, val_samples
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(path)
        self.kind = "text"
        self.train: Dataset[Any] | None = None
        self.val: Dataset[Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        if self.path is None and isinstance(self.tokenizer, ByteTokenizer):
            train, val = load_split(self.path, self.val_percent)
            self.train = TokenWindows(train, self.seq_len, self.train_samples, self.seed)
            self.val = TokenWindows(val, self.seq_len, self.val_samples, self.seed + 1)
            return
        root, files = collect_files(self.path)
        cache = open_cache(files, root, self.tokenizer, self.val_percent, self.cache_dir)
        self.kind = cache.kind
        self.train = self._samples(cache.splits["train"], self.train_samples, self.seed, "train")
        self.val = self._samples(cache.splits["val"], self.val_samples, self.seed + 1, "val")

    def _samples(self, split: Split, count: int, seed: int, name: str) -> Dataset[Any]:
        if self.kind == "instruction":
            examples = len(split.starts) - 1 if split.starts is not None else 0
            if not examples and name == "train":
                raise ConfigError(f"data.path={self.path}: no training examples (all rows fell in validation?)")
            pad = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
            return Examples(split, self.seq_len, count if examples else 0, seed, pad)
        if name == "train" and len(split.tokens) <= self.seq_len + 1:
            raise ConfigError(f"data.path={self.path}: the training split holds {len(split.tokens)} tokens, fewer than "
                              f"data.seq_len + 2 = {self.seq_len + 2} (an empty or tiny corpus)")  # fmt: skip
        if name == "val" and len(split.tokens) <= self.seq_len + 1:
            log.warning("data: the validation split has %d tokens, too few for one window of data.seq_len=%d: "
                        "no validation", len(split.tokens), self.seq_len)  # fmt: skip
            return TokenWindows(np.zeros(self.seq_len + 2, dtype=np.uint16), self.seq_len, 0, seed)
        return TokenWindows(split.tokens, self.seq_len, count, seed)

    def _loader(self, dataset: Dataset[Any] | None) -> DataLoader[Any]:
        assert dataset is not None, "call setup() first"
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader[Any]:
        assert self.train is not None, "call setup() first"
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return ResumableLoader(self.train, self.batch_size, self.num_workers, rank, world)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val)

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val)
