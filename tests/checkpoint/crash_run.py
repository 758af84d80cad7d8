"""A training run that SIGKILLs itself at a chosen point, for the crash tests (run as a subprocess).

    python crash_run.py OUT --kill step          # train, checkpointing every epoch; die in the middle of step 6
    python crash_run.py OUT --resume             # resume from OUT/ckpts' newest complete checkpoint, finish

Either way a finished run writes OUT/final.pt: every parameter's fp32 master. The kill points patch the product at
its seams (test-only): the training step, the gradient store, the master-state writes, the checkpoint copies and
the checkpoint publication.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.checkpoint import latest_checkpoint, manifest
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.models.gpt import GPTConfig, GPTModule
from lightning_smartinf.storage.store import FileStore

STEPS, KILL_STEP = 8, 6  # two batches per epoch: checkpoints at steps 2, 4, 6, 8


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, strategy: SmartInfinityStrategy) -> None:
    """Patch the seam where ``point`` happens so the process dies there during step KILL_STEP (or its save)."""
    seen = {"n": 0}

    def engine_steps() -> int:
        return strategy.engine.step_count if strategy.engine else 0

    if point == "backward":
        original_add = GradientAccumulator.add_block

        def add_block(self: GradientAccumulator, *args: Any) -> None:
            original_add(self, *args)
            if engine_steps() == KILL_STEP - 1:
                die()

        GradientAccumulator.add_block = add_block  # type: ignore[method-assign]
    elif point == "step":  # some subgroups' master files already rewritten, the rest not
        original_write = FileStore.write

        def write(self: FileStore, kind: str, *args: Any) -> Any:
            if kind == "master" and engine_steps() == KILL_STEP:
                seen["n"] += 1
                if seen["n"] == 3:
                    future = original_write(self, kind, *args)
                    future.result()
                    die()
            return original_write(self, kind, *args)

        FileStore.write = write  # type: ignore[method-assign]
    elif point == "checkpoint":  # the save at step KILL_STEP (in the background) dies after copying three files
        original_copy = manifest.copy_file

        def copy_file(source: Path, target: Path, *args: Any) -> Any:
            if f"step={KILL_STEP}.ckpt" in str(target):
                seen["n"] += 1
                if seen["n"] == 3:
                    die()
            return original_copy(source, target, *args)

        manifest.copy_file = copy_file
    elif point == "publish":  # last.ckpt is being replaced: old renamed away, new not yet renamed in
        original_rename = os.rename

        def rename(source: Any, target: Any) -> None:
            original_rename(source, target)
            if ".replaced-" in str(target):  # last.ckpt is replaced by the saves at steps 4 and 6
                seen["n"] += 1
                if seen["n"] == KILL_STEP // 2 - 1:
                    die()

        manifest.os.rename = rename  # type: ignore[attr-defined]
    elif point != "none":
        raise SystemExit(f"unknown kill point {point}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", default="none")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--update", default="host")
    parser.add_argument("--schedule", default="horizontal")
    parser.add_argument("--compression", default="none")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = GPTModule(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16), lr=1e-2)
    data = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    schedule = {"kind": args.schedule, "micro_batches": 2, "overlap": 0.5} if args.schedule == "vertical" else None
    compression = (
        {"kind": "topk", "keep": 0.1, "block": 256, "error_feedback": True} if args.compression == "topk" else None
    )
    grads = "cpu" if compression else "nvme"  # top-k selects from the accumulated gradient in host memory
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": str(args.out / "state"), "subgroup_size": 4096, "io_backend": "threads", "grads": grads,
                 "host_memory_budget": "0"},
        update={"backend": args.update, "host_adam": "torch", "devices": 2}, schedule=schedule, compression=compression,
    )  # fmt: skip
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpts", every_n_train_steps=2, save_top_k=-1, save_last=True,
                                  save_on_train_epoch_end=False)  # fmt: skip
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, precision="32-true",
                         logger=False, callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)  # fmt: skip
    arm(args.kill, strategy)
    resume = latest_checkpoint(args.out / "ckpts") if args.resume else None
    print(f"resuming from {resume}" if resume else "starting fresh", flush=True)
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=resume)  # type: ignore[arg-type]
    torch.save(strategy.consolidated_state_dict(), args.out / "final.pt")
    strategy.close()


if __name__ == "__main__":
    main()
