"""The process plumbing of a data-parallel strategy: one process per device, started and joined as DDP does.

Not Lightning's ``DDPStrategy`` itself: that one always starts a process group (also for one process), wraps the
model in ``DistributedDataParallel`` and moves the whole module to the device, none of which fits a model whose
parameters live in storage. What is kept is DDP's launcher, rank arithmetic and collectives, and a process group
only where there is more than one rank.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from typing_extensions import override


def _destroy_process_group() -> None:
    """At exit, before the interpreter tears down: a gloo process group left alive ends the process in
    std::terminate ("terminate called without an active exception") when its threads are destroyed unjoined."""
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessStrategy(ParallelStrategy):
    """One process per device over ``num_nodes`` nodes (or as torchrun / SLURM started them), with DDP's
    collectives; a single process runs without a process group."""

    def __init__(self, process_group_backend: str | None = None, timeout: float | timedelta = 1800.0,
                 **devices: Any) -> None:  # fmt: skip
        """``devices``: ParallelStrategy's accelerator, parallel_devices, cluster_environment, precision_plugin."""
        super().__init__(**devices)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)

    # -- devices -----------------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank] if self.parallel_devices else torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """More than one rank: Lightning then gives each rank its share of the data (a DistributedSampler)."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        """One process per device, started the way DDP starts them (or by torchrun / SLURM, which Lightning's
        cluster environments detect)."""
        if self.is_distributed:
            assert self.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed and not _distributed_is_initialized():
            self.set_world_ranks()
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
            atexit.register(_destroy_process_group)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]  # type: ignore[no-any-return]

    def _sync_initial_weights(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP does), whatever each seeded."""
        assert self.model is not None
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if not tensor.is_meta:  # meta ones get values block by block in the engine, rank 0's on every rank
                dist.broadcast(tensor.data, 0)
