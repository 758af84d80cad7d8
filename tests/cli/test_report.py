"""Command-line errors: a user's problem is one line naming the key and the fix; a bug keeps its traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_smartinf.checkpoint.files import DiskFullError
from lightning_smartinf.cli.report import reporting
from lightning_smartinf.errors import ConfigError


def test_a_project_error_anywhere_in_the_chain_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done, reporting("tool"):
        try:
            raise DiskFullError(28, "disk full: X needs 1 GiB\nand 2 B are free")
        except DiskFullError as err:
            raise RuntimeError("the optimizer step failed") from err
    assert done.value.code == 1
    err = capsys.readouterr().err
    assert err == "tool: error: disk full: X needs 1 GiB and 2 B are free (the traceback: HYDRA_FULL_ERROR=1)\n"


def test_a_bug_keeps_its_traceback_and_the_switch_shows_every_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError), reporting("tool"):
        raise KeyError("a bug")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError), reporting("tool"):
        raise ConfigError("x=1 must be >= 2")


def run_train(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", f"hydra.run.dir={tmp_path / 'run'}",
           f"offload.nvme_path={tmp_path / 'state'}", *overrides]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["compression=topk", "compression.keep=0"], "compression.keep=0.0 must be in (0, 1]"),
        (["schedule=vertical", "schedule.micro_batches=3"], "data.batch_size=8 does not split into"),
        (["trainer.resume=nowhere"], "trainer.resume='nowhere' does not exist"),
    ],
)
def test_smartinf_train_prints_one_line_before_set_up(tmp_path: Path, overrides: list[str], message: str) -> None:
    done = run_train(tmp_path, *overrides)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("smartinf-train: error: ") and message in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "state").exists()
