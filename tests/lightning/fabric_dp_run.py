"""A data-parallel Fabric run on 2 CPU processes (run as a script: Fabric's launcher re-runs it for each rank).

    python fabric_dp_run.py OUT smart|ddp

Trains the tiny GPT 4 steps (each rank its half of every batch, clipping at 0.5) and writes OUT/masters.pt, every
parameter's fp32 value by name, from rank 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_smartinf.lightning.fabric import SmartInfinityFabricStrategy
from lightning_smartinf.models.gpt import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)


def main(out: Path, kind: str) -> None:
    offload = {"nvme_path": str(out / "state_{rank}"), "subgroup_size": 4096, "io_backend": "threads"}
    strategy = SmartInfinityFabricStrategy(offload=offload, update={"host_adam": "torch"}) if kind == "smart" else kind
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.randint(0, 256, (32, 17), generator=torch.Generator().manual_seed(0))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=False))  # type: ignore[arg-type]
    for step, batch in enumerate(loader):
        if step == 4:
            break
        logits = model(batch[:, :-1])
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    if kind == "smart":
        masters = fabric.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    else:
        masters = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    if fabric.global_rank == 0:
        torch.save(masters, out / "masters.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
