"""A PNG of a run's curves from the CSV logger's metrics.csv: training/validation loss, where each step's time went
(compute, waits on storage, the exposed optimizer update; ``lightning/monitor.py``), and what each step moved over
the host link (to and from storage on a CPU device): what went to the disk beside what waiting on it cost."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning_smartinf.extras import pyplot


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
    return [p[0] for p in points], [p[1] for p in points]


def _stacked(ax: Any, rows: list[dict[str, str]], series: tuple[tuple[str, str, str], ...]) -> None:
    """Bars per logged step, one colour per series, stacked (a run without a series draws none of it)."""
    bottom: dict[int, float] = {}
    for key, label, color in series:
        steps, values = _series(rows, key)
        if steps:
            gap = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)  # the logging interval
            ax.bar(steps, values, bottom=[bottom.get(s, 0.0) for s in steps], width=0.8 * max(gap, 1), label=label,
                   color=color)  # fmt: skip
            for s, v in zip(steps, values, strict=True):
                bottom[s] = bottom.get(s, 0.0) + v
    if bottom:
        ax.legend(loc="upper left", fontsize=8)


def plot_run(metrics_csv: Path, out_png: Path, title: str) -> Path:
    plt = pyplot("the run's plot")
    with metrics_csv.open() as f:
        rows = list(csv.DictReader(f))
    fig, (loss_ax, io_ax, bytes_ax) = plt.subplots(1, 3, figsize=(16, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        steps, values = _series(rows, key)
        if steps:
            loss_ax.plot(steps, values, style, label=key)
    loss_ax.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    loss_ax.legend()
    _stacked(io_ax, rows, (("t_compute", "compute", "#4c72b0"), ("t_storage", "waits on storage", "#c44e52"),
                           ("t_update", "exposed update", "#55a868")))  # fmt: skip
    io_ax.set(xlabel="step", ylabel="seconds", title="where each step's time goes")
    _stacked(bytes_ax, rows, (("host_read_MB", "read", "#8172b2"), ("host_write_MB", "written", "#ccb974")))
    bytes_ax.set(xlabel="step", ylabel="MB", title="host link (storage) traffic per step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
