"""Copy before overwrite: the subgroups whose state a checkpoint in the background has not yet copied.

A save takes its snapshot at a step boundary by holding every subgroup it will copy; the next optimizer step
passes each subgroup through ``StateFence.passing`` before reading or rewriting its state, so it waits only where
the copy has not reached yet (the save copies in the order the step updates). The checkpoint therefore holds the
boundary's values while training goes on, and the forward and backward passes between two steps never wait.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from lightning_smartinf import trace
from lightning_smartinf.core import Subgroup


class FenceHold:
    """One save's claim on its subgroups' state: each ``done`` releases one copy of a key; ``close`` the rest."""

    def __init__(self, fence: StateFence, counts: Counter[str]) -> None:
        self._fence = fence
        self._left = counts

    def done(self, key: str) -> None:
        """One of ``key``'s state files (or in-memory tensors) is copied."""
        with self._fence.changed:
            if self._left[key] > 0:
                self._left[key] -= 1
                self._fence.held[key] -= 1
                self._fence.changed.notify_all()

    def close(self) -> None:
        """Release whatever is still held (the save finished, or failed part-way)."""
        with self._fence.changed:
            for key, count in self._left.items():
                self._fence.held[key] -= count
            self._left.clear()
            self._fence.changed.notify_all()


class StateFence:
    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.held: Counter[str] = Counter()
        """Copies still to make, per subgroup key, over every save in flight."""
        self.waited_s = 0.0
        """Seconds the step has waited here in all (what a save in the background cost training, beyond the disk
        time it shares)."""

    def hold(self, keys: Iterable[str]) -> FenceHold:
        """Claim one copy of each key (a key given twice is claimed twice) until the hold releases it."""
        counts = Counter(keys)
        with self.changed:
            self.held.update(counts)
        return FenceHold(self, counts)

    def is_held(self, key: str) -> bool:
        with self.changed:
            return self.held[key] > 0

    def passing(self, subgroups: Iterable[Subgroup]) -> Iterator[Subgroup]:
        """The subgroups in order, each once its state has been copied by every save that holds it."""
        for sg in subgroups:
            if self.is_held(sg.key):
                started = time.perf_counter()
                with trace.span(f"wait for the checkpoint's copy of {sg.key}", "wait"), self.changed:
                    self.changed.wait_for(lambda key=sg.key: self.held[key] <= 0)  # type: ignore[misc]
                    self.waited_s += time.perf_counter() - started
            yield sg
