"""One run per state directory: a live holder is named in the error, a dead one's lock is taken over."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fit, make_module

from lightning_smartinf.storage.lock import StateDirectoryBusyError, StateLock

HOLD = """
import sys, time
from pathlib import Path
from lightning_smartinf.storage.lock import StateLock
StateLock(Path(sys.argv[1]), "offload.nvme_path").acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path: Path, caplog) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirectoryBusyError, match=rf"offload.nvme_path=.* is in use by process {holder.pid}"):
            StateLock(tmp_path, "offload.nvme_path").acquire()
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    lock = StateLock(tmp_path, "offload.nvme_path")
    with caplog.at_level(logging.WARNING, logger="lightning_smartinf.storage.lock"):
        lock.acquire()
    assert f"took over the lock left by process {holder.pid}" in caplog.text
    lock.release()


def test_two_strategies_in_one_process_on_one_path(smart) -> None:
    first = smart()
    fit(make_module(), first, max_steps=1)
    with pytest.raises(StateDirectoryBusyError, match=r"call close\(\) on the earlier SmartInfinityStrategy"):
        fit(make_module(), smart(), max_steps=1)
    first.close()
    second = smart()
    fit(make_module(), second, max_steps=1)  # the path is free again
    second.close()
