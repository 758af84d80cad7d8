"""A PNG of a run's curves from the CSV logger's metrics.csv: training/validation loss, and where each step's time
went (compute, waits on storage, the exposed optimizer update; ``lightning/monitor.py``) with tokens/s over it."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(metrics_csv: Path, out_png: Path, title: str) -> Path:
    with metrics_csv.open() as f:
        rows = list(csv.DictReader(f))
    fig, (loss_ax, io_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        steps, values = _series(rows, key)
        if steps:
            loss_ax.plot(steps, values, style, label=key)
    loss_ax.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    loss_ax.legend()
    bottom: dict[int, float] = {}
    for key, label, color in (("t_compute", "compute", "#4c72b0"), ("t_storage", "waits on storage", "#c44e52"),
                              ("t_update", "exposed update", "#55a868")):  # fmt: skip
        steps, seconds = _series(rows, key)
        if steps:
            gap = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)  # the logging interval
            io_ax.bar(steps, seconds, bottom=[bottom.get(s, 0.0) for s in steps], width=0.8 * max(gap, 1),
                      label=label, color=color)  # fmt: skip
            for s, v in zip(steps, seconds, strict=True):
                bottom[s] = bottom.get(s, 0.0) + v
    io_ax.set(xlabel="step", ylabel="seconds", title="where each step's time goes")
    io_ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
