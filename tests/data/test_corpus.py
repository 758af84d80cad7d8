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


def test_train_loader_resumes_after_the_last_consumed_batch(tmp_path: Path) -> None:
    """Lightning saves the loader's state_dict in a checkpoint; a new loader restored from it continues exactly."""
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text("".join(chr(32 + (i * j) % 90) for j in range(500)))
    module = TextDataModule(str(tmp_path), seq_len=8, batch_size=2, train_samples=10, val_samples=2)
    module.setup()
    straight = list(module.train_dataloader())
    first = module.train_dataloader()
    seen = [batch for _, batch in zip(range(3), first, strict=False)]
    resumed = module.train_dataloader()
    resumed.load_state_dict(first.state_dict())
    assert first.state_dict() == {"batches_consumed": 3}
    rest = list(resumed)
    assert len(seen) + len(rest) == len(straight) == 5
    assert all((a == b).all() for a, b in zip(seen + rest, straight, strict=True))
    assert len(list(resumed)) == 5  # the next epoch starts from the beginning again
