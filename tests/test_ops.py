"""The op loader clears a build lock left behind by a killed compile (torch would wait on it silently, forever),
and waits on a live build's lock for a bounded time only."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from lightning_smartinf.ops import clear_stale_lock, load_op


class _Builder:
    NAME = "smartinf_test_op"

    def load(self, verbose: bool = False) -> str:
        return "loaded"


def test_a_lock_no_live_build_holds_is_removed_and_the_op_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, "lightning_smartinf.ops")
    assert load_op(_Builder()) == "loaded"
    assert "compiling DeepSpeed's smartinf_test_op op" in caplog.text

    (tmp_path / _Builder.NAME).mkdir(exist_ok=True)
    lock = tmp_path / _Builder.NAME / "lock"
    lock.touch()
    old = time.time() - 60  # left by a build killed a minute ago
    os.utime(lock, (old, old))
    started = time.monotonic()
    assert load_op(_Builder()) == "loaded"
    assert time.monotonic() - started < 5 and not lock.exists()
    assert f"removed the build lock {lock}" in caplog.text


def test_a_live_builds_lock_is_waited_on_with_a_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process working in the build directory (as ninja does) holds it: the loader waits, then names the fix."""
    directory = tmp_path / "op"
    directory.mkdir()
    (directory / "lock").touch()
    builder = subprocess.Popen(["sleep", "30"], cwd=directory)
    try:
        with pytest.raises(TimeoutError, match=rf"has not finished in 2 s; stop it, then `rm {directory}/lock`"):
            clear_stale_lock("op", directory, grace=0.0, patience=2.0)
        assert "being built by another process" in caplog.text
    finally:
        builder.kill()
        builder.wait()
    clear_stale_lock("op", directory, grace=0.0)  # its builder gone, the lock goes too
    assert not (directory / "lock").exists()


def test_each_environment_builds_its_ops_in_its_own_directory(monkeypatch, tmp_path: Path) -> None:
    """Two virtualenvs sharing torch's default cache rebuilt each other's ops at every switch."""
    import sys

    from lightning_smartinf.ops import environment_extensions_dir, use_environment_extensions_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = use_environment_extensions_dir()
    assert mine == environment_extensions_dir() and os.environ["TORCH_EXTENSIONS_DIR"] == str(mine)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert environment_extensions_dir() != mine and environment_extensions_dir().name.startswith("other-venv-")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert use_environment_extensions_dir() == tmp_path / "chosen"  # the user's choice stands
