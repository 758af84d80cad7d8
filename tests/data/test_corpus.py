"""The default corpus needs no download, splits deterministically, and user text works."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_smartinf.data.corpus import TextDataModule, TokenWindows, load_split


def test_stdlib_corpus_is_large_and_split_deterministically() -> None:
    train, val = load_split(None, 5)
    again_train, again_val = load_split(None, 5)
    assert len(train) > 5_000_000 and len(val) > 100_000
    assert (train[:1000] == again_train[:1000]).all() and len(val) == len(again_val)


def test_user_directory(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text("hello smart infinity " * 50)
    module = TextDataModule(str(tmp_path), seq_len=16, batch_size=2, train_samples=10, val_samples=4)
    module.setup()
    batch = next(iter(module.train_dataloader()))
    assert batch.shape == (2, 17) and int(batch.max()) < 256


def test_missing_path_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_split(str(tmp_path / "nope"), 5)


def test_windows_need_enough_tokens() -> None:
    import numpy as np

    with pytest.raises(ValueError, match="data.seq_len"):
        TokenWindows(np.zeros(10, dtype=np.uint8), seq_len=32, num_samples=1, seed=0)
