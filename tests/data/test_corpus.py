"""The default corpus needs no download, splits deterministically, and user text works."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_smartinf.data.corpus import ResumableLoader, TextDataModule, TokenWindows, load_split


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
    assert first.state_dict() == {"samples_consumed": 6}
    rest = list(resumed)
    assert len(seen) + len(rest) == len(straight) == 5
    assert all((a == b).all() for a, b in zip(seen + rest, straight, strict=True))
    assert len(list(resumed)) == 5  # the next epoch starts from the beginning again


def test_a_loader_resumed_on_another_rank_count_neither_skips_nor_repeats(tmp_path: Path) -> None:
    """Two ranks with batch 2 take 3 batches each (samples 0-11, interleaved); one rank with batch 4 (the same
    global batch) restored from rank 0's state continues at sample 12, and two ranks restored from one rank's state
    continue where it stopped, each taking every other sample."""
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text("".join(chr(32 + (i * j) % 90) for j in range(500)))
    module = TextDataModule(str(tmp_path), seq_len=8, batch_size=2, train_samples=24, val_samples=2)
    module.setup()
    dataset = module.train_dataloader().dataset
    every = [dataset[i] for i in range(24)]

    def loader(batch: int, rank: int, world: int) -> ResumableLoader:
        return ResumableLoader(dataset, batch_size=batch, num_workers=0, rank=rank, world=world)

    two = [loader(2, r, 2) for r in range(2)]
    taken = [[b for _, b in zip(range(3), iter(rank), strict=False)] for rank in two]
    assert taken[0][0][0].equal(every[0]) and taken[1][0][0].equal(every[1]) and taken[1][0][1].equal(every[3])
    one = loader(4, 0, 1)
    one.load_state_dict(two[0].state_dict())
    rest = [row for batch in one for row in batch]
    assert len(rest) == 12 and all(a.equal(b) for a, b in zip(rest, every[12:], strict=True))

    first = loader(4, 0, 1)
    seen = [b for _, b in zip(range(2), iter(first), strict=False)]  # samples 0-7
    assert first.state_dict() == {"samples_consumed": 8}
    halves = [loader(2, r, 2) for r in range(2)]
    for half in halves:
        half.load_state_dict(first.state_dict())
    rows = [[row for batch in half for row in batch] for half in halves]
    assert all(a.equal(b) for a, b in zip(rows[0], every[8::2], strict=True)) and len(rows[0]) == 8
    assert all(a.equal(b) for a, b in zip(rows[1], every[9::2], strict=True)) and len(rows[1]) == 8
    assert len(seen) == 2
