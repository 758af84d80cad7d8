"""Checkpoint directories: published whole or not at all, verified file by file, disk-full named, recoverable."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from lightning_smartinf.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriter,
    DiskFullError,
    files,
    latest_checkpoint,
    manifest,
    verify_checkpoint,
)


def write_checkpoint(target: Path, step: int, payload: bytes = b"x" * 10_000, sources: Path | None = None) -> Path:
    source = (sources or target.parent) / f"source-{step}"
    source.write_bytes(payload)
    with CheckpointWriter(target, 2 * len(payload)) as writer:
        writer.copy(source, "offload/state0/master/sg000000")
        writer.write("trainer_state.pt", b"trainer %d" % step)
        writer.publish({"global_step": step})
    return target


def test_published_checkpoint_verifies_and_lists_every_file(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "a.ckpt", 3)
    found = verify_checkpoint(target)
    assert set(found.files) == {"offload/state0/master/sg000000", "trainer_state.pt"}
    assert found.meta == {"global_step": 3} and found.nbytes == 10_000 + len(b"trainer 3")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("damage", "reported"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:4096]), "offload/state0/master/sg000000: truncated (4096 bytes"),
        (lambda f: f.write_bytes(b"y" + f.read_bytes()[1:]), "offload/state0/master/sg000000: contents altered"),
        (lambda f: f.unlink(), "offload/state0/master/sg000000: missing"),
    ],
)
def test_damaged_file_is_named_and_nothing_is_loaded(tmp_path: Path, damage, reported: str) -> None:
    target = write_checkpoint(tmp_path / "a.ckpt", 3)
    damage(target / "offload/state0/master/sg000000")
    with pytest.raises(CheckpointCorruptError, match="was not loaded") as err:
        verify_checkpoint(target)
    assert reported in str(err.value)


def test_altered_manifest_is_refused(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "a.ckpt", 3)
    raw = json.loads((target / "manifest.json").read_text())
    raw["meta"]["global_step"] = 99
    (target / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointCorruptError, match="manifest.json is altered"):
        verify_checkpoint(target)


def test_failed_save_leaves_the_previous_checkpoint_and_no_staging(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "last.ckpt", 1)
    with pytest.raises(RuntimeError, match="boom"), CheckpointWriter(target, 10) as writer:
        writer.write("trainer_state.pt", b"new")
        raise RuntimeError("boom")
    assert verify_checkpoint(target).meta["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "source-1"]


def test_a_directory_without_manifest_is_never_taken_for_a_checkpoint(tmp_path: Path) -> None:
    half = tmp_path / "half.ckpt"
    (half / "offload").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(half)
    write_checkpoint(tmp_path / "old.ckpt", 2)
    assert latest_checkpoint(tmp_path) == (tmp_path / "old.ckpt").absolute()


def test_latest_checkpoint_recovers_one_killed_between_its_renames(tmp_path: Path) -> None:
    """Replacing last.ckpt renames it away, then renames the new one in; a kill between leaves neither name."""
    target = write_checkpoint(tmp_path / "last.ckpt", 2)
    os.rename(target, tmp_path / ".last.ckpt.replaced-1")
    staged = write_checkpoint(tmp_path / "staged", 4)
    os.rename(staged, tmp_path / ".last.ckpt.partial-1")
    assert latest_checkpoint(tmp_path) == target.absolute()
    assert verify_checkpoint(target).meta["global_step"] == 4
    assert not list(tmp_path.glob(".last.ckpt.*"))


def test_stale_unfinished_staging_of_a_dead_process_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".b.ckpt.partial-999999999"
    (stale / "offload").mkdir(parents=True)
    write_checkpoint(tmp_path / "a.ckpt", 1)
    assert not stale.exists()


def test_disk_full_is_checked_before_writing(tmp_path: Path) -> None:
    previous = write_checkpoint(tmp_path / "a.ckpt", 1)
    with pytest.raises(DiskFullError, match=r"b\.ckpt needs 1\.00 TiB|b\.ckpt needs 1024\.00 GiB"):
        CheckpointWriter(tmp_path / "b.ckpt", 2**40)
    assert verify_checkpoint(previous) and not (tmp_path / "b.ckpt").exists()


def test_disk_full_while_writing_names_path_and_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC in the middle of a copy: a clear error, the staging directory gone, the last checkpoint intact."""
    previous = write_checkpoint(tmp_path / "last.ckpt", 1)
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if len(data) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", full)
    with pytest.raises(DiskFullError, match=r"disk full: the checkpoint at .*last\.ckpt needs 19\.53 KiB"):
        write_checkpoint(tmp_path / "last.ckpt", 2)
    assert verify_checkpoint(previous).meta["global_step"] == 1
    assert not list(tmp_path.glob(".*"))


