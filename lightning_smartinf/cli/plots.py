"""A PNG of a run's curves: training/validation loss and host-link traffic, from the CSV logger's metrics.csv."""

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
    steps, gbps = _series(rows, "host_GBps")
    io_ax.plot(steps, gbps, label="host link GB/s")
    io_ax.set(xlabel="step", ylabel="GB/s", title="host-link traffic")
    twin = io_ax.twinx()
    steps, tok = _series(rows, "tok_s")
    twin.plot(steps, tok, "--", color="tab:orange", label="tokens/s")
    twin.set_ylabel("tokens/s")
    io_ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
