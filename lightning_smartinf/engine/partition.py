"""The collectives of partitioned data parallelism, in the few shapes the engine needs, and their failures.

Every rank owns one chunk of each block (``Layout.chunk``). Forward and backward all-gather a block's 16-bit
chunks into the whole block; backward reduce-scatters a block's gradient so each rank keeps the average of its
chunk; the step all-reduces the squared gradient norm. All of them run on the trainer's thread, in the order the
schedule visits blocks, which is the same on every rank; the parameter streamer's all-gathers run on a thread of
their own, on a process group of their own, in the order the schedule asks for blocks, so they overlap the block
computing meanwhile. With one rank every call is a no-op.

A collective that fails (a peer process died: the connection closes; a peer hangs: the process group's timeout)
raises ``PeerLostError`` naming this rank, the operation and the block, instead of gloo's bare socket message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_smartinf.core import Block, Layout
from lightning_smartinf.errors import SmartInfError

T = TypeVar("T")


class PeerLostError(SmartInfError, RuntimeError):
    """Another rank stopped taking part in the collectives (died, was killed, or hangs)."""


class Partition:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.rank = layout.rank
        self.world = layout.world

    def _run(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except RuntimeError as err:  # gloo reports a closed peer as a plain RuntimeError; the original is kept
            raise PeerLostError(
                f"rank {self.rank} of {self.world}: {what} failed, most likely because another rank died or stopped "
                f"responding ({err}). "
                "The first error in the other ranks' output says why; resume from the last checkpoint"
            ) from err

    def gather_block(self, flat: torch.Tensor, block: Block, group: Any = None) -> None:
        """Fill ``flat`` (the whole block's buffer, this rank's chunk already in place) with every rank's chunk;
        ``group``: the process group to gather on (the parameter streamer's own, from its gather thread)."""
        if self.world == 1:
            return
        lo, hi = self.layout.chunk(block)
        mine = flat[lo:hi].clone()
        self._run(f"all-gather of block {block.name!r}",
                  lambda: dist.all_gather_single(flat[: block.numel], mine, group=group))  # fmt: skip

    def reduce_block(self, flat: torch.Tensor, block: Block) -> None:
        """Average ``flat`` (a whole block's fp32 gradient) over the ranks, into this rank's chunk only."""
        if self.world == 1:
            return
        lo, hi = self.layout.chunk(block)
        out = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
        whole = flat[: block.numel]
        self._run(
            f"reduce-scatter of the gradient of block {block.name!r}", lambda: dist.reduce_scatter_single(out, whole)
        )
        flat[lo:hi].copy_(out.div_(self.world))

    def global_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The L2 norm over every rank's gradients from this rank's L2 norm (inf/nan if any rank's is)."""
        if self.world == 1:
            return local
        squared = local.double().square().reshape(1)
        self._run("all-reduce of the gradient norm", lambda: dist.all_reduce(squared))
        return squared.sqrt().float().reshape(())
