"""smartinf-soak's arithmetic: slopes per hour and what it reads of a run's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from smartinf_tools.soak import Sample, metrics, slope_per_hour


def test_slope_is_per_hour_and_ignores_noise_around_a_flat_line() -> None:
    growing = [Sample(t, 0, 100 + t / 36, 10, 5, 0) for t in range(0, 3600, 60)]  # +100 MiB an hour
    assert slope_per_hour(growing, "rss_mib") == pytest.approx(100)
    flat = [Sample(t, 0, 0, 10 + (t // 60) % 2, 5, 0) for t in range(0, 3600, 60)]
    assert abs(slope_per_hour(flat, "fds")) < 0.1


def test_metrics_reads_the_newest_step_and_the_validation_passes(tmp_path: Path) -> None:
    assert metrics(tmp_path) == (0, 0)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text(
        "epoch,step,train_loss,val_loss\n0,4,3.1,\n0,9,2.9,\n0,9,,2.8\n0,14,2.7,\n"
    )
    assert metrics(tmp_path) == (14, 1)
