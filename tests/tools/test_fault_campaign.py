"""smartinf-faults' verdicts: what a training run's log says of each injected fault."""

from __future__ import annotations

from pathlib import Path

from smartinf_tools.faults import Fault, RunRecord, outcome, table

MOUNT = Path("/runs/mount")
RETRY = ("[WARNING] - smart_infinity: reading /runs/mount/state/master/sg000003 failed (...: the bytes read differ "
         "from those written in this run ...); retrying once")  # fmt: skip
ERROR = ("smartinf-train: error: reading 8192 bytes of master sg000003 from /runs/mount/state/master/sg000003: the "
         "bytes read differ from those written in this run")  # fmt: skip


def fault(path: str = "state/master/sg000003") -> Fault:
    return Fault("aio", "bad_read", path, 0)


def test_a_retry_that_succeeded_is_retried() -> None:
    assert outcome(fault(), RETRY, MOUNT, failed=False, exact=True) == "retried"


def test_the_error_that_stopped_the_run_wins_over_its_retry_warning() -> None:
    assert outcome(fault(), f"{RETRY}\n{ERROR}", MOUNT, failed=True, exact=True) == "error"


def test_a_fault_nobody_named_is_harmless_only_if_the_weights_are_exact() -> None:
    other = fault("state/exp_avg/sg000001")
    assert outcome(other, f"{RETRY}\n{ERROR}", MOUNT, failed=True, exact=True) == "harmless"
    assert outcome(other, RETRY, MOUNT, failed=False, exact=False) == "silent"


def test_the_table_counts_faults_by_backend_kind_and_outcome() -> None:
    records = [RunRecord("aio", "bad_read", 0, 0, None, True, [Fault("aio", "bad_read", "p", 0, "retried")]),
               RunRecord("threads", "write_eio", 0, 1, 5, True, [Fault("threads", "write_eio", "q", 0, "error")])]
    text = table(records)
    assert "| aio | bad_read | 1 | 1 | 0 | 0 | 0 |" in text
    assert "| threads | write_eio | 1 | 0 | 1 | 0 | 0 |" in text
    assert "2 runs: 1 finished through their faults, 1 stopped on an error" in text and "2/2 bit-exact" in text
