"""A timeline of training: where every second of an iteration goes, as a Chrome/Perfetto trace.

    smartinf-train trainer.trace=trace.json               # iterations 2-3 (after warm-up), then open it in
                                                          # https://ui.perfetto.dev or chrome://tracing
    trainer = pl.Trainer(strategy="smart_infinity", callbacks=[Trace("trace.json", start=2, iterations=2)])
                                                          # lightning_smartinf.lightning.timeline.Trace

A small span recorder rather than torch.profiler: it records the few hundred events an iteration has (per block
and micro-batch forward, backward and recompute; every storage request with its bytes, queue wait and service
time, on the I/O thread that served it; the update of each subgroup; each wait of compute on a fetch or of the next
forward on the overlapped step) and none of the thousands of operator calls, so it can stay on for a short run.
While no trace is recording, a span costs one global lookup.

The summary splits the training thread's time into phases by the innermost span open at each moment: time in
``compute`` is the work itself, everything else (``wait``: on a fetch or a state read; ``update-wait``: on the
overlapped step; ``step``: the optimizer step where it is not overlapped; ``other``: data loading, Lightning,
logging) is exposed time that a better schedule could hide.

``Phases`` keeps the same split as running totals without recording anything (two clock reads per span on the
training thread): the monitor reads it every step for the progress bar and the run's plot.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IO_CPU = "io-cpu"
"""The CPU work of I/O (checksums, copies into and out of I/O buffers), on whichever thread does it: on a CPU host it
shares the cores with compute, so the summary totals it over all threads."""


@dataclass
class Event:
    name: str
    cat: str
    start_ns: int
    end_ns: int
    tid: int
    args: dict[str, Any]


class Tracer:
    """Spans from every thread, kept in memory until ``write``; appending to a list is atomic under the GIL, so
    worker threads record without a lock."""

    def __init__(self) -> None:
        self.origin_ns = time.perf_counter_ns()
        self.events: list[Event] = []
        self.threads: dict[int, str] = {}
        self.main_tid = threading.get_ident()
        self.open: dict[tuple[int, Any], int] = {}

    def record(self, name: str, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
        tid = threading.get_ident()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        self.events.append(Event(name, cat, start_ns, end_ns, tid, args))

    def write(self, path: Path) -> Path:
        """The trace in Chrome's trace-event format (one complete event per span, times in microseconds)."""
        pid = os.getpid()
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in self.threads.items()
        ]
        first = {"sort_index": 0}  # the training thread on top
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": self.main_tid, "args": first})
        for e in self.events:
            events.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": pid, "tid": e.tid,
                           "ts": (e.start_ns - self.origin_ns) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3,
                           "args": e.args})  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def exposed(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """Seconds of the training thread in ``[start_ns, end_ns)`` by phase: the category of the innermost span
        open at each moment (``other`` where none is), so the phases add up to the wall time."""
        spans = sorted((e for e in self.events if e.tid == self.main_tid and e.cat != "iteration"),
                       key=lambda e: (e.start_ns, -e.end_ns))  # fmt: skip
        edges = sorted({start_ns, end_ns, *(t for e in spans for t in (e.start_ns, e.end_ns) if start_ns < t < end_ns)})
        totals: dict[str, float] = defaultdict(float)
        open_spans: list[Event] = []
        i = 0
        for left, right in zip(edges, edges[1:], strict=False):
            while i < len(spans) and spans[i].start_ns <= left:
                open_spans.append(spans[i])
                i += 1
            open_spans = [s for s in open_spans if s.end_ns > left]
            inner = max(open_spans, key=lambda s: s.start_ns, default=None)
            totals[inner.cat if inner is not None else "other"] += (right - left) / 1e9
        return dict(totals)

    def io_summary(self, start_ns: int, end_ns: int) -> dict[str, dict[str, float]]:
        """Per request kind (``read master``, ``write param``, ...): requests, bytes, busy seconds, mean queue wait."""
        rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for e in self.events:
            if e.cat == "io" and start_ns <= e.start_ns < end_ns:
                row = rows[e.name]
                row["requests"] += 1
                row["bytes"] += e.args["bytes"]
                row["busy_s"] += (e.end_ns - e.start_ns) / 1e9
                row["queue_s"] += e.args["queue_ms"] / 1e3
        return {k: dict(v) for k, v in rows.items()}


    def cpu_work(self, start_ns: int, end_ns: int) -> dict[str, dict[str, float]]:
        """The ``io-cpu`` spans in ``[start_ns, end_ns)`` by name (``checksum``, ``copy graphs``, ...): seconds summed
        over every thread, the training thread's share of them, and bytes."""
        rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for e in self.events:
            if e.cat == IO_CPU and start_ns <= e.start_ns < end_ns:
                row = rows[e.name]
                seconds = (e.end_ns - e.start_ns) / 1e9
                row["seconds"] += seconds
                row["training_thread_s"] += seconds if e.tid == self.main_tid else 0.0
                row["bytes"] += e.args.get("bytes", 0)
        return {k: dict(v) for k, v in rows.items()}


class Phases:
    """Seconds of one thread (the training thread) by the category of its innermost open span, as running totals;
    a span's own time excludes the spans opened inside it."""

    def __init__(self) -> None:
        self.tid = threading.get_ident()
        self.totals: dict[str, float] = defaultdict(float)
        self._inner: list[int] = []  # per open span: nanoseconds spent in spans opened inside it

    def push(self) -> None:
        self._inner.append(0)

    def pop(self, cat: str, duration_ns: int) -> None:
        inner = self._inner.pop()
        self.totals[cat] += (duration_ns - inner) / 1e9
        if self._inner:
            self._inner[-1] += duration_ns


_active: Tracer | None = None
_phases: Phases | None = None


def count_phases() -> Phases:
    """Start the running totals of the calling thread's phases (the monitor calls it on the training thread)."""
    global _phases
    _phases = Phases()
    return _phases


def stop_phases() -> None:
    global _phases
    _phases = None


def start() -> Tracer:
    """Start recording (from every thread) into a new tracer."""
    global _active
    _active = Tracer()
    return _active


def stop() -> None:
    global _active
    _active = None


def active() -> Tracer | None:
    """The recording tracer, or None (the common case: then nothing is recorded)."""
    return _active


@contextmanager
def span(name: str, cat: str, **args: Any) -> Iterator[None]:
    """Record the enclosed work as one span of category ``cat`` (compute, wait, step, update, ...)."""
    tracer, phases = _active, _phases
    if phases is not None and phases.tid != threading.get_ident():
        phases = None
    if tracer is None and phases is None:
        yield
        return
    start = time.perf_counter_ns()
    if phases is not None:
        phases.push()
    try:
        yield
    finally:
        end_ns = time.perf_counter_ns()
        if tracer is not None:
            tracer.record(name, cat, start, end_ns, **args)
        if phases is not None:
            phases.pop(cat, end_ns - start)


def begin(key: Any) -> None:
    """Open a span that ``end(key, ...)`` closes later on this thread (when the two ends sit in different calls)."""
    tracer = _active
    if tracer is not None:
        tracer.open[(threading.get_ident(), key)] = time.perf_counter_ns()


def end(key: Any, name: str, cat: str, **args: Any) -> None:
    tracer = _active
    if tracer is not None and (start := tracer.open.pop((threading.get_ident(), key), None)) is not None:
        tracer.record(name, cat, start, time.perf_counter_ns(), **args)


def traced_io(work: Callable[[], None], action: str, path: Path, nbytes: int, urgent: bool) -> Callable[[], None]:
    """``work`` (one storage request) wrapped to record its queue wait and service time on the thread serving it."""
    tracer = _active
    if tracer is None:
        return work
    submitted = time.perf_counter_ns()

    def run() -> None:
        start = time.perf_counter_ns()
        try:
            work()
        finally:
            tracer.record(f"{action} {path.parent.name}", "io", start, time.perf_counter_ns(), bytes=nbytes,
                          queue_ms=(start - submitted) / 1e6, urgent=urgent, file=str(path))  # fmt: skip

    return run
