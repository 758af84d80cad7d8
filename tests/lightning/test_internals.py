"""Lightning's batch counters re-counted for another accumulation, the private names the strategies reach (only
through lightning/internals.py), and the Lightning versions they were checked on."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import lightning

from lightning_smartinf.lightning import internals


def saved(ready: int, lag: int, world: int, accumulate: int) -> dict:
    """A trainer state as Lightning saves it on a train batch's end: 'completed' lags 'ready' by ``lag``."""
    counters = {"ready": ready, "started": ready, "processed": ready, "completed": ready - lag}
    progress = {"total": dict(counters), "current": dict(counters), "is_last_batch": False}
    return {"loops": {"fit_loop": {internals.PROGRESS: progress}},
            internals.ELASTIC: internals.batching(world, accumulate)}  # fmt: skip


def test_two_ranks_to_one_accumulating_two_counts_two_batches_per_step() -> None:
    state = saved(ready=4, lag=1, world=2, accumulate=1)
    internals.recount(state, world=1, accumulate=2)
    for scope in ("total", "current"):
        counters = state["loops"]["fit_loop"][internals.PROGRESS][scope]
        assert counters == {"ready": 8, "started": 8, "processed": 8, "completed": 7}  # the lag Lightning reads kept


def test_one_rank_to_two_and_an_unchanged_count_and_an_older_checkpoint() -> None:
    state = saved(ready=6, lag=1, world=1, accumulate=2)
    internals.recount(state, world=2, accumulate=1)
    assert state["loops"]["fit_loop"][internals.PROGRESS]["current"]["ready"] == 3
    same = saved(ready=6, lag=1, world=2, accumulate=2)
    before = copy.deepcopy(same)
    internals.recount(same, world=1, accumulate=2)
    assert same == before
    older = saved(ready=6, lag=1, world=2, accumulate=1)
    del older[internals.ELASTIC]
    before = copy.deepcopy(older)
    internals.recount(older, world=1, accumulate=2)
    assert older == before


def test_the_installed_lightning_is_one_the_keys_were_checked_on() -> None:
    """A Lightning release outside ``CHECKED`` may rename the loop's keys: check them (this file and
    tests/engine/test_partition.py's elastic resumes) and add the release."""
    assert lightning.__version__.startswith(internals.CHECKED), lightning.__version__


def test_the_private_names_it_reaches_are_there() -> None:
    """The fit loop's accumulation test and ModelCheckpoint's last saved step (``accumulating``, ``mark_saved``),
    read and set as the adapter does."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(every_n_train_steps=2)
    trainer = Trainer(accelerator="cpu", accumulate_grad_batches=2, callbacks=[checkpoint], logger=False,
                      enable_progress_bar=False)  # fmt: skip
    assert checkpoint._last_global_step_saved == 0
    trainer.fit_loop.epoch_loop.batch_progress.increment_ready()
    assert internals.accumulating(trainer)  # the first of two batches
    trainer.fit_loop.epoch_loop.batch_progress.increment_ready()
    assert not internals.accumulating(trainer)
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 6
    assert trainer.global_step == 6
    internals.mark_saved(trainer)
    assert checkpoint._last_global_step_saved == 6


def test_no_other_module_imports_a_private_lightning_name() -> None:
    """The adapter is the one place: anywhere else in the package, ``from lightning... import _name`` fails this."""
    package = Path(internals.__file__).parents[1]
    found = []
    for path in package.rglob("*.py"):
        if path == Path(internals.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
                found += [f"{path.relative_to(package)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found
