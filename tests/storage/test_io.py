"""Both I/O backends round-trip aligned buffers through real files; counters count payload bytes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_smartinf.storage.aligned import BufferPool, aligned_bytes, typed_view
from lightning_smartinf.storage.counters import READ, WRITE, TrafficCounters
from lightning_smartinf.storage.io import make_backend, supports_o_direct
from lightning_smartinf.storage.store import FileStore, HostStore


def test_buffers_are_page_aligned() -> None:
    raw = aligned_bytes(10_000)
    assert raw.data_ptr() % 4096 == 0 and raw.numel() == 12_288


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_file_store_round_trip_and_counts(tmp_path: Path, kind: str) -> None:
    assert supports_o_direct(tmp_path), "the test disk should take O_DIRECT"
    counters = TrafficCounters()
    backend = make_backend(kind, tmp_path, threads=2, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    store = FileStore(tmp_path, backend, counters, link="host")
    numel = 3000  # not a multiple of the 4 KiB block: the tail is padded on disk, not counted
    out = aligned_bytes(numel * 4)
    typed_view(out, torch.float32, numel).copy_(torch.arange(numel, dtype=torch.float32))
    store.write("master", "sg000001", out, numel * 4).result()
    back = aligned_bytes(numel * 4)
    store.read("master", "sg000001", back, numel * 4).result()
    assert torch.equal(typed_view(back, torch.float32, numel), torch.arange(numel, dtype=torch.float32))
    assert counters.total(kind="master", direction=WRITE) == counters.total(direction=READ) == numel * 4
    backend.close()


def test_host_store_round_trip() -> None:
    store = HostStore()
    data = aligned_bytes(4096)
    data.fill_(7)
    store.write("grad", "sg000000", data, 100).result()
    back = aligned_bytes(4096)
    store.read("grad", "sg000000", back, 100).result()
    assert torch.equal(back[:100], data[:100]) and store.exists("grad", "sg000000")


def test_pool_gives_back_pressure() -> None:
    pool = BufferPool(1, 4096)
    first = pool.acquire(10)
    assert pool.try_acquire() is None
    pool.release(first)
    assert pool.try_acquire() is not None
    with pytest.raises(ValueError, match="exceeds"):
        pool.acquire(10_000)
