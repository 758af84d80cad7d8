"""The process plumbing of a data-parallel strategy: one process per device, started and joined as DDP does.

Not Lightning's ``DDPStrategy`` itself: that one always starts a process group (also for one process), wraps the
model in ``DistributedDataParallel`` and moves the whole module to the device, none of which fits a model whose
parameters live in storage. What is kept is DDP's launcher, rank arithmetic and collectives, and a process group
only where there is more than one rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from lightning_smartinf.lightning.internals import SubprocessLauncher, all_gather_ddp, sync_ddp
from lightning_smartinf.lightning.ranks import Ranks


class ProcessStrategy(Ranks, ParallelStrategy):
    """One process per device over ``num_nodes`` nodes (or as torchrun / SLURM started them), with DDP's
    collectives; a single process runs without a process group."""

    def __init__(self, process_group_backend: str | None = None, timeout: float | timedelta = 1800.0,
                 **devices: Any) -> None:  # fmt: skip
        """``devices``: ParallelStrategy's accelerator, parallel_devices, cluster_environment, precision_plugin."""
        super().__init__(**devices)
        self._init_ranks(process_group_backend, timeout)

    @override
    def _configure_launcher(self) -> None:
        """One process per device, started the way DDP starts them (or by torchrun / SLURM, which Lightning's
        cluster environments detect)."""
        if self.is_distributed:
            assert self.cluster_environment is not None
            self._launcher = SubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.join_process_group()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return all_gather_ddp(tensor, group=group, sync_grads=sync_grads)

    def _sync_initial_weights(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP does), whatever each seeded."""
        assert self.model is not None
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if not tensor.is_meta:  # meta ones get values block by block in the engine, rank 0's on every rank
                dist.broadcast(tensor.data, 0)
