"""docs/gpu.md is built from what scripts/gpu_check.sh leaves in its output folder."""

from __future__ import annotations

import json
from pathlib import Path

from smartinf_tools.gpu_report import report


def test_report_gathers_environment_tests_and_bench(tmp_path: Path) -> None:
    (tmp_path / "environment.json").write_text(json.dumps({"torch": "2.11.0+cu130", "device": "NVIDIA H200"}))
    (tmp_path / "gpu_tests.log").write_text("...\n========== 3 passed in 12.0s ==========\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "benchmarks.md").write_text("| system | s/step |\n|---|---|\n| (c) | 1.0 |\n")
    text = report(tmp_path, 0, dry_run=False)
    assert "- device: NVIDIA H200" in text and "3 passed in 12.0s (exit status 0)" in text
    assert "| (c) | 1.0 |" in text and "## Running it" in text
    assert "not run" in report(tmp_path / "empty", 2, dry_run=True)
