"""How a step's subgroups go through the updater: at once, behind the next forward (``schedule.overlap``), or as
backward finishes each block (``schedule.eager_update``); each updated block is published for the next forward."""

from __future__ import annotations

import queue
from collections.abc import Iterable

from lightning_smartinf import trace
from lightning_smartinf.core import Layout, StepContext, Subgroup
from lightning_smartinf.engine.fence import StateFence
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.engine.overlap import OverlappedStep
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.update.base import Updater


class StepRunner:
    """Streams one step's subgroups through the updater and publishes each block as its last subgroup lands."""

    def __init__(self, layout: Layout, updater: Updater, params: ParamStreamer, grads: GradientAccumulator,
                 overlapped: OverlappedStep, fence: StateFence) -> None:  # fmt: skip
        self.layout, self.updater, self.params, self.grads = layout, updater, params, grads
        self.overlapped, self.fence = overlapped, fence
        self.eager: queue.Queue[Subgroup | None] | None = None
        """The open update stream of an eager step (None: no eager step running)."""

    def apply(self, ctx: StepContext, subgroups: Iterable[Subgroup] | None = None) -> None:
        """Stream subgroups (default: all, in forward order) through the updater, publishing each block when done."""
        left = {b.index: len(b.subgroups) for b in self.layout.blocks}
        order = self.fence.passing(self.layout.subgroups if subgroups is None else subgroups)
        for sg, master in self.updater.step(order, self.grads, ctx):
            self.params.store_update(sg, master)
            left[sg.block] -= 1
            if not left[sg.block]:
                self.params.flush()
                self.overlapped.published(sg.block)
            self.overlapped.advance(sg.numel)
        self.grads.reset()

    def start(self, ctx: StepContext, overlap: float) -> None:
        """Run the step on a thread; return once the resident block and (1 - ``overlap``) of the elements are
        done."""
        for block in self.layout.blocks:  # cleared here, before the caller can start the next forward
            if block.subgroups:
                self.overlapped.stale(block.index)
        self.overlapped.start(lambda: self.apply(ctx))
        self.wait(overlap)

    def wait(self, overlap: float) -> None:
        """Wait for the share of the step the next forward may not overlap, and for the resident block's update."""
        with trace.span("wait for the step's non-overlapped share", "update-wait"):
            self.overlapped.wait_share((1.0 - overlap) * self.layout.local_numel)
        with trace.span("wait for the resident update", "update-wait"):
            self.overlapped.wait_block(0)  # the resident layers run first and outside the block hooks
        self.params.gather_resident()

    def begin_eager(self, ctx: StepContext) -> None:
        """Open an update stream; blocks join it (``stream_block``) as backward finishes them, the resident block
        last."""
        self.eager = queue.Queue()
        stream = self.eager
        self.overlapped.start(lambda: self.apply(ctx, iter(stream.get, None)))

    def stream_block(self, index: int) -> None:
        """Backward has finished block ``index``: under an eager step, its subgroups join the update stream."""
        if self.eager is None:
            return
        block = self.layout.blocks[index]
        if block.subgroups:
            self.overlapped.stale(index)  # its parameters go stale until its update lands
        for sg in block.subgroups:
            self.eager.put(sg)
        if block.resident:  # backward is over: the stream is complete
            self.eager.put(None)
