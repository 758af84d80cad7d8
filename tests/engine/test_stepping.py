"""The step's streaming through the updater (engine/stepping.py) against plain Lightning, including its races."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import fit, make_module, relative_error

from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy


@pytest.mark.parametrize("update", [{"host_adam": "torch"}, {"backend": "smart", "devices": 2}])
def test_the_next_backward_waits_for_the_overlapped_step_to_let_go_of_the_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, update: dict[str, object]
) -> None:
    """The overlapped step forgets the gradients it consumed at its very end; the next iteration's backward, whose
    forward only waited for each block's update, must not add gradients before that (they would be forgotten).
    The step's thread is slowed at that point to make the race certain."""
    reset = GradientAccumulator.reset

    def slow_reset(self: GradientAccumulator) -> None:
        if threading.current_thread().name == "smartinf-step":
            time.sleep(0.3)
        reset(self)

    monkeypatch.setattr(GradientAccumulator, "reset", slow_reset)
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true", max_steps=4)
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path), "subgroup_size": 4096,
                                              "io_backend": "threads"}, update=update,
                                     schedule={"kind": "vertical", "overlap": 1.0})  # fmt: skip
    trainer = fit(make_module("adamw", lr=1e-3), strategy, precision="32-true", max_steps=4)
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5

