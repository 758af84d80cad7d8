"""``python -m smartinf_tools.faultfs SOURCE MOUNT``: a file system that fails on purpose, for the fault
campaign (``smartinf-faults``).

A FUSE pass-through over the directory ``SOURCE``, mounted with ``direct_io`` so that every request reaches it,
O_DIRECT and DeepSpeed's libaio ones included (no page cache in between), and each on the real disk below. For the
requests its plan picks it fails as a disk does: an I/O error on a read or a write (nothing transferred), a torn
write (only the first half reaches the file and the request reports success), or a read that returns wrong bytes
(one bit flipped). Each fault is appended to ``--log`` as a JSON line (kind, path under the mount, offset, bytes)
the moment it is injected, so the campaign can match it with what the training run said.

Needs ``/dev/fuse``, ``fusermount3`` (Debian's ``fuse3``) and ``mfusepy``; runs in the foreground until unmounted
(``fusermount3 -u MOUNT``) or sent SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

REQUEST_OF = {"read_eio": "read", "write_eio": "write", "torn_write": "write", "bad_read": "read"}
"""Each fault kind and the request it strikes."""
KINDS = tuple(REQUEST_OF)


@dataclass
class Plan:
    """Which requests fail: each read or write of a file ``include`` matches fails with probability ``rate`` (by
    one of ``kinds`` drawn at random), each file at most once, and at most ``limit`` faults in all."""

    kinds: tuple[str, ...]
    rate: float
    limit: int
    seed: int
    include: str = "*"
    """A glob on the path under the mount (``state*/*``: the state files, not the disk probe's)."""
    log: Path | None = None
    _random: random.Random = field(init=False)
    _hit: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise SystemExit(f"faultfs: unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        self._random = random.Random(self.seed)

    def pick(self, op: str, path: str, offset: int, size: int) -> str | None:
        """The fault for this request (``op``: read or write), if any, logged before it is applied."""
        eligible = [k for k in self.kinds if REQUEST_OF[k] == op]
        if not eligible or not fnmatch(path.lstrip("/"), self.include):
            return None
        with self._lock:
            if path in self._hit or len(self._hit) >= self.limit or self._random.random() >= self.rate:
                return None
            kind = self._random.choice(eligible)
            self._hit.add(path)
            if self.log is not None:
                record = {"kind": kind, "path": path.lstrip("/"), "offset": offset, "bytes": size, "time": time.time()}
                with self.log.open("a") as out:
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    os.fsync(out.fileno())
            return kind


def operations(source: Path, plan: Plan) -> Any:
    """The pass-through's FUSE operations (built here so that importing this module needs no mfusepy)."""
    from mfusepy import FuseOSError, Operations

    class FaultFS(Operations):  # type: ignore[misc]
        use_ns = True

        def _real(self, path: str) -> str:
            return str(source / path.lstrip("/"))

        def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
            st = self._call(os.lstat, self._real(path)) if fh is None else self._call(os.fstat, fh)
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            return {key.replace("_ns", ""): getattr(st, key) for key in keys}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._real(path))]

        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(self._real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                    "f_frsize", "f_namemax")  # fmt: skip
            return {key: getattr(st, key) for key in keys}

        def mkdir(self, path: str, mode: int) -> None:
            self._call(os.mkdir, self._real(path), mode)

        def rmdir(self, path: str) -> None:
            self._call(os.rmdir, self._real(path))

        def unlink(self, path: str) -> None:
            self._call(os.unlink, self._real(path))

        def rename(self, old: str, new: str) -> None:
            self._call(os.rename, self._real(old), self._real(new))

        def chmod(self, path: str, mode: int) -> None:
            self._call(os.chmod, self._real(path), mode)

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> None:
            self._call(os.utime, self._real(path), ns=times) if times else self._call(os.utime, self._real(path))

        def truncate(self, path: str, length: int, fh: int | None = None) -> None:
            self._call(os.truncate, fh if fh is not None else self._real(path), length)

        def open(self, path: str, flags: int) -> int:
            # O_DIRECT stays with the kernel's FUSE side (direct_io already bypasses the page cache); the file
            # below is opened buffered so unaligned pieces of a split request still work
            return int(self._call(os.open, self._real(path), flags & ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL)))

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return int(self._call(os.open, self._real(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode))

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if offset >= os.fstat(fh).st_size:  # at the end of the file: no bytes to fail, no fault counted
                return b""
            fault = plan.pick("read", path, offset, size)
            if fault == "read_eio":
                raise FuseOSError(errno.EIO)
            data = self._call(os.pread, fh, size, offset)
            if fault == "bad_read" and data:
                flipped = bytearray(data)
                flipped[len(flipped) // 3] ^= 0x10
                return bytes(flipped)
            return bytes(data)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            fault = plan.pick("write", path, offset, len(data))
            if fault == "write_eio":
                raise FuseOSError(errno.EIO)
            if fault == "torn_write":
                self._call(os.pwrite, fh, data[: len(data) // 2], offset)
                return len(data)  # a lying disk: the request reports success
            return int(self._call(os.pwrite, fh, data, offset))

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> None:
            # passed through, as a disk's file system does: without it glibc would emulate posix_fallocate with a
            # one-byte write per block, and those would take the plan's faults instead of the data's requests
            if mode != 0:
                raise FuseOSError(errno.EOPNOTSUPP)
            self._call(os.posix_fallocate, fh, offset, size)

        def flush(self, path: str, fh: int) -> None:
            return None

        def fsync(self, path: str, datasync: bool, fh: int) -> None:
            self._call(os.fdatasync if datasync else os.fsync, fh)

        def release(self, path: str, fh: int) -> None:
            self._call(os.close, fh)

        @staticmethod
        def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except OSError as err:
                raise FuseOSError(err.errno or errno.EIO) from None

    return FaultFS()


def mount(source: Path, mountpoint: Path, plan: Plan) -> None:
    """Serve ``source`` at ``mountpoint`` with ``plan``'s faults until unmounted (blocks)."""
    from mfusepy import FUSE

    FUSE(operations(source, plan), str(mountpoint), foreground=True, direct_io=True, nothreads=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="faultfs", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="the directory served (the real files)")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--rate", type=float, default=0.0, help="probability that an eligible request fails")
    parser.add_argument("--limit", type=int, default=1, help="most faults injected (each file at most once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--include", default="*", help="glob on the path under the mount of the files that may fail")
    parser.add_argument("--log", type=Path, help="append each injected fault here as a JSON line")
    args = parser.parse_args(argv)
    plan = Plan(tuple(k for k in args.kinds.split(",") if k), args.rate, args.limit, args.seed, args.include, args.log)
    mount(args.source.absolute(), args.mountpoint.absolute(), plan)


if __name__ == "__main__":
    main()
