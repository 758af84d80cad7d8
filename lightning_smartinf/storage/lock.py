"""One run per state directory: an exclusive ``flock`` on ``DIR/.smartinf.lock``.

Two runs rewriting the same state files would corrupt each other silently. The kernel drops a ``flock`` when its
holder dies, however it dies, so a lock file left by a killed run is never mistaken for a live one: the next run
takes it over and says so. The file records who holds it (pid, host, start time, command) for the error a second
run gets.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from lightning_smartinf.errors import SetupError

log = logging.getLogger(__name__)
LOCK_NAME = ".smartinf.lock"


class StateDirectoryBusyError(SetupError):
    """Another live run holds the state directory."""


def _describe(holder: dict[str, object]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))  # type: ignore[arg-type]
    return f"process {holder.get('pid')} on {holder.get('host')} (started {started}: {holder.get('command', '?')})"


class StateLock:
    """Held from ``acquire`` to ``release`` (or the process's death) by one run; ``key`` is the config key that
    named the directory, for the error message."""

    def __init__(self, directory: Path, key: str) -> None:
        self.path = directory / LOCK_NAME
        self.key = key
        self._fd: int | None = None

    def _holder(self, fd: int) -> dict[str, object]:
        try:
            raw = os.pread(fd, 4096, 0)
            return dict(json.loads(raw)) if raw.strip() else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            where = f"{self.key}={str(self.path.parent)!r}"
            if holder.get("pid") == os.getpid():
                message = (
                    f"{where} is in use by another smart_infinity engine in this process: call close() on the "
                    f"earlier SmartInfinityStrategy first, or give this one its own {self.key}"
                )
            else:
                message = (
                    f"{where} is in use by {_describe(holder)}; two runs on one state directory would overwrite "
                    f"each other's state: wait for that run to end, or give this run its own {self.key}"
                )
            raise StateDirectoryBusyError(message) from None
        previous = self._holder(fd)
        if previous:  # the kernel released its flock, so that process is gone
            log.warning("%s: took over the lock left by %s, which is no longer running", self.path, _describe(previous))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Empty the file (a clean exit leaves no holder to report) and drop the lock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
