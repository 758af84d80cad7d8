"""The overlapped step's thread and compute share a CPU's cores: the step's math runs on one intra-op thread, a
count that timing never changes (so runs stay bit-exact), and threads started after the step get compute's count."""

from __future__ import annotations

import threading

import torch

from lightning_smartinf.engine.overlap import OverlappedStep


def counts_in(step: OverlappedStep) -> tuple[list[int], list[int]]:
    """(the step thread's intra-op threads, those of a thread started after the step)."""
    inside: list[int] = []
    step.start(lambda: inside.append(torch.get_num_threads()))
    step.join()
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return inside, later


def test_on_a_cpu_device_the_step_runs_on_one_thread_and_compute_keeps_its_own() -> None:
    compute = torch.get_num_threads()
    inside, later = counts_in(OverlappedStep(1, shares_cores=True))
    assert inside == [1] and later == [compute]
    assert torch.get_num_threads() == compute


def test_off_a_cpu_device_the_step_keeps_torchs_count() -> None:
    inside, _ = counts_in(OverlappedStep(1))
    assert inside == [torch.get_num_threads()]
