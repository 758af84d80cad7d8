"""The disk probe measures through a real store and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_smartinf.storage.aligned import aligned_bytes
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import make_backend
from lightning_smartinf.storage.probe import DiskSpeeds, measure_disk, probe_disk
from lightning_smartinf.storage.store import FileStore


def test_measure_disk_reads_writes_and_both(tmp_path: Path) -> None:
    backend = make_backend("threads", tmp_path, 2, 1, 1 << 20, 8)
    counters = TrafficCounters()
    try:
        speeds = measure_disk(FileStore(tmp_path, backend, counters, "host"), 8 * 2**20, chunk=2**20, inflight=3)
    finally:
        backend.close()
    assert min(speeds.read, speeds.write, speeds.mixed) > 0
    # two rounds of each direction alone, then 8 chunks read while 8 more are written
    assert counters.total(link="host", direction="write") == 3 * 8 * 2**20
    assert counters.total(link="host", direction="read") == 3 * 8 * 2**20
    assert not any(path.is_file() for path in tmp_path.rglob("*"))


def test_disk_seconds_is_the_tightest_of_the_three_limits() -> None:
    speeds = DiskSpeeds(read=1.0, write=2.0, mixed=2.5)
    assert speeds.seconds(4.0, 1.0) == pytest.approx(4.0)  # reads alone take longest
    assert speeds.seconds(1.0, 6.0) == pytest.approx(3.0)  # writes alone
    assert speeds.seconds(2.0, 3.0) == pytest.approx(2.0)  # both through the shared disk: 5 / 2.5


def test_probe_disk_with_its_own_backend_or_a_given_one(tmp_path: Path) -> None:
    """Without a backend it opens one of the engine's default kind and closes it; a given one stays open."""
    assert min(vars(probe_disk(tmp_path, 2**20)).values()) > 0
    backend = make_backend("threads", tmp_path, 2, 1, 1 << 20, 8)
    try:
        assert min(vars(probe_disk(tmp_path, 2**20, backend)).values()) > 0
        backend.write(tmp_path / "after", aligned_bytes(4096)).result(timeout=60)  # the caller's backend still works
    finally:
        backend.close()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["after"]
