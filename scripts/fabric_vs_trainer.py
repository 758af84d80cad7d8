"""The same GPT workload through the Trainer strategy and the Fabric strategy (docs/fabric.md): one engine behind
two front doors, so tokens/s should agree within noise. Each run in its own process, alternating (T F T F).

    python scripts/fabric_vs_trainer.py WORKDIR [--recipe gpt_125m --seq 256 --batch 4 --steps 4 --reps 2]

Both run the horizontal order with the step behind the next forward (overlap 1.0), bf16-mixed, AdamW, clipping at
1.0, state under WORKDIR; the time is the median of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCHEDULE = {"kind": "horizontal", "overlap": 1.0}


def model_config(recipe: str, seq: int) -> Any:
    from omegaconf import OmegaConf

    from lightning_smartinf.models.gpt import GPTConfig
    from lightning_smartinf.resources import asset_dir

    model = dict(OmegaConf.to_container(OmegaConf.load(asset_dir("recipes") / f"{recipe}.yaml"))["model"])  # type: ignore[index]
    return GPTConfig(**{**model, "block_size": max(seq, int(model.get("block_size", seq)))})


def data(config: Any, args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (args.batch * (args.steps + 1), args.seq + 1),
                         generator=torch.Generator().manual_seed(0))  # fmt: skip


def run_trainer(args: argparse.Namespace, state: Path) -> list[float]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
    from lightning_smartinf.models.gpt import GPTModule

    config = model_config(args.recipe, args.seq)
    stamps: list[float] = []

    class Stamps(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            stamps.append(time.perf_counter())

    torch.manual_seed(0)
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(state)}, schedule=SCHEDULE)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed",
                         max_steps=args.steps + 1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Stamps()])  # fmt: skip
    trainer.fit(GPTModule(config, lr=1e-4), DataLoader(data(config, args), batch_size=args.batch))  # type: ignore[arg-type]
    strategy.close()
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def run_fabric(args: argparse.Namespace, state: Path) -> list[float]:
    import lightning as L
    import torch.nn.functional as F

    from lightning_smartinf.lightning.fabric import SmartInfinityFabricStrategy
    from lightning_smartinf.models.gpt import GPT
    from lightning_smartinf.models.optim import configure

    config = model_config(args.recipe, args.seq)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed",
                      strategy=SmartInfinityFabricStrategy(offload={"nvme_path": str(state)}, schedule=SCHEDULE))
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = configure(model.parameters(), "adamw", 1e-4, (0.9, 0.95), 0.1, 0)
    model, optimizer = fabric.setup(model, optimizer)
    stamps = []
    for batch in data(config, args).split(args.batch):
        logits = model(batch[:, :-1])
        fabric.backward(F.cross_entropy(logits.float().reshape(-1, config.vocab_size), batch[:, 1:].reshape(-1)))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    fabric.strategy.close()  # type: ignore[attr-defined]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--recipe", default="gpt_125m")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--one", choices=("trainer", "fabric"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run = run_trainer if args.one == "trainer" else run_fabric
        steps = run(args, args.work / f"state_{args.one}")
        print(json.dumps(steps))
        return
    results: dict[str, list[float]] = {"trainer": [], "fabric": []}
    for _ in range(args.reps):
        for door in results:
            done = subprocess.run([sys.executable, __file__, str(args.work), "--one", door, "--recipe", args.recipe,
                                   "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=True)  # fmt: skip
            seconds = statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))
            results[door].append(seconds)
            print(f"{door}: {seconds:.2f} s/step, {args.batch * args.seq / seconds:.0f} tokens/s", flush=True)
    for door, times in results.items():
        median = statistics.median(times)
        print(f"{door}: median {median:.2f} s/step ({args.batch * args.seq / median:.0f} tokens/s) over {times}")


if __name__ == "__main__":
    main()