def test_real_full_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MiB tmpfs (needs mount permission, as root in CI): a 2 MiB checkpoint is refused up front."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        previous = write_checkpoint(mount / "a.ckpt", 1, sources=tmp_path)
        with pytest.raises(DiskFullError, match="disk full"):
            write_checkpoint(mount / "b.ckpt", 2, payload=b"z" * (2 << 20), sources=tmp_path)
        monkeypatch.setattr(manifest, "free_bytes", lambda path: 1 << 30)  # passes the up-front check, then
        with pytest.raises(DiskFullError, match="disk full"):  # really runs out
            write_checkpoint(mount / "c.ckpt", 3, payload=b"z" * (1536 << 10), sources=tmp_path)
        assert verify_checkpoint(previous).meta["global_step"] == 1
    finally:
        os.system(f"umount {mount}")


def test_disk_full_says_whether_an_earlier_checkpoint_is_kept(tmp_path: Path) -> None:
    with pytest.raises(DiskFullError, match="no earlier checkpoint exists there"):
        CheckpointWriter(tmp_path / "a.ckpt", 2**60)
    previous = write_checkpoint(tmp_path / "a.ckpt", 1)
    with pytest.raises(DiskFullError, match=rf"\({previous.absolute()} is untouched\)"):
        CheckpointWriter(tmp_path / "b.ckpt", 2**60)


def _alter_file(ckpt: Path) -> None:
    data = ckpt / "offload/state0/master/sg000000"
    data.write_bytes(b"y" + data.read_bytes()[1:])


def _alter_manifest(ckpt: Path) -> None:
    raw = json.loads((ckpt / "manifest.json").read_text())
    raw["meta"]["global_step"] = 99
    (ckpt / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_alter_file, "contents altered"),
        (lambda ckpt: (ckpt / "offload/state0/master/sg000000").unlink(), "sg000000: missing"),
        (lambda ckpt: (ckpt / "manifest.json").unlink(), "no manifest.json"),
        (_alter_manifest, "manifest.json is altered"),
    ],
)
def test_resume_folder_falls_back_to_the_newest_intact_checkpoint_for_every_damage(
    tmp_path: Path, damage, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One rule: the newest complete and intact checkpoint, each newer one skipped loudly with its reason."""
    sources = tmp_path / "sources"
    sources.mkdir()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for step in (2, 4, 6):
        write_checkpoint(ckpts / f"step{step}.ckpt", step, sources=sources)
    damage(ckpts / "step6.ckpt")
    chosen, skipped = manifest.choose_checkpoint(ckpts)
    assert chosen is not None and chosen.meta["global_step"] == 4
    assert [(p.name, reason in why) for p, why in skipped] == [("step6.ckpt", True)]
    assert any("skipping" in r.message and "step6.ckpt" in r.message and r.levelname == "WARNING"
               for r in caplog.records)  # fmt: skip
    assert latest_checkpoint(ckpts) == ckpts / "step4.ckpt"
    assert (ckpts / "step6.ckpt").is_dir()  # reported, never deleted


def test_resume_folder_cleans_what_killed_saves_left(tmp_path: Path) -> None:
    """Dead processes' staging and replaced directories go (after recovery took what it could); a live one's stay."""
    kept = write_checkpoint(tmp_path / "step2.ckpt", 2)
    dead_unfinished = tmp_path / ".step4.ckpt.partial-999999999"
    (dead_unfinished / "offload").mkdir(parents=True)
    dead_complete = write_checkpoint(tmp_path / "staged", 2)  # complete, but its target was published since
    os.rename(dead_complete, tmp_path / ".step2.ckpt.partial-999999998")
    live = tmp_path / f".step6.ckpt.partial-{os.getpid()}"
    live.mkdir()
    chosen, skipped = manifest.choose_checkpoint(tmp_path)
    assert chosen is not None and chosen.path == kept.absolute() and skipped == []
    assert sorted(p.name for p in tmp_path.glob(".*")) == [live.name]


def test_a_checkpoint_verified_once_is_not_hashed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing the checkpoint to resume from and then loading it read its files once; a changed file is read."""
    target = write_checkpoint(tmp_path / "a.ckpt", 1)
    verify_checkpoint(target)
    calls: list[Path] = []
    real = manifest.hash_file
    monkeypatch.setattr(manifest, "hash_file", lambda path: calls.append(path) or real(path))
    verify_checkpoint(target)
    assert calls == []
    _alter_file(target)
    with pytest.raises(CheckpointCorruptError, match="contents altered"):
        verify_checkpoint(target)
