"""Exact byte counters per link, per kind of tensor and per direction.

A *link* is a path data takes: ``host`` is the shared link between host memory and storage (what ZeRO-Infinity
saturates); near-storage devices add their own internal links. A *kind* is what the bytes are: ``param``,
``grad``, ``master``, ``exp_avg``, ... Counters hold payload bytes (elements x element size), not the alignment
padding that O_DIRECT adds, so per-parameter figures match the papers' accounting exactly.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

READ = "read"
WRITE = "write"


@dataclass(frozen=True)
class TrafficKey:
    link: str
    kind: str
    direction: str


class TrafficCounters:
    """Thread-safe byte counters; I/O threads add, the trainer reads snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[TrafficKey, int] = defaultdict(int)

    def add(self, link: str, kind: str, direction: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[TrafficKey(link, kind, direction)] += nbytes

    def snapshot(self) -> dict[TrafficKey, int]:
        with self._lock:
            return dict(self._bytes)

    def total(self, link: str | None = None, kind: str | None = None, direction: str | None = None) -> int:
        """Sum of the bytes matching every given filter."""
        return sum(
            n
            for key, n in self.snapshot().items()
            if (link is None or key.link == link)
            and (kind is None or key.kind == kind)
            and (direction is None or key.direction == direction)
        )

    def table(self) -> dict[str, dict[str, int]]:
        """``{"link/direction": {kind: bytes}}``, for summaries and JSON reports."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for key, n in sorted(self.snapshot().items(), key=lambda kv: (kv[0].link, kv[0].direction, kv[0].kind)):
            out[f"{key.link}/{key.direction}"][key.kind] = n
        return dict(out)

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
