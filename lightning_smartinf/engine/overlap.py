"""The optimizer step that runs behind the next forward pass (``schedule.overlap``, eager updates): one object
owns its thread, the per-block events that say whose parameters are current, its progress and its failure.

The trainer's thread waits on it in three places only: for the step's non-overlapped share (``wait_share``), for
one block's update before fetching that block (``wait_block``), and for the whole step (``join``, before a
checkpoint, a read of the masters or shutdown). A failure on the step's thread wakes every waiter and is raised on
the trainer's thread at the next of those waits.

On a CPU device compute and the step share the same cores: torch's operations on the step's thread (DeepSpeed's
CPU Adam, the conversions to 16-bit) would start a second OpenMP team as wide as compute's, and two teams spinning
on the same cores stall each other at every barrier. So the step's thread runs its math on one intra-op thread
(``shares_cores``). The count is fixed, not chosen by whether the trainer is waiting at the moment: how elementwise
kernels split their work decides which elements take the vectorized path, so a count that varied with timing would
make runs differ in the last bit. Measured on GPT-350M, sequence 128, everything on storage, 2 cores: 11.2 and
10.8 s per iteration against 12.5 and 12.5 s with a team as wide as compute's (alternating runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class StepFailedError(RuntimeError):
    """The optimizer step running on its own thread failed (the cause is chained)."""


class OverlappedStep:
    def __init__(self, blocks: int, shares_cores: bool = False) -> None:
        """``shares_cores``: compute runs on the CPU cores the step uses (a CPU device): the step's thread runs its
        math on one intra-op thread (see the module docstring)."""
        self._current = [threading.Event() for _ in range(blocks)]
        """Set while a block's stored parameters are current; cleared while a running step updates them."""
        for event in self._current:
            event.set()
        self._progress = threading.Condition()
        self._done = 0
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.shares_cores = shares_cores

    # -- on the trainer's thread ------------------------------------------------------------------------------------
    def start(self, run: Callable[[], None]) -> None:
        """Run ``run`` (the step) on its own thread."""
        self._done = 0
        compute_threads = torch.get_num_threads()  # the trainer's

        def guarded() -> None:
            if self.shares_cores:
                torch.set_num_threads(1)  # this thread's OpenMP team; torch also keeps it for threads started later
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - raised on the trainer's thread at its next wait
                self.failure = err
                for event in self._current:
                    event.set()
                with self._progress:
                    self._progress.notify_all()
            finally:
                if self.shares_cores:  # threads started later get compute's count again
                    torch.set_num_threads(compute_threads)

        self._thread = threading.Thread(target=guarded, name="smartinf-step", daemon=True)
        self._thread.start()

    def stale(self, block: int) -> None:
        """Block ``block``'s stored parameters are about to change (before the step that changes them starts)."""
        self._current[block].clear()

    def is_current(self, block: int) -> bool:
        return self._current[block].is_set()

    def wait_block(self, block: int) -> None:
        """Until block ``block``'s update has landed (at once when no step is updating it)."""
        self._current[block].wait()
        self.raise_failure()

    def wait_share(self, elements: float) -> None:
        """Until the step has updated ``elements`` elements (or failed)."""
        with self._progress:
            self._progress.wait_for(lambda: self._done >= elements or self.failure is not None)
        self.raise_failure()

    @property
    def started(self) -> bool:
        """A step was started and not joined yet (it may have finished)."""
        return self._thread is not None

    def join(self) -> None:
        """Until the step has finished; raises its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_failure()

    def raise_failure(self) -> None:
        if isinstance(self.failure, OSError):  # a storage failure keeps its type: callers treat those apart
            raise self.failure
        if self.failure is not None:
            raise StepFailedError(f"the optimizer step failed: {self.failure}") from self.failure

    # -- on the step's thread ---------------------------------------------------------------------------------------
    def published(self, block: int) -> None:
        """Block ``block``'s new parameters are stored: a fetch may read them."""
        self._current[block].set()

    def advance(self, elements: int) -> None:
        with self._progress:
            self._done += elements
            self._progress.notify_all()
