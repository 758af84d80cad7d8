"""The op loader names a build lock left behind by a killed compile (torch would wait on it silently, forever)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightning_smartinf.ops import load_op


class _Builder:
    NAME = "smartinf_test_op"

    def load(self, verbose: bool = False) -> str:
        return "loaded"


def test_a_leftover_build_lock_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, "lightning_smartinf.ops")
    assert load_op(_Builder()) == "loaded"
    assert "compiling DeepSpeed's smartinf_test_op op" in caplog.text

    (tmp_path / _Builder.NAME).mkdir(exist_ok=True)
    lock = tmp_path / _Builder.NAME / "lock"
    lock.touch()
    caplog.clear()
    load_op(_Builder())
    assert str(lock) in caplog.text and "delete that file" in caplog.text
