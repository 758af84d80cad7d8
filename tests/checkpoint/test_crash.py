"""SIGKILL at any point of a run, then resume from the newest complete checkpoint: the result is bit-for-bit the
uninterrupted run's (fp32). Each run is a real subprocess (``crash_run.py``) on real files."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("crash_run.py")


def run(out: Path, *args: str, killed: bool = False) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=600)
    if killed:
        assert done.returncode == -signal.SIGKILL, f"expected a SIGKILL, got {done.returncode}:\n{done.stderr[-3000:]}"
    else:
        assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def assert_same_final(a: Path, b: Path) -> None:
    expected, got = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out)
    return out


# (a kill before a step's forward is one between steps: the kill in backward covers it, with a step half-built)
@pytest.mark.parametrize("point", ["backward", "step", "checkpoint", "publish"])
def test_killed_run_resumes_exactly(point: str, uninterrupted: Path, tmp_path: Path) -> None:
    run(tmp_path, "--kill", point, killed=True)
    log = run(tmp_path, "--resume")
    assert "took over the lock" in log  # the dead run's lock was recovered, not mistaken for a live one
    if point == "publish":  # killed between the two renames that replace last.ckpt
        assert "recovered checkpoint" in log
    assert_same_final(uninterrupted, tmp_path)
    leftovers = [p.name for p in (tmp_path / "ckpts").iterdir() if p.name.startswith(".")]
    assert point == "checkpoint" or not leftovers, leftovers  # an unfinished save's staging dir waits for the next


def test_killed_mid_step_with_smart_update_vertical_and_compression(tmp_path: Path) -> None:
    """Mid-step on near-storage devices, with overlap (the step runs into the next forward) and error feedback."""
    variant = ["--update", "smart", "--schedule", "vertical", "--compression", "topk"]
    run(tmp_path / "straight", *variant)
    run(tmp_path / "killed", *variant, "--kill", "step", killed=True)
    run(tmp_path / "killed", *variant, "--resume")
    assert_same_final(tmp_path / "straight", tmp_path / "killed")
