"""Disk bandwidth through the engine's own I/O path: reads, writes, and both at once.

The optimizer step reads and writes the same disk at the same time, and a virtual or NVMe disk can serve the two
concurrently, so a bound made of reads / read speed + writes / write speed is not a bound there. ``measure_disk``
also measures the mixed case, which ``DiskSpeeds.seconds`` uses.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import IOBackend, backend_for
from lightning_smartinf.storage.store import FileStore

_KIND = "probe"


@dataclass(frozen=True)
class DiskSpeeds:
    """Bytes per second: reads alone, writes alone, and reads + writes issued together (their sum over the time)."""

    read: float
    write: float
    mixed: float

    def seconds(self, read_bytes: float, write_bytes: float) -> float:
        """Least time this disk needs to move both: each direction at its own speed, and both at the mixed speed."""
        return max(read_bytes / self.read, write_bytes / self.write, (read_bytes + write_bytes) / self.mixed)


def _stream(store: FileStore, ops: Iterator[tuple[str, str]], buffers: list[torch.Tensor], chunk: int) -> float:
    """Run ``(direction, key)`` requests with one request in flight per buffer; returns the seconds taken."""
    free = list(buffers)
    pending: deque[tuple[Future[None], torch.Tensor]] = deque()
    start = time.perf_counter()
    for direction, key in ops:
        if not free:
            future, buffer = pending.popleft()
            future.result()
            free.append(buffer)
        buffer = free.pop()
        issue = store.read if direction == "read" else store.write
        pending.append((issue(_KIND, key, buffer, chunk), buffer))
    for future, _ in pending:
        future.result()
    return time.perf_counter() - start


def measure_disk(store: FileStore, nbytes: int, chunk: int = 16 * 2**20, inflight: int = 8) -> DiskSpeeds:
    """Write ``nbytes`` in ``chunk``-sized files, read them back, then read them while writing as many again; the best
    of two rounds for reads and writes alone. Removes its files."""
    chunk = min(chunk, max(nbytes // (1 << 20), 1) << 20)  # a smaller probe in smaller (whole-MiB) requests
    chunks = max(1, nbytes // chunk)
    buffers = [store.allocator.allocate(chunk) for _ in range(min(inflight, 2 * chunks))]
    for buffer in buffers:
        buffer.fill_(1)
    try:
        read = write = 0.0
        total = chunks * chunk
        for _ in range(2):
            write = max(write, total / _stream(store, (("write", f"a{i}") for i in range(chunks)), buffers, chunk))
            read = max(read, total / _stream(store, (("read", f"a{i}") for i in range(chunks)), buffers, chunk))
        both = (op for i in range(chunks) for op in (("read", f"a{i}"), ("write", f"b{i}")))
        mixed = 2 * total / _stream(store, both, buffers, chunk)
    finally:
        for buffer in buffers:
            store.allocator.free(buffer)
        for name in ("a", "b"):
            for i in range(chunks):
                store.path(_KIND, f"{name}{i}").unlink(missing_ok=True)
    return DiskSpeeds(read, write, mixed)


def probe_disk(directory: Path, nbytes: int, backend: IOBackend | None = None) -> DiskSpeeds:
    """``measure_disk`` under ``directory`` through ``backend`` (an engine's), or through a backend of the engine's
    default kind opened and closed here (commands that probe a disk without an engine)."""
    own = backend is None
    backend = backend_for(directory) if backend is None else backend
    try:
        return measure_disk(FileStore(directory, backend, TrafficCounters(), _KIND), nbytes)
    finally:
        if own:
            backend.close()
