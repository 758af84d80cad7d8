"""The default corpus (this Python's standard library source) or the user's text, as byte-level token windows.

Nothing is downloaded and nothing is copied into the repository: the standard library is located with
``sysconfig``. Files are split into train and validation by a hash of their relative path, so the split is the
same on every machine with the same files. Tokens are bytes (ids 0-255).
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_smartinf.errors import ConfigError, MissingPathError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".html", ".csv", ".yaml", ".yml", ".toml"}


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
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
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


class ResumableLoader(DataLoader[torch.Tensor]):
    """A sequential DataLoader that Lightning checkpoints mid-epoch (it calls ``state_dict``/``load_state_dict`` on
    loaders that have them): a resumed run continues with the batch after the last one trained, not the epoch's
    first, so resuming reproduces the data order of an uninterrupted run. Data parallel: rank ``rank`` of ``world``
    takes samples ``rank, rank + world, ...`` (as an unshuffled DistributedSampler), every rank the same count."""

    def __init__(
        self, dataset: Dataset[torch.Tensor], batch_size: int, num_workers: int, rank: int = 0, world: int = 1
    ) -> None:
        self.rank, self.world = rank, world
        self._skip = 0  # batches to skip at the next __iter__ (set by load_state_dict)
        self._start = 0  # where the current pass began
        self._consumed = 0
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, sampler=_FromSampler(self))

    def __iter__(self) -> Iterator[torch.Tensor]:  # type: ignore[override]
        self._start, self._skip = self._skip, 0
        self._consumed = self._start
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["batches_consumed"]


class _FromSampler(Sampler[int]):
    """Indices in order, from the loader's resume point on."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.dataset) // self.loader.world  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        loader = self.loader
        mine = range(loader.rank, len(self) * loader.world, loader.world)
        return iter(mine[loader._start * (loader.batch_size or 1) :])


class TextDataModule(pl.LightningDataModule):
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
    ) -> None:
        super().__init__()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.val_percent, self.train_samples, self.val_samples = val_percent, train_samples, val_samples
        self.num_workers, self.seed = num_workers, seed
        self.train: TokenWindows | None = None
        self.val: TokenWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train is None:
            train, val = load_split(self.path, self.val_percent)
            self.train = TokenWindows(train, self.seq_len, self.train_samples, self.seed)
            self.val = TokenWindows(val, self.seq_len, self.val_samples, self.seed + 1)

    def _loader(self, dataset: Dataset[torch.Tensor] | None) -> DataLoader[torch.Tensor]:
        assert dataset is not None, "call setup() first"
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        assert self.train is not None, "call setup() first"
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return ResumableLoader(self.train, self.batch_size, self.num_workers, rank, world)

    def val_dataloader(self) -> DataLoader[torch.Tensor]:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader[torch.Tensor]:
        return self._loader(self.val)

    def predict_dataloader(self) -> DataLoader[torch.Tensor]:
        return self._loader(self.val)
