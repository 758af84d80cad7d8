"""A storage backend that fails on purpose, for the fault-injection tests: it wraps a real backend (real files, real
O_DIRECT I/O) and, for the requests its plan picks, raises EIO, tears a write (only the first half reaches the file,
and the request reports success, as a lying disk would) or flips a byte of what a read returns."""

from __future__ import annotations

import errno
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_smartinf.storage.io import IOBackend, io_error

KINDS = ("read_eio", "write_eio", "torn_write", "bad_read")


@dataclass
class Injected:
    kind: str
    path: Path


@dataclass
class FaultPlan:
    """Which requests fail: each request of an eligible kind fails with ``rate``, at most ``limit`` files, and only
    for paths ``where`` accepts; a transient fault hits a file once, a ``sticky`` one on every later request of the
    same kind for that file (a broken sector)."""

    kinds: tuple[str, ...]
    rate: float = 0.2
    limit: int = 3
    seed: int = 0
    sticky: bool = False
    where: Callable[[Path], bool] = lambda path: path.parent.name != "probe"
    """Which files' requests may fail: every state file (not the planner's disk probe, whose bytes are not state)."""
    injected: list[Injected] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._broken: set[tuple[str, Path]] = set()

    def pick(self, kind: str, path: Path) -> bool:
        if kind not in self.kinds or not self.where(path):
            return False
        if self.sticky and (kind, path) in self._broken:  # a broken sector fails again
            self.injected.append(Injected(kind, path))
            return True
        if any(p == path for _, p in self._broken):  # a transient fault hits a file once, whatever its kind
            return False
        if len(self.injected) >= self.limit or self._random.random() >= self.rate:
            return False
        self._broken.add((kind, path))
        self.injected.append(Injected(kind, path))
        return True


class FaultyBackend:
    """``inner`` with the faults ``plan`` picks (see the module docstring)."""

    def __init__(self, inner: IOBackend, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self.name, self.direct, self.allocator = f"faulty({inner.name})", inner.direct, inner.allocator

    def read(self, path: Path, buffer: torch.Tensor, urgent: bool = False) -> Future[None]:
        if self.plan.pick("read_eio", path):
            return _failed(io_error(OSError(errno.EIO, "injected I/O error"), "reading", path, len(buffer)))
        future = self.inner.read(path, buffer, urgent)
        if not self.plan.pick("bad_read", path):
            return future
        out: Future[None] = Future()

        def flip(done: Future[None]) -> None:
            if done.exception() is not None:
                out.set_exception(done.exception())  # type: ignore[arg-type]
                return
            buffer[len(buffer) // 3] ^= 0x10  # one bit of one byte, silently
            out.set_result(None)

        future.add_done_callback(flip)
        return out

    def write(self, path: Path, buffer: torch.Tensor) -> Future[None]:
        if self.plan.pick("write_eio", path):
            return _failed(io_error(OSError(errno.EIO, "injected I/O error"), "writing", path, len(buffer)))
        if self.plan.pick("torn_write", path):
            half = max(len(buffer) // 2 // 4096 * 4096, 4096)
            return self.inner.write(path, buffer[:half]) if half < len(buffer) else self.inner.write(path, buffer)
        return self.inner.write(path, buffer)

    def close(self) -> None:
        self.inner.close()


def _failed(err: BaseException) -> Future[None]:
    future: Future[None] = Future()
    future.set_exception(err)
    return future
