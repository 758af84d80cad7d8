"""Checkpoint work that runs behind training: saves and removals, in the order they were asked for, on one thread.

Order matters: Lightning's ModelCheckpoint writes the new checkpoint and then removes the one it replaces, so a
removal runs only after every save queued before it has been published, and is skipped (the older checkpoint is
kept) once a save has failed. A failure is raised on the trainer's thread at its next ``check`` or ``wait``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from lightning_smartinf.checkpoint.manifest import CheckpointError

log = logging.getLogger(__name__)


class BackgroundSaves:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smartinf-save")
        self._pending: list[tuple[str, Future[None]]] = []
        self._lock = threading.Lock()
        self._save_failed = False

    @property
    def busy(self) -> bool:
        return any(not future.done() for _, future in self._pending)

    def save(self, what: str, work: Callable[[], None]) -> None:
        """Queue a save (``what`` names it in a failure)."""

        def run() -> None:
            try:
                work()
            except BaseException:
                with self._lock:
                    self._save_failed = True
                raise

        self._pending.append((what, self._pool.submit(run)))

    def remove(self, what: str, work: Callable[[], None]) -> None:
        """Queue a removal; it runs once the saves before it are published, and not at all after a failed one."""

        def run() -> None:
            with self._lock:
                failed = self._save_failed
            if failed:
                log.warning("smart_infinity: %s kept, since a later checkpoint failed to save", what)
                return
            work()

        self._pending.append((what, self._pool.submit(run)))

    def check(self) -> None:
        """Raise the first failure among the finished work (then forget the finished work)."""
        finished = [(what, f) for what, f in self._pending if f.done()]
        self._pending = [(what, f) for what, f in self._pending if not f.done()]
        for what, future in finished:
            error = future.exception()
            if error is not None:
                raise CheckpointError(f"the background {what} failed: {error}") from error

    def wait(self) -> None:
        """Until every queued save and removal has finished; raises the first failure."""
        for _, future in list(self._pending):
            future.exception()  # waits; the failure is raised by check
        self.check()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
