"""Rank arithmetic and collectives shared by the Trainer's strategy and Fabric's: one process per device over
``num_nodes`` nodes, DDP's collectives, and a process group only where there is more than one rank.

Lightning's two ``ParallelStrategy`` classes (``lightning.pytorch`` and ``lightning.fabric``) have the same
attributes but no common base, so this is a mixin placed before either of them.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_smartinf.lightning.internals import (
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
)


class _Parallel(Protocol):
    """What the mixin reads from the ParallelStrategy it is mixed into."""

    _num_nodes: int
    _process_group_backend: str | None
    _timeout: timedelta

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...
    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...


def _destroy_process_group() -> None:
    """At exit, before the interpreter tears down: a gloo process group left alive ends the process in
    std::terminate ("terminate called without an active exception") when its threads are destroyed unjoined."""
    if dist.is_initialized():
        dist.destroy_process_group()


class Ranks:
    """Devices, ranks and collectives of a strategy with one process per device (see the module docstring)."""

    def _init_ranks(self: Any, process_group_backend: str | None, timeout: float | timedelta) -> None:
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)

    @property
    def root_device(self: _Parallel) -> torch.device:
        return self.parallel_devices[self.local_rank] if self.parallel_devices else torch.device("cpu")

    @property
    def num_nodes(self: _Parallel) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self: _Parallel, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self: _Parallel) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self: _Parallel) -> bool:
        """More than one rank: Lightning then gives each rank its share of the data (a DistributedSampler)."""
        return self.num_nodes * self.num_processes > 1

    @property
    def distributed_sampler_kwargs(self: _Parallel) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self: _Parallel) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def join_process_group(self: _Parallel) -> None:
        """With more than one rank: set the ranks and join the process group (once per process)."""
        if self.num_nodes * self.num_processes > 1 and not distributed_is_initialized():
            Ranks.set_world_ranks(self)
            backend = self._process_group_backend or default_process_group_backend(self.root_device)
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
            atexit.register(_destroy_process_group)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]
