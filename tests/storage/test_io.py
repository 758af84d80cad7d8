"""Both I/O backends round-trip aligned buffers through real files; counters count payload bytes exactly."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import aio_is_pinned

from lightning_smartinf.storage.aligned import BufferPool, aligned_bytes, typed_view
from lightning_smartinf.storage.counters import READ, WRITE, TrafficCounters
from lightning_smartinf.storage.io import RequestQueue, make_backend, supports_o_direct
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


def test_aio_pools_get_buffers_deepspeed_uses_in_place(tmp_path: Path) -> None:
    backend = make_backend("aio", tmp_path, threads=2, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    store = FileStore(tmp_path, backend, TrafficCounters(), link="host")
    pool = BufferPool(2, 10_000, allocator=store.allocator)
    out, back = pool.acquire(10_000), pool.acquire(10_000)
    assert out.data_ptr() % 4096 == 0 and aio_is_pinned(out) and aio_is_pinned(out[:4096])
    assert not aio_is_pinned(aligned_bytes(4096))  # plain memory: DeepSpeed would copy through a bounce buffer
    typed_view(out, torch.float32, 2500).copy_(torch.arange(2500, dtype=torch.float32))
    store.write("master", "sg000000", out, 10_000).result()
    store.read("master", "sg000000", back, 10_000).result()
    assert torch.equal(typed_view(back, torch.float32, 2500), torch.arange(2500, dtype=torch.float32))
    pool.release(out)
    pool.release(back)
    pool.close()
    backend.close()


def test_without_page_lock_allowance_buffers_are_plain_and_it_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning_smartinf.storage.io as io

    monkeypatch.setattr(io, "may_lock", lambda nbytes: False)
    backend = make_backend("aio", tmp_path, threads=1, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    with caplog.at_level("WARNING"):
        buffers = [backend.allocator.allocate(8192) for _ in range(2)]
    assert not any(aio_is_pinned(b) for b in buffers)
    assert sum("ulimit -l" in r.message for r in caplog.records) == 1  # said once
    backend.close()


class Recording:
    def __init__(self) -> None:
        self.freed = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_bytes(nbytes)

    def free(self, buffer: torch.Tensor) -> None:
        self.freed += 1


def test_a_closed_pool_frees_its_buffers_and_refuses_more() -> None:
    allocator = Recording()
    pool = BufferPool(3, 4096, allocator=allocator)
    late = pool.acquire(10)
    pool.close()
    assert allocator.freed == 2  # the one still out is not freed under its user
    pool.release(late)  # a write-back finishing after close: freed then
    assert allocator.freed == 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(10)
    assert pool.try_acquire() is None


def test_urgent_requests_overtake_the_queue_and_close_serves_the_rest() -> None:
    requests = RequestQueue(1, "test-io")
    started, release, order = threading.Event(), threading.Event(), []
    requests.submit(lambda: (started.set(), release.wait()), urgent=False)  # occupies the only worker
    started.wait()
    for name in ("state0", "state1"):
        requests.submit(lambda name=name: order.append(name), urgent=False)  # type: ignore[misc]
    param = requests.submit(lambda: order.append("param"), urgent=True)
    failing = requests.submit(lambda: 1 / 0, urgent=False)  # type: ignore[func-returns-value]
    release.set()
    param.result()
    requests.close()
    assert order == ["param", "state0", "state1"]
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_requests_left_queued_at_exit_are_still_served(tmp_path: Path) -> None:
    """Nobody closes the queue; the interpreter exits anyway (daemon workers) and first finishes the queued write."""
    mark = tmp_path / "written"
    script = (
        "import time\nfrom lightning_smartinf.storage.io import RequestQueue\n"
        "q = RequestQueue(1, 'exit-test')\n"
        f"q.submit(lambda: (time.sleep(0.3), open({str(mark)!r}, 'w').write('x')), urgent=False)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert mark.read_text() == "x"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (needs root, as CI has): a disk that fills up."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_a_write_to_a_full_disk_is_an_error_naming_path_and_bytes(tiny_tmpfs: Path, kind: str) -> None:
    """DeepSpeed's aio reports a 4 MiB write to a 1 MiB disk as done; the backend must not."""
    backend = make_backend(kind, tiny_tmpfs, threads=2, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    try:
        with pytest.raises(OSError, match=rf"writing 4194304 bytes to {tiny_tmpfs}/f.*ENOSPC"):
            backend.write(tiny_tmpfs / "f", aligned_bytes(4 << 20)).result()
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_a_short_read_is_an_error_not_zeros(tmp_path: Path, kind: str) -> None:
    """A truncated state file: the aio op would abort the process in C++; both backends raise, naming the file."""
    backend = make_backend(kind, tmp_path, threads=2, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    (tmp_path / "f").write_bytes(b"x" * 4096)
    try:
        with pytest.raises(EOFError, match=rf"reading 8192 bytes from {tmp_path}/f.*4096"):
            backend.read(tmp_path / "f", aligned_bytes(8192)).result()
    finally:
        backend.close()
