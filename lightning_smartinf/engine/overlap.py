"""The optimizer step that runs behind the next forward pass (``schedule.overlap``, eager updates): one object
owns its thread, the per-block events that say whose parameters are current, its progress and its failure.

The trainer's thread waits on it in three places only: for the step's non-overlapped share (``wait_share``), for
one block's update before fetching that block (``wait_block``), and for the whole step (``join``, before a
checkpoint, a read of the masters or shutdown). A failure on the step's thread wakes every waiter and is raised on
the trainer's thread at the next of those waits.

On a CPU device compute and the step share the same cores: torch's operations on the step's thread (DeepSpeed's
CPU Adam, the conversions to 16-bit) would start a second OpenMP team as wide as compute's, and two teams
spinning on two cores stall each other at every barrier. So while the trainer computes, the step's math runs on one
thread (``pace``), and on all of compute's threads while the trainer waits for it. Measured on GPT-350M, sequence
128, everything on storage, 2 cores: 11.2 and 10.8 s per iteration against 12.5 and 12.5 s with one team per
thread each as wide as compute's (alternating runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class StepFailedError(RuntimeError):
    """The optimizer step running on its own thread failed (the cause is chained)."""


class OverlappedStep:
    def __init__(self, blocks: int, shares_cores: bool = False) -> None:
        """``shares_cores``: compute runs on the CPU cores the step uses (a CPU device), see ``pace``."""
        self._current = [threading.Event() for _ in range(blocks)]
        """Set while a block's stored parameters are current; cleared while a running step updates them."""
        for event in self._current:
            event.set()
        self._progress = threading.Condition()
        self._done = 0
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.shares_cores = shares_cores
        self._waiting = 0
        """The trainer's waits in progress: while there are any, the step may use every core."""
        self._compute_threads = 1
        """Compute's intra-op threads, read on the trainer's thread when the step starts."""
        self._step_threads = 0
        """The step thread's intra-op threads as last set (0: not set)."""

    # -- on the trainer's thread ------------------------------------------------------------------------------------
    def start(self, run: Callable[[], None]) -> None:
        """Run ``run`` (the step) on its own thread."""
        self._done = 0
        self._compute_threads = torch.get_num_threads()

        def guarded() -> None:
            self._step_threads = 0
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - raised on the trainer's thread at its next wait
                self.failure = err
                for event in self._current:
                    event.set()
                with self._progress:
                    self._progress.notify_all()
            finally:
                if self._step_threads:  # torch keeps the last count for threads started later: compute's again
                    torch.set_num_threads(self._compute_threads)

        self._thread = threading.Thread(target=guarded, name="smartinf-step", daemon=True)
        self._thread.start()

    def stale(self, block: int) -> None:
        """Block ``block``'s stored parameters are about to change (before the step that changes them starts)."""
        self._current[block].clear()

    def is_current(self, block: int) -> bool:
        return self._current[block].is_set()

    @contextmanager
    def _trainer_waits(self) -> Iterator[None]:
        with self._progress:
            self._waiting += 1
        try:
            yield
        finally:
            with self._progress:
                self._waiting -= 1

    def wait_block(self, block: int) -> None:
        """Until block ``block``'s update has landed (at once when no step is updating it)."""
        if not self._current[block].is_set():
            with self._trainer_waits():
                self._current[block].wait()
        self.raise_failure()

    def wait_share(self, elements: float) -> None:
        """Until the step has updated ``elements`` elements (or failed)."""
        with self._trainer_waits(), self._progress:
            self._progress.wait_for(lambda: self._done >= elements or self.failure is not None)
        self.raise_failure()

    @property
    def started(self) -> bool:
        """A step was started and not joined yet (it may have finished)."""
        return self._thread is not None

    def join(self) -> None:
        """Until the step has finished; raises its failure."""
        if self._thread is not None:
            with self._trainer_waits():
                self._thread.join()
            self._thread = None
        self.raise_failure()

    def raise_failure(self) -> None:
        if isinstance(self.failure, OSError):  # a storage failure keeps its type: callers treat those apart
            raise self.failure
        if self.failure is not None:
            raise StepFailedError(f"the optimizer step failed: {self.failure}") from self.failure

    # -- on the step's thread ---------------------------------------------------------------------------------------
    def pace(self) -> None:
        """Before each subgroup's update: one intra-op thread while the trainer computes on the same cores, all of
        compute's while it waits for the step (``shares_cores`` only; elsewhere torch's count is left alone)."""
        if not self.shares_cores:
            return
        wanted = self._compute_threads if self._waiting else 1
        if wanted != self._step_threads:
            torch.set_num_threads(wanted)
            self._step_threads = wanted
    def published(self, block: int) -> None:
        """Block ``block``'s new parameters are stored: a fetch may read them."""
        self._current[block].set()

    def advance(self, elements: int) -> None:
        with self._progress:
            self._done += elements
            self._progress.notify_all()
