"""``Trace``: the Lightning callback that records a few iterations with ``trace.Tracer`` (see ``trace.py``),
writes the Chrome/Perfetto trace and logs the training thread's exposed time per phase and the storage traffic."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_smartinf import extras, trace

log = logging.getLogger(__name__)


class Trace(pl.Callback):
    """Record iterations ``start`` .. ``start + iterations - 1`` (optimizer steps, counted from 0; the first ones
    warm up and have no step to overlap), write the trace to ``path`` and log the exposed time per phase. Under
    ``accumulate_grad_batches`` an iteration is the whole window of batches its optimizer step ends."""

    def __init__(self, path: str | Path, start: int = 2, iterations: int = 2) -> None:
        self.path = Path(path)
        self.start, self.iterations = start, iterations
        self.tracer: trace.Tracer | None = None
        self.window: list[tuple[int, int]] = []
        self.summary: dict[str, Any] = {}
        self._began: int | None = None
        self._step = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        if self._began is not None:  # within an accumulation window
            return
        if trainer.global_step == self.start and self.tracer is None:
            self.tracer = trace.start()
        self._began, self._step = time.perf_counter_ns(), trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if trainer.global_step == self._step:  # no optimizer step yet: the iteration goes on
            return
        began, self._began = self._began, None
        if self.tracer is None or trace.active() is not self.tracer or began is None:
            return
        now = time.perf_counter_ns()  # the iteration's end
        self.tracer.record(f"iteration {self._step}", "iteration", began, now)
        self.window.append((began, now))
        if len(self.window) == self.iterations:
            trace.stop()  # the files are written as training ends, outside the timed iterations

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()

    def finish(self) -> None:
        """Stop recording, write the trace, its picture and the summary (also ``self.summary``)."""
        tracer = self.tracer
        if trace.active() is tracer:
            trace.stop()
        if tracer is None or not self.window or self.summary:
            return
        first, last = self.window[0][0], self.window[-1][1]
        n = len(self.window)
        phases = {k: v / n for k, v in sorted(tracer.exposed(first, last).items(), key=lambda kv: -kv[1])}
        io = tracer.io_summary(first, last)
        self.summary = {"iterations": n, "seconds_per_iteration": (last - first) / 1e9 / n, "phases": phases,
                        "io": io, "io_cpu": tracer.cpu_work(first, last), "trace": str(tracer.write(self.path)),
                        "plot": str(plot_timeline(tracer, first, last, self.path.with_suffix(".png")))
                        if extras.available("matplotlib") else None}  # fmt: skip
        log.info("%s", format_summary(self.summary))


COLORS = {"compute": "#4c72b0", "recompute": "#8172b2", "wait": "#c44e52", "update-wait": "#e377c2",
          "grads": "#dd8452", "step": "#937860", "update": "#55a868", "io": "#8c8c8c",
          "io-cpu": "#ccb974"}


def plot_timeline(tracer: trace.Tracer, start_ns: int, end_ns: int, path: Path) -> Path:
    """The traced iterations as a picture: one row per thread (training thread on top), spans by category."""
    plt = extras.pyplot("the timeline's plot")
    tids = [tracer.main_tid] + sorted(t for t in tracer.threads if t != tracer.main_tid)
    rows = {tid: i for i, tid in enumerate(tids)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(tids) + 1.5))
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in tracer.events:
        if e.cat != "iteration" and e.end_ns >= start_ns and e.start_ns <= end_ns:
            groups.setdefault((e.tid, e.cat), []).append(((e.start_ns - start_ns) / 1e9, (e.end_ns - e.start_ns) / 1e9))
    for cat in COLORS:  # nested spans (wait, recompute, grads) drawn after, thinner, on top
        height = 0.45 if cat in ("wait", "update-wait", "recompute", "grads", "io-cpu") else 0.6
        for (tid, group_cat), spans in groups.items():
            if group_cat == cat:
                ax.broken_barh(spans, (rows[tid] - height / 2, height), facecolors=COLORS[cat], linewidth=0)
    ax.set_yticks(range(len(tids)), [tracer.threads.get(t, str(t)) for t in tids], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), ncol=len(COLORS), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_summary(summary: dict[str, Any]) -> str:
    total = summary["seconds_per_iteration"]
    lines = [f"trace: {summary['trace']} (picture: {summary['plot']}; {summary['iterations']} iteration(s), "
             f"{total:.3f} s each); the training thread's time per iteration by phase (all but compute is exposed):"]
    lines += [f"  {phase:<8} {seconds:8.3f} s  {100 * seconds / total:5.1f}%" for phase, seconds in
              summary["phases"].items()]  # fmt: skip
    for kind, row in sorted(summary["io"].items()):
        n = summary["iterations"]
        lines.append(f"  io {kind:<16} {row['requests'] / n:6.0f} req {row['bytes'] / n / 1e6:9.1f} MB  busy "
                     f"{row['busy_s'] / n:7.3f} s  queued {row['queue_s'] / max(row['requests'], 1) * 1e3:7.2f} ms "
                     "avg per iteration")  # fmt: skip
    for name, row in sorted(summary.get("io_cpu", {}).items()):
        n = summary["iterations"]
        lines.append(f"  io-cpu {name:<13} {row['bytes'] / n / 1e6:9.1f} MB  {row['seconds'] / n:7.3f} s on all "
                     f"threads, {row['training_thread_s'] / n:.3f} s of it on the training thread, per iteration")
    return "\n".join(lines)
