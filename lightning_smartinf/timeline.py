"""``Trace``: the Lightning callback that records a few iterations with ``trace.Tracer`` (see ``trace.py``),
writes the Chrome/Perfetto trace and logs the training thread's exposed time per phase and the storage traffic."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_smartinf import trace

log = logging.getLogger(__name__)


class Trace(pl.Callback):
    """Record iterations ``start`` .. ``start + iterations - 1`` (counted from 0; the first ones warm up and have no
    step to overlap), write the trace to ``path`` and log the exposed time per phase."""

    def __init__(self, path: str | Path, start: int = 2, iterations: int = 2) -> None:
        self.path = Path(path)
        self.start, self.iterations = start, iterations
        self.tracer: trace.Tracer | None = None
        self.window: list[tuple[int, int]] = []
        self.summary: dict[str, Any] = {}
        self._began = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        if batch_idx == self.start and self.tracer is None:
            self.tracer = trace.start()
        self._began = time.perf_counter_ns()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self.tracer is None or trace.active() is not self.tracer:
            return
        now = time.perf_counter_ns()
        self.tracer.record(f"iteration {batch_idx}", "iteration", self._began, now)
        self.window.append((self._began, now))
        if len(self.window) == self.iterations:
            self.finish()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.tracer is not None and trace.active() is self.tracer:
            self.finish()

    def finish(self) -> None:
        """Stop recording, write the trace and the summary (also ``self.summary``)."""
        tracer = self.tracer
        trace.stop()
        if tracer is None or not self.window:
            return
        first, last = self.window[0][0], self.window[-1][1]
        n = len(self.window)
        phases = {k: v / n for k, v in sorted(tracer.exposed(first, last).items(), key=lambda kv: -kv[1])}
        io = tracer.io_summary(first, last)
        self.summary = {"iterations": n, "seconds_per_iteration": (last - first) / 1e9 / n, "phases": phases,
                        "io": io, "trace": str(tracer.write(self.path))}  # fmt: skip
        log.info("%s", format_summary(self.summary))


def format_summary(summary: dict[str, Any]) -> str:
    total = summary["seconds_per_iteration"]
    lines = [f"trace: {summary['trace']} ({summary['iterations']} iteration(s), {total:.3f} s each); the training "
             "thread's time per iteration by phase (all but compute is exposed):"]  # fmt: skip
    lines += [f"  {phase:<8} {seconds:8.3f} s  {100 * seconds / total:5.1f}%" for phase, seconds in
              summary["phases"].items()]  # fmt: skip
    for kind, row in sorted(summary["io"].items()):
        n = summary["iterations"]
        lines.append(f"  io {kind:<16} {row['requests'] / n:6.0f} req {row['bytes'] / n / 1e6:9.1f} MB  busy "
                     f"{row['busy_s'] / n:7.3f} s  queued {row['queue_s'] / max(row['requests'], 1) * 1e3:7.2f} ms "
                     "avg per iteration")  # fmt: skip
    return "\n".join(lines)
