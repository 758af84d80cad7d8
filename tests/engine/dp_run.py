"""A data-parallel training run for the partition tests (run as a script: Lightning re-runs it for each rank).

    python dp_run.py OUT --devices 2 --batch 4 --schedule vertical --update smart

Writes OUT/masters.pt (every parameter's fp32 master, gathered from all ranks, by rank 0) and OUT/rank{r}.json
(the bytes of the rank's state files, its traffic counters and the threads that ran its streamed blocks'
all-gathers during fit). ``--die-rank R`` makes rank R exit hard in the middle of step 3's backward; ``--save``
checkpoints every 2 steps into OUT/ckpts, ``--resume`` continues from the newest there (or from ``--resume-from``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.checkpoint import latest_checkpoint
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.engine.meta import meta_parameters
from lightning_smartinf.engine.partition import Partition
from lightning_smartinf.models.gpt import GPTConfig, GPTModule

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
SAMPLES = 32


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="horizontal")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--budget", default=None, help="offload.host_memory_budget (0: every state file on disk)")
    parser.add_argument("--state-precision", default="fp32", help="offload.state_precision")
    parser.add_argument("--overlap", type=float, default=0.0)
    parser.add_argument("--eager", action="store_true", help="schedule.eager_update")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--topk", type=float, default=None, help="compression=topk with this keep (smart update)")
    parser.add_argument("--update", default="host")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--width", type=int, default=TINY.n_embd)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from", type=Path, default=None, help="a checkpoint to resume from")
    parser.add_argument("--meta", action="store_true", help="build the model on meta (initialized at set-up)")
    return parser.parse_args(argv)


def arm_death(rank: int) -> None:
    """Exit hard (no clean-up, as a killed or crashed process) in step 3's backward."""
    original = GradientAccumulator.add_block
    calls = {"n": 0}

    def add_block(self: GradientAccumulator, *args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2 * TINY.n_layer + 1:
            os._exit(3)
        original(self, *args)

    GradientAccumulator.add_block = add_block  # type: ignore[method-assign]


class WatchGathers(Callback):
    """Note which threads run the streamed blocks' all-gathers during fit (the streamer's own, to overlap the
    compute; the resident block's follow the step and the hand-back's gather masters, on the training thread)."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.fitting = False
        original = Partition.gather_block

        def gather_block(partition: Partition, flat: torch.Tensor, block: Any, *args: Any) -> None:
            if self.fitting and block is not partition.layout.resident:
                self.threads.add(threading.current_thread().name.rsplit("_", 1)[0])
            original(partition, flat, block, *args)

        Partition.gather_block = gather_block  # type: ignore[method-assign]

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.fitting = True

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.fitting = False


def run(args: argparse.Namespace, gathers: WatchGathers) -> SmartInfinityStrategy:
    torch.manual_seed(0)
    with meta_parameters() if args.meta else contextlib.nullcontext():
        module = GPTModule(replace(TINY, n_embd=args.width), optimizer=args.optimizer, lr=1e-2)
    data = torch.randint(0, 256, (SAMPLES, TINY.block_size + 1), generator=torch.Generator().manual_seed(1))
    update: dict[str, Any] = {"backend": args.update, "host_adam": "torch"}
    offload: dict[str, Any] = {"nvme_path": str(args.out / "state"), "subgroup_size": 4096, "io_backend": "threads"}
    if args.budget is not None:
        offload["host_memory_budget"] = args.budget
    offload["state_precision"] = args.state_precision
    if args.update == "smart":
        update["devices"] = 2
    compression = {"kind": "topk", "keep": args.topk} if args.topk else None
    schedule = {"kind": args.schedule, "overlap": args.overlap, "eager_update": args.eager}
    if args.schedule == "vertical":
        schedule["micro_batches"] = args.micro_batches
    strategy = SmartInfinityStrategy(
        offload={**offload, "grads": "cpu"} if args.topk else offload,
        update=update, schedule=schedule, compression=compression, timeout=args.timeout,
    )  # fmt: skip
    ckpts = args.out / "ckpts"
    saving = [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=-1)] if args.save else []
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False,
        callbacks=[*saving, gathers], enable_checkpointing=args.save, accumulate_grad_batches=args.accumulate,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, gradient_clip_val=args.clip,
        precision=args.precision,
    )  # fmt: skip
    if args.die_rank is not None and trainer.global_rank == args.die_rank:
        arm_death(args.die_rank)
    # in order, rank r taking samples r, r + world, ...: one step's batches together are the 1-process batch
    sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)  # type: ignore[arg-type]
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)  # type: ignore[arg-type]
    trainer.fit(module, loader, ckpt_path=args.resume_from or (latest_checkpoint(ckpts) if args.resume else None))
    return strategy


def report(args: argparse.Namespace, strategy: SmartInfinityStrategy, gathers: WatchGathers) -> None:
    engine = strategy.engine
    assert engine is not None
    masters = strategy.consolidated_state_dict()  # a collective: every rank takes part
    files = [p for p in engine.root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    plan = dataclasses.asdict(strategy.plan) if strategy.plan else None
    record = {"disk_bytes": sum(p.stat().st_size for p in files), "traffic": engine.counters.table(), "plan": plan,
              "gather_threads": sorted(gathers.threads)}  # fmt: skip
    (args.out / f"rank{strategy.global_rank}.json").write_text(json.dumps(record))
    if strategy.global_rank == 0:
        torch.save(masters, args.out / "masters.pt")
    strategy.close()


if __name__ == "__main__":
    arguments = parse()
    arguments.out.mkdir(parents=True, exist_ok=True)
    watch = WatchGathers()
    report(arguments, run(arguments, watch), watch)
