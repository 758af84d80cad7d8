"""Durable file writes for checkpoints: every byte hashed on its way to disk, fsynced, disk-full named.

A checkpoint file is written once, by one of these helpers, so its SHA-256 comes for free with the write and the
manifest can list it without a second read. ``os.write``, ``hashlib`` and ``xxhash`` all release the GIL, so several
files copy in parallel threads.

A copy of a live state file is checked on its way too: the checksum of the bytes read (``storage/checksum.py``)
must match the one the run recorded when it wrote the file (``WrittenSum``), so a disk that returns wrong bytes,
or kept a torn write, cannot slip into a checkpoint under a valid SHA-256. A failed copy (an I/O error, a mismatch)
is retried once with a warning, since a copy is idempotent; a second failure is an error naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_smartinf.errors import StorageError
from lightning_smartinf.storage.aligned import ALIGNMENT, aligned_bytes
from lightning_smartinf.storage.checksum import RunningChecksum, describe
from lightning_smartinf.storage.io import bytes_view
from lightning_smartinf.storage.space import human_bytes
from lightning_smartinf.storage.store import CorruptReadError, WrittenSum

log = logging.getLogger(__name__)

CHUNK = 8 << 20
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class FileRecord:
    """What the manifest keeps about one file: its size and SHA-256."""

    nbytes: int
    sha256: str
    checksum: int | None = None
    """Of the whole file (``storage/checksum.py``), where the copy was asked for it (``copy_file(checksum=True)``;
    not kept in the manifest)."""


class Digest:
    """The SHA-256 of a stream of chunks; with ``expect``, the checksum of its first ``expect.nbytes`` bytes, which
    ``record`` checks against ``expect.checksum``; with ``whole``, the checksum of all of it. The checksum runs only
    where one of them needs it: checkpoint writes and verification hash every byte of a checkpoint, and need
    neither."""

    def __init__(self, source: Path, expect: WrittenSum | None = None, whole: bool = False) -> None:
        self.source, self.expect, self.whole = source, expect, whole
        self.sha256 = hashlib.sha256()
        self.running = RunningChecksum()
        self.size = 0
        self.prefix: int | None = None

    def update(self, chunk: bytes | memoryview) -> None:
        if self.expect is not None and self.size < self.expect.nbytes <= self.size + len(chunk):
            self.prefix = self.running.with_tail(chunk[: self.expect.nbytes - self.size])
        self.sha256.update(chunk)
        if self.whole or (self.expect is not None and self.prefix is None):
            self.running.update(chunk)
        self.size += len(chunk)

    def record(self) -> FileRecord:
        expect = self.expect
        if expect is not None and expect.nbytes > 0 and self.prefix != expect.checksum:
            found = "the file is shorter" if self.prefix is None else describe(self.prefix)
            raise CorruptReadError(
                f"copying {self.source}: its first {expect.nbytes} bytes differ from those this run wrote ({found}, "
                f"written {describe(expect.checksum)}): the disk returned wrong data or kept a torn write"
            )
        return FileRecord(self.size, self.sha256.hexdigest(), self.running.value() if self.whole else None)


class DiskFullError(StorageError):
    """No room for a checkpoint or state file; the message names the path, the bytes needed and the bytes free."""


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing ancestor)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def disk_full(path: Path, needed: int, what: str, kept: Path | None = None) -> DiskFullError:
    """``kept``: the newest complete checkpoint beside ``path``, which the failed save left as it was."""
    after = f" ({kept} is untouched)" if kept is not None else " (no earlier checkpoint exists there)"
    return DiskFullError(
        errno.ENOSPC,
        f"disk full: {what} at {path} needs {human_bytes(needed)} and {human_bytes(free_bytes(path))} are free; "
        f"free space or write it elsewhere{after}",
    )


def read_chunks(path: Path) -> Iterator[memoryview]:
    """The file's bytes in ``CHUNK`` pieces (each view is valid until the next one is taken)."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            yield view[:n]


def write_chunks(path: Path, chunks: Iterable[bytes | memoryview], digest: Digest | None = None) -> FileRecord:
    """Create ``path`` (it must not exist), write the chunks, fsync; return its size and sums (``digest``: the one
    to feed, which may check a copy's source)."""
    digest = digest if digest is not None else Digest(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            digest.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.record()


def write_state_file(target: Path, data: memoryview) -> WrittenSum:
    """Replace the live state file ``target`` with ``data`` (a subgroup a restore re-cut from a checkpoint of
    another layout); returns the sum the run's later reads of it are checked against."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    record = write_chunks(target, [data], Digest(target, whole=True))
    assert record.checksum is not None
    return WrittenSum(record.nbytes, record.checksum)


def copy_file(source: Path, target: Path, replace: bool = False, expect: WrittenSum | None = None,
              checksum: bool = False) -> FileRecord:  # fmt: skip
    """Copy ``source`` to ``target``, checking the bytes read against ``expect`` (see the module docstring) and
    retrying once, with a warning, if the copy fails other than for a full disk. ``replace``: overwrite an existing
    ``target`` (restoring live state) instead of refusing to; ``checksum``: also return the checksum of the whole
    file."""
    for attempt in (1, 2):
        try:
            return _copy_once(source, target, replace, lambda: Digest(source, expect, checksum))
        except OSError as err:
            target.unlink(missing_ok=True)  # no partial copy is left behind
            if attempt == 2 or err.errno in FULL_ERRNOS:
                raise
            said = (err.strerror or err) if isinstance(err, StorageError) else err  # a StorageError names the file
            log.warning("smart_infinity: %s; retrying once", said)
    raise AssertionError("unreachable")


def _copy_once(source: Path, target: Path, replace: bool, digest: Callable[[], Digest]) -> FileRecord:
    """With O_DIRECT where the size and filesystem allow (state files are 4 KiB multiples): it bypasses the page
    cache, which cuts the time by 3x under a training process's memory pressure; buffered otherwise."""
    if replace:
        target.unlink(missing_ok=True)
    try:
        if source.stat().st_size % ALIGNMENT == 0 and hasattr(os, "O_DIRECT"):
            try:
                return _copy_direct(source, target, digest())
            except OSError as err:
                if err.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
                target.unlink(missing_ok=True)
        return write_chunks(target, read_chunks(source), digest())
    except StorageError:  # already names the file
        raise
    except OSError as err:
        if err.filename is not None or err.errno in FULL_ERRNOS:
            raise
        name = errno.errorcode.get(err.errno or 0, "error")
        raise StorageError(err.errno, f"copying {source} to {target} failed: {err.strerror or err} ({name})") from err


def _copy_direct(source: Path, target: Path, digest: Digest) -> FileRecord:
    view = bytes_view(aligned_bytes(CHUNK))
    offset = 0
    fin = os.open(source, os.O_RDONLY | os.O_DIRECT)
    try:
        fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            while n := os.preadv(fin, [view], offset):
                digest.update(view[:n])
                done = 0
                while done < n:
                    done += os.pwritev(fout, [view[done:n]], offset + done)
                offset += n
            os.fsync(fout)  # the data is on disk already; this makes the file's size and extents durable
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    return digest.record()


def hash_file(path: Path) -> FileRecord:
    digest = Digest(path)
    for chunk in read_chunks(path):
        digest.update(chunk)
    return digest.record()


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
