"""Every private Lightning name the strategies use, in one place, checked on the Lightning releases in ``CHECKED``.

Lightning's public API leaves out a few things a storage-offload strategy needs: DDP's launcher and collectives
(reused rather than copied), the fit loop's own test for "this batch ends without an optimizer step", a
``ModelCheckpoint``'s last saved step, and the keys of the loop's saved counters. They are reached here and nowhere
else (tests/lightning/test_internals.py reads and sets each as this module does), so a Lightning release that
renames one breaks one file and one test.

**The loop counters.** Lightning's saved loop counters are re-counted for a resume with another number of batches
per optimizer step.

A checkpoint written by N ranks with ``accumulate_grad_batches=a`` and resumed by M ranks with ``b`` (the same
global batch: the elastic case) must resume at the same optimizer step and the same sample. The step counters and
the data loader's position (kept in samples, data/corpus.py) carry over as they are; the training epoch loop's batch
counters count this rank's batches, ``a`` per step, and decide where accumulation ends and where the epoch ends, so
they are re-counted to ``b`` per step. The keys are Lightning's own (checked on the versions in ``CHECKED``).

A resumed run's ``ModelCheckpoint`` callbacks are also told that the step it resumed at is saved (``mark_saved``),
and ``accumulating`` asks the fit loop whether a batch ends without an optimizer step.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessLauncher,
)
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available as all_gather_ddp,
)
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
)
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import (
    _init_dist_connection as init_dist_connection,
)
from lightning.fabric.utilities.distributed import (
    _sync_ddp_if_available as sync_ddp,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessLauncher

__all__ = [
    "FabricSubprocessLauncher", "SubprocessLauncher", "accumulating", "all_gather_ddp", "default_process_group_backend",
    "distributed_is_initialized", "init_dist_connection", "mark_saved", "recount", "sync_ddp",
]  # fmt: skip

log = logging.getLogger(__name__)

CHECKED = ("2.6",)
"""Lightning versions whose checkpoint keys this module was checked against (tests/lightning/test_internals.py)."""
ELASTIC = "smart_infinity"
"""The trainer-state key under which a save records how it counted batches."""
PROGRESS = "epoch_loop.batch_progress"


def batching(world: int, accumulate: int) -> dict[str, int]:
    """What a save records: the ranks and the batches each takes per optimizer step."""
    return {"world_size": world, "accumulate_grad_batches": accumulate}


def recount(checkpoint: dict[str, Any], world: int, accumulate: int) -> None:
    """Re-count ``checkpoint``'s batch counters (in place) for ``accumulate`` batches per optimizer step, where it was
    written with another count; log what changes. A checkpoint without the record (an older one) is left as it is."""
    saved = checkpoint.get(ELASTIC)
    if not saved or saved["accumulate_grad_batches"] == accumulate:
        return
    was = saved["accumulate_grad_batches"]
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get(PROGRESS)
    if progress is None:
        return
    for scope in ("total", "current"):
        # the counters lag one another by a batch where the save came mid-batch (Lightning reads its restart
        # point from those lags): 'ready' is re-counted and the lags kept
        counters = progress[scope]
        steps, partial = divmod(counters["ready"], was)
        shift = steps * accumulate + partial - counters["ready"]
        for name in counters:
            counters[name] += shift
    log.info(
        "smart_infinity: the checkpoint was written by %d rank(s) with accumulate_grad_batches=%d; this run has %d "
        "with %d: its batch counters are re-counted to %d per optimizer step",
        saved["world_size"], was, world, accumulate, accumulate,
    )  # fmt: skip


def mark_saved(trainer: Any) -> None:
    """Count the step a resumed run starts at as saved by its ``ModelCheckpoint`` callbacks. They forget their last
    saved step across a resume (``_last_global_step_saved`` is not in their state), and with
    ``accumulate_grad_batches`` > 1 the window's first batch ends at that step still: they would save it again
    there, in the middle of the window, and a resume from that checkpoint would skip the batch whose gradient it
    lost."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback._last_global_step_saved = trainer.global_step


def accumulating(trainer: Any) -> bool:
    """Whether the batch being trained ends without an optimizer step (``accumulate_grad_batches``), by Lightning's
    own test (the fit loop's ``_should_accumulate``)."""
    return bool(trainer.fit_loop._should_accumulate())
