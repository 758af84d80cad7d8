"""The overlapped step's thread and compute share a CPU's cores: the step's math narrows to one intra-op thread while
the trainer computes, and widens to compute's while the trainer waits for it."""

from __future__ import annotations

import threading

import torch

from lightning_smartinf.engine.overlap import OverlappedStep


def test_the_step_narrows_while_the_trainer_computes_and_widens_while_it_waits() -> None:
    compute = torch.get_num_threads()
    step = OverlappedStep(2, shares_cores=True)
    step.stale(1)
    seen: dict[str, int] = {}
    computing, waited = threading.Event(), threading.Event()

    def run() -> None:
        step.pace()
        seen["beside compute"] = torch.get_num_threads()
        computing.set()
        while not step._waiting:  # the trainer below starts waiting for block 1
            threading.Event().wait(0.001)
        step.pace()
        seen["while the trainer waits"] = torch.get_num_threads()
        step.published(1)
        waited.wait()

    step.start(run)
    computing.wait()
    step.wait_block(1)
    waited.set()
    step.join()
    assert seen == {"beside compute": 1, "while the trainer waits": compute}
    assert torch.get_num_threads() == compute  # the trainer's own count never changed
    counts: list[int] = []
    later = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert counts == [compute]  # and a thread started after the step gets compute's count again


def test_off_a_cpu_device_the_step_keeps_torchs_count() -> None:
    step = OverlappedStep(1)
    counts: list[int] = []
    step.start(lambda: (step.pace(), counts.append(torch.get_num_threads())))
    step.join()
    assert counts == [torch.get_num_threads()]
