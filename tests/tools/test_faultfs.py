"""The fault campaign's file system fails as planned, and passes everything else through to the real files."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from smartinf_tools.faultfs import Plan

BLOCK = 64 << 10


def _can_mount() -> str | None:
    """Why FUSE cannot be used here (None: it can)."""
    if not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None:
        return "needs /dev/fuse and fusermount3 (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as err:
        return f"needs mfusepy and libfuse3 ({err})"
    return None


@pytest.fixture
def mounted(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path, Path]]:
    """(real directory, mount point, fault log) with the plan the test's ``plan`` mark gives."""
    reason = _can_mount()
    if reason is not None:
        pytest.skip(reason)
    source, mount, log = tmp_path / "source", tmp_path / "mount", tmp_path / "faults.jsonl"
    source.mkdir()
    mount.mkdir()
    plan = request.node.get_closest_marker("plan").kwargs
    proc = subprocess.Popen([sys.executable, "-m", "smartinf_tools.faultfs", str(source), str(mount),
                             f"--log={log}", *(f"--{k}={v}" for k, v in plan.items())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 30
    while not mount.is_mount():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            output = proc.communicate()[0].decode(errors="replace")
            pytest.skip(f"FUSE does not mount here: {output.strip()[-300:]}")
        time.sleep(0.05)
    try:
        yield source, mount, log
    finally:
        subprocess.run(["fusermount3", "-u", str(mount)], check=False)
        proc.wait(timeout=30)


def _direct_write(path: Path, data: bytes) -> None:
    import mmap

    buffer = mmap.mmap(-1, len(data))
    buffer.write(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.pwritev(fd, [buffer], 0) == len(data)
    finally:
        os.close(fd)


def _direct_read(path: Path, nbytes: int) -> bytes:
    import mmap

    buffer = mmap.mmap(-1, nbytes)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [buffer], 0)
    finally:
        os.close(fd)
    return bytes(buffer[:n])


@pytest.mark.plan(rate=0.0)
def test_o_direct_requests_pass_through_to_the_real_files(mounted) -> None:
    source, mount, log = mounted
    data = os.urandom(4 * BLOCK)
    (mount / "state").mkdir()
    _direct_write(mount / "state" / "sg0", data)
    assert (source / "state" / "sg0").read_bytes() == data
    assert _direct_read(mount / "state" / "sg0", len(data)) == data
    os.rename(mount / "state" / "sg0", mount / "state" / "sg1")
    assert sorted(os.listdir(source / "state")) == ["sg1"] and not log.exists()


@pytest.mark.plan(kinds="torn_write", rate=1.0, limit=1, include="state/*")
def test_a_torn_write_reports_success_and_keeps_half(mounted) -> None:
    source, mount, log = mounted
    (mount / "state").mkdir()
    data = os.urandom(BLOCK)
    _direct_write(mount / "state" / "sg0", data)  # reported complete
    written = (source / "state" / "sg0").read_bytes()
    assert written[: BLOCK // 2] == data[: BLOCK // 2] and written[BLOCK // 2 :] != data[BLOCK // 2 :]
    [fault] = [json.loads(line) for line in log.read_text().splitlines()]
    assert fault["kind"] == "torn_write" and fault["path"] == "state/sg0"


@pytest.mark.plan(kinds="read_eio", rate=1.0, limit=1, include="state/*")
def test_a_read_error_reaches_the_reader_once_per_file(mounted) -> None:
    source, mount, log = mounted
    (source / "state").mkdir()
    (source / "state" / "sg0").write_bytes(os.urandom(BLOCK))
    with pytest.raises(OSError) as err:
        _direct_read(mount / "state" / "sg0", BLOCK)
    assert err.value.errno == errno.EIO
    assert _direct_read(mount / "state" / "sg0", BLOCK) == (source / "state" / "sg0").read_bytes()  # transient


@pytest.mark.plan(kinds="bad_read", rate=1.0, limit=1, include="state/*")
def test_a_bad_read_flips_one_bit_silently(mounted) -> None:
    source, mount, _ = mounted
    (source / "state").mkdir()
    data = os.urandom(BLOCK)
    (source / "state" / "sg0").write_bytes(data)
    got = _direct_read(mount / "state" / "sg0", BLOCK)
    assert len(got) == BLOCK and sum(a != b for a, b in zip(got, data, strict=True)) == 1


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="unknown fault kinds.*'eio'"):
        Plan(("eio",), rate=1.0, limit=1, seed=0)
