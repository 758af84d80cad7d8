"""A copy of a live state file into a checkpoint is checked against what the run wrote to it, and retried once."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from lightning_smartinf.checkpoint import files
from lightning_smartinf.checkpoint.files import copy_file, hash_file
from lightning_smartinf.errors import StorageError
from lightning_smartinf.storage.checksum import checksum
from lightning_smartinf.storage.store import CorruptReadError, WrittenSum

PAYLOAD = 3 * 4096 + 100
"""A state file's payload, short of its 4 KiB-aligned size, as the stores write them."""


def state_file(path: Path) -> WrittenSum:
    data = os.urandom(PAYLOAD) + bytes(4 * 4096 - PAYLOAD)
    path.write_bytes(data)
    return WrittenSum(PAYLOAD, checksum(data[:PAYLOAD]))


def test_a_copy_checked_against_the_written_sum_records_both_sums(tmp_path: Path) -> None:
    written = state_file(tmp_path / "live")
    record = copy_file(tmp_path / "live", tmp_path / "copy", expect=written, checksum=True)
    assert (tmp_path / "copy").read_bytes() == (tmp_path / "live").read_bytes()
    hashed = hash_file(tmp_path / "copy")
    assert (record.nbytes, record.sha256) == (hashed.nbytes, hashed.sha256)
    assert record.checksum == checksum((tmp_path / "live").read_bytes())
    assert hashed.checksum is None  # hashing a checkpoint computes no checksum it would not use


def test_a_file_that_differs_from_what_was_written_is_refused_naming_it(tmp_path: Path, caplog) -> None:
    written = state_file(tmp_path / "live")
    data = bytearray((tmp_path / "live").read_bytes())
    data[5000] ^= 0x10  # the disk kept wrong bytes (a torn write, a flipped bit)
    (tmp_path / "live").write_bytes(data)
    with caplog.at_level(logging.WARNING), pytest.raises(CorruptReadError, match=r"copying .*/live: its first 12388"):
        copy_file(tmp_path / "live", tmp_path / "copy", expect=written)
    assert any("retrying once" in r.getMessage() for r in caplog.records)


def test_a_padding_byte_is_not_part_of_the_sum(tmp_path: Path) -> None:
    written = state_file(tmp_path / "live")
    data = bytearray((tmp_path / "live").read_bytes())
    data[-1] ^= 0x10
    (tmp_path / "live").write_bytes(data)
    copy_file(tmp_path / "live", tmp_path / "copy", expect=written)


@pytest.mark.parametrize("fault", ["bad_read", "read_eio"])
def test_a_transient_fault_is_retried_with_a_warning(tmp_path: Path, monkeypatch, caplog, fault: str) -> None:
    written = state_file(tmp_path / "live")
    real, calls = os.preadv, []

    def failing_once(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            return real(fd, buffers, offset)
        if fault == "read_eio":
            raise OSError(errno.EIO, "Input/output error")
        n = real(fd, buffers, offset)
        buffers[0][100] ^= 0x10
        return n

    monkeypatch.setattr(files.os, "preadv", failing_once)
    with caplog.at_level(logging.WARNING):
        copy_file(tmp_path / "live", tmp_path / "copy", expect=written)
    assert (tmp_path / "copy").read_bytes() == (tmp_path / "live").read_bytes()
    warnings = [r.getMessage() for r in caplog.records if "retrying once" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "live") in warnings[0]


def test_an_io_error_that_persists_names_the_file(tmp_path: Path, monkeypatch) -> None:
    state_file(tmp_path / "live")

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files.os, "preadv", failing)
    with pytest.raises(StorageError, match=r"copying .*/live to .*/copy failed: Input/output error \(EIO\)"):
        copy_file(tmp_path / "live", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_the_written_sum_is_checked_across_chunks(tmp_path: Path, monkeypatch) -> None:
    """A file longer than one read: the checksum runs over the chunks up to the payload's end, in the chunk it ends
    in."""
    monkeypatch.setattr(files, "CHUNK", 4096)
    written = state_file(tmp_path / "live")
    copy_file(tmp_path / "live", tmp_path / "copy", expect=written)
    data = bytearray((tmp_path / "live").read_bytes())
    data[4096 + 10] ^= 0x10  # in the second of four chunks
    (tmp_path / "live").write_bytes(data)
    with pytest.raises(CorruptReadError, match="differ from those this run wrote"):
        copy_file(tmp_path / "live", tmp_path / "again", expect=written)
