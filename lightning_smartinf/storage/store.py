"""A directory of named flat tensors, read and written asynchronously into caller-owned aligned buffers.

Names are ``(kind, key)``: ``("master", "sg00003")`` is subgroup 3's fp32 master copy. The kind is what the byte
counters are keyed by. ``FileStore`` keeps one file per name (one writer per file, O_DIRECT friendly);
``HostStore`` keeps the same names in host memory, for ``offload.params=cpu`` and ``offload.grads=cpu``.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from lightning_smartinf import trace
from lightning_smartinf.errors import StorageError
from lightning_smartinf.storage.aligned import Allocator, align_up, aligned_bytes
from lightning_smartinf.storage.checksum import checksum, describe
from lightning_smartinf.storage.counters import READ, WRITE, TrafficCounters
from lightning_smartinf.storage.io import IOBackend, PageLocked, bytes_view
from lightning_smartinf.trace import IO_CPU

log = logging.getLogger(__name__)


class CorruptReadError(StorageError):
    """A file read back differs from what this run wrote to it (a disk or file system returning wrong bytes)."""


@dataclass(frozen=True)
class WrittenSum:
    """What this run wrote to a file: the checksum (``storage/checksum.py``) of its first ``nbytes``. A later read
    of the file, and a copy of it into a checkpoint, are checked against it."""

    nbytes: int
    checksum: int


def buffer_checksum(buffer: torch.Tensor, payload: int) -> int:
    """The checksum of the first ``payload`` bytes of a uint8 buffer, outside the GIL. Traced as ``io-cpu``: the CPU
    work of I/O, which shares the cores with compute on a CPU host."""
    with trace.span("checksum", IO_CPU, bytes=payload):
        return checksum(bytes_view(buffer[:payload]))


def done_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class TensorStore(Protocol):
    """What the engine and the updaters need from storage."""

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        """Fill ``buffer`` (aligned uint8, at least ``align_up(payload)`` bytes) with the stored tensor; ``urgent``
        for what compute is waiting on (served before queued optimizer-step I/O)."""
        ...

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        """Store the first ``payload`` bytes of ``buffer``; the buffer must stay untouched until the future is done."""
        ...

    def exists(self, kind: str, key: str) -> bool: ...


class FileStore:
    """One file per name under ``root/kind/key``, through an async O_DIRECT backend; traffic counted on ``link``.

    With ``verify`` (``offload.verify_io``), every write records the checksum of its payload and every later read of
    that file in this run is checked against it, so a disk that returns wrong bytes (a flipped bit, a torn or lost
    write) is caught when the data is used, not at the next resume. Reads and whole-file writes are idempotent: a
    failed one (an I/O error, a checksum mismatch) is retried once, with a warning; a second failure is an error that
    names the file. A restore records the sums of the files it wrote (``record_written``)."""

    def __init__(self, root: Path, backend: IOBackend, counters: TrafficCounters, link: str,
                 verify: bool = False) -> None:  # fmt: skip
        self.root = root
        self.backend = backend
        self.counters = counters
        self.link = link
        self.verify = verify
        self._dirs: set[str] = set()
        self._sums: dict[tuple[str, str], WrittenSum] = {}
        self.retries = 0
        """Requests that failed once and succeeded when retried (each logged)."""

    def path(self, kind: str, key: str) -> Path:
        if kind not in self._dirs:
            (self.root / kind).mkdir(parents=True, exist_ok=True)
            self._dirs.add(kind)
        return self.root / kind / key

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        self.counters.add(self.link, kind, READ, payload)
        path, span = self.path(kind, key), buffer[: align_up(payload)]
        if not self.verify:
            return self.backend.read(path, span, urgent)
        expected = self._sums.get((kind, key))

        def check() -> None:
            if expected is None or expected.nbytes > span.numel():
                return
            if (found := buffer_checksum(buffer, expected.nbytes)) != expected.checksum:
                raise CorruptReadError(
                    f"reading {payload} bytes of {kind} {key} from {path}: the bytes read differ from those written "
                    f"in this run ({describe(found)}, written {describe(expected.checksum)}): the disk returned "
                    "wrong data"
                )

        return self._with_retry(lambda: self.backend.read(path, span, urgent), check, f"reading {path}")

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        self.counters.add(self.link, kind, WRITE, payload)
        path, span = self.path(kind, key), buffer[: align_up(payload)]
        if not self.verify:
            return self.backend.write(path, span)
        # the buffer is final from here until the write is done
        self._sums[(kind, key)] = WrittenSum(payload, buffer_checksum(buffer, payload))
        return self._with_retry(lambda: self.backend.write(path, span), lambda: None, f"writing {path}")

    def _with_retry(self, submit: Callable[[], Future[None]], check: Callable[[], None], what: str) -> Future[None]:
        """``submit()``'s request, then ``check()``; a failure of either is retried once (the request is
        idempotent), with a warning. The returned future fails only if the retry fails too."""
        outcome: Future[None] = Future()

        def attempt(retried: bool) -> None:
            def done(request: Future[None]) -> None:
                err = request.exception()
                if err is None:
                    try:
                        check()
                    except CorruptReadError as mismatch:
                        err = mismatch
                if err is None:
                    if retried:
                        self.retries += 1
                    outcome.set_result(None)
                elif retried or not isinstance(err, OSError):
                    outcome.set_exception(err)
                else:
                    log.warning("smart_infinity: %s failed (%s); retrying once", what, err)
                    attempt(retried=True)

            submit().add_done_callback(done)

        attempt(retried=False)
        return outcome

    def exists(self, kind: str, key: str) -> bool:
        return self.path(kind, key).exists()

    def written(self, path: Path) -> WrittenSum | None:
        """The sum this run recorded for the file at ``path`` (None: not one of this store's, or not yet written)."""
        if not self.verify or path.parent.parent != self.root:
            return None
        return self._sums.get((path.parent.name, path.name))

    def record_written(self, path: Path, written: WrittenSum) -> None:
        """``path`` was written outside this store (a restored checkpoint's file): check later reads against it."""
        if self.verify and path.parent.parent == self.root:
            self._sums[(path.parent.name, path.name)] = written

    @property
    def roots(self) -> list[Path]:
        return [self.root]

    @property
    def allocator(self) -> Allocator:
        """Where buffers for this store's reads and writes should come from."""
        return self.backend.allocator


def stripe_of(key: str, stripes: int) -> int:
    """The stripe holding ``key``: subgroups ``sgN`` round-robin (so the step's read-ahead alternates disks), other
    names by a stable hash."""
    digits = key[2:]
    return int(digits) % stripes if key.startswith("sg") and digits.isdigit() else zlib.crc32(key.encode()) % stripes


class StripedStore:
    """Files spread over several directories, one per disk (``offload.nvme_path`` as a list): each name lives in
    the stripe ``stripe_of`` picks, so consecutive subgroups are read and written on different disks at once."""

    def __init__(self, stores: list[FileStore]) -> None:
        self.stores = stores
        self.root = stores[0].root

    def _store(self, key: str) -> FileStore:
        return self.stores[stripe_of(key, len(self.stores))]

    def path(self, kind: str, key: str) -> Path:
        return self._store(key).path(kind, key)

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        return self._store(key).read(kind, key, buffer, payload, urgent)

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        return self._store(key).write(kind, key, buffer, payload)

    def exists(self, kind: str, key: str) -> bool:
        return self._store(key).exists(kind, key)

    @property
    def roots(self) -> list[Path]:
        return [store.root for store in self.stores]

    @property
    def allocator(self) -> Allocator:
        """Page-locked memory serves every stripe (any backend can use it); plain memory when no stripe has it."""
        allocators = [store.allocator for store in self.stores]
        return next((a for a in allocators if isinstance(a, PageLocked)), allocators[0])


class RoutedStore:
    """Sends each key to the store that owns it: gradients written straight into the directory of the
    near-storage device that will update them."""

    def __init__(self, owners: dict[str, TensorStore]) -> None:
        self._owners = owners

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        return self._owners[key].read(kind, key, buffer, payload, urgent)

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        return self._owners[key].write(kind, key, buffer, payload)

    def exists(self, kind: str, key: str) -> bool:
        return self._owners[key].exists(kind, key)


class TieredStore:
    """The names of ``host_keys`` in host memory, every other on storage (``offload.host_memory_budget``'s
    placement of gradients and optimizer state): their users read and write both alike. The engine decides the
    placement first and builds each with its names, which never change."""

    def __init__(self, disk: FileStore | StripedStore, host: HostStore, host_keys: frozenset[str]) -> None:
        self.disk, self.host, self.host_keys = disk, host, host_keys

    def _store(self, key: str) -> TensorStore:
        return self.host if key in self.host_keys else self.disk

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        return self._store(key).read(kind, key, buffer, payload, urgent)

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        return self._store(key).write(kind, key, buffer, payload)

    def exists(self, kind: str, key: str) -> bool:
        return self._store(key).exists(kind, key)

    @property
    def roots(self) -> list[Path]:
        return self.disk.roots

    @property
    def allocator(self) -> Allocator:
        return self.disk.allocator


class HostStore:
    """The same interface in (pinned, on CUDA hosts) RAM: copies are synchronous and cross no storage link."""

    def __init__(self, pin: bool = False) -> None:
        self._pin = pin
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def read(self, kind: str, key: str, buffer: torch.Tensor, payload: int, urgent: bool = False) -> Future[None]:
        with trace.span("copy from RAM", IO_CPU, kind=kind, bytes=payload):
            buffer[:payload].copy_(self._tensors[(kind, key)][:payload])
        return done_future()

    def write(self, kind: str, key: str, buffer: torch.Tensor, payload: int) -> Future[None]:
        with trace.span("copy to RAM", IO_CPU, kind=kind, bytes=payload):
            self.slot(kind, key, payload)[:payload].copy_(buffer[:payload])
        return done_future()

    def exists(self, kind: str, key: str) -> bool:
        return (kind, key) in self._tensors

    def tensor(self, kind: str, key: str) -> torch.Tensor:
        """The stored bytes of a name (its payload, padded to the 4 KiB alignment files have)."""
        return self._tensors[(kind, key)]

    def slot(self, kind: str, key: str, payload: int) -> torch.Tensor:
        """The stored bytes of a name, created (zero-filled) where absent, for a caller that works on them in place:
        no copy in, none out."""
        stored = self._tensors.get((kind, key))
        if stored is None or stored.numel() < payload:
            stored = self._tensors[(kind, key)] = aligned_bytes(payload, pin=self._pin)
        return stored


def in_host_memory(store: object, key: str) -> HostStore | None:
    """The ``HostStore`` holding ``key``'s names where ``store`` keeps them in RAM (a ``HostStore``, or the host tier
    of a ``TieredStore``), else None. The updater and the gradient accumulator work on those tensors in place: a
    copy into a pooled buffer and back would cost the same cores the compute runs on, for nothing."""
    if isinstance(store, HostStore):
        return store
    if isinstance(store, TieredStore) and key in store.host_keys:
        return store.host
    return None
