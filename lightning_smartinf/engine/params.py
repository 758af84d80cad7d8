"""Streams each block's 16-bit parameters from their store to the training device and back out of it.

A streamed block's parameters are empty tensors except while the block runs: ``fetch`` waits for (or starts) the
read of every subgroup of the block into one aligned buffer and points the parameters at views of it (on a CUDA
device, at a device copy); ``release`` empties them again. ``prefetch`` starts reads early when a buffer is free, so
at most ``prefetch + 2`` blocks occupy memory. The resident block lives on the device for the whole run.

Data parallel: each rank reads only its chunk of a block, and the block is whole once every rank's chunk is
all-gathered. A prefetch then hands the block to a gather thread (its own process group), which waits for the
block's update, reads the chunk and all-gathers it while the current block computes; the trainer's fetch only
collects the result. Collectives must be issued in the same order on every rank, so in this mode every prefetch
is taken (none skipped for a busy buffer or a running update: the thread waits for those instead), and the order
is the schedule's, which every rank shares.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lightning_smartinf import trace
from lightning_smartinf.core import PARAM, Block, Layout, Subgroup
from lightning_smartinf.engine.overlap import OverlappedStep
from lightning_smartinf.engine.partition import Partition
from lightning_smartinf.storage.aligned import Allocator, BufferPool, PageAligned, typed_view
from lightning_smartinf.storage.store import TensorStore


class ParamStreamer:
    def __init__(
        self,
        layout: Layout,
        store: TensorStore,
        dtype: torch.dtype,
        device: torch.device,
        prefetch: int,
        partition: Partition | None = None,
        allocator: Allocator | None = None,
        updates: OverlappedStep | None = None,
        gather_group: Any = None,
        kind: str = PARAM,
    ) -> None:
        self.layout = layout
        self.kind = kind
        """The store's name for these parameters: PARAM (trainable, rewritten after each step) or FROZEN (read only)."""
        self.partition = partition or Partition(layout)
        self.store = store
        self.dtype = dtype
        self.device = device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        if device.type == "cuda":  # CUDA-pinned for async copies to the device; DeepSpeed's aio takes it in place too
            allocator = PageAligned(pin=True)
        (blocks, block_bytes), (subgroups, subgroup_bytes) = self.pool_shapes(layout, self.itemsize, prefetch)
        self.pool = BufferPool(blocks, block_bytes, allocator)
        self.out_pool = BufferPool(subgroups, subgroup_bytes, allocator)
        self._loading: dict[int, tuple[torch.Tensor, list[Future[None]]]] = {}
        self._live: dict[int, torch.Tensor] = {}
        self._pending_writes: list[Future[None]] = []
        self.resident_flat = torch.zeros(layout.resident.numel, dtype=dtype, device=device)
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.updates = updates or OverlappedStep(len(layout.blocks))
        """Says which blocks a running step is still updating (their fetches wait for it)."""
        self._gather_group = gather_group
        self._gatherer = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="smartinf-gather")
                          if self.partition.world > 1 else None)  # fmt: skip
        self._gathering: dict[int, Future[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Data parallel: blocks on their way through the gather thread, as (whole block, the buffer to release)."""

    @staticmethod
    def pool_shapes(layout: Layout, itemsize: int, prefetch: int) -> list[tuple[int, int]]:
        """(buffers, bytes each) of its pools: blocks being read ahead, in use and released; subgroups on their way
        back to storage. Known before any is made (``host_memory_budget=auto`` counts them first)."""
        return [(prefetch + 2, layout.max_block_numel * itemsize), (3, layout.max_subgroup_numel * itemsize)]

    @property
    def host_bytes(self) -> int:
        return self.pool.total_bytes + self.out_pool.total_bytes

    # -- set-up -------------------------------------------------------------------------------------------------
    def initialize_block(self, block: Block) -> None:
        """Take ownership of one block's parameters (given values just before): the resident block's into the
        resident buffer, a streamed block's into the store, leaving the module's tensors empty."""
        if block.resident:
            for slot in block.slots:
                view = self.resident_flat[slot.offset : slot.offset + slot.numel]
                view.copy_(slot.param.data.reshape(-1))
                slot.param.data = view.view(slot.shape)
            return
        raw = self.pool.acquire(block.numel * self.itemsize)
        flat = typed_view(raw, self.dtype, block.numel)
        for slot in block.slots:
            flat[slot.offset : slot.offset + slot.numel].copy_(slot.param.data.reshape(-1))
            slot.param.data = self._empty
        writes = [self.store.write(self.kind, sg.key, self._sg_bytes(raw, sg), sg.numel * self.itemsize)
                  for sg in block.subgroups]  # fmt: skip
        for write in writes:
            write.result()
        self.pool.release(raw)

    def attach(self) -> None:
        """Point the module's parameters at the engine's copies: resident ones at views of the resident buffer,
        streamed ones at the empty tensor until their block is fetched."""
        for slot in self.layout.resident.slots:
            slot.param.data = self.resident_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        for block in self.layout.streamed:
            for slot in block.slots:
                slot.param.data = self._empty

    def _sg_bytes(self, raw: torch.Tensor, sg: Subgroup) -> torch.Tensor:
        return raw[sg.offset * self.itemsize :]

    # -- streaming ----------------------------------------------------------------------------------------------
    def prefetch(self, index: int) -> None:
        if index in self._loading or index in self._live or not 0 < index < len(self.layout.blocks):
            return
        if self._gatherer is not None:
            if index not in self._gathering:
                self._gathering[index] = self._gatherer.submit(self._read_and_gather, index)
            return
        if not self.updates.is_current(index):  # its update is still running: read it when it is needed
            return
        raw = self.pool.try_acquire()
        if raw is not None:
            self._start_read(self.layout.blocks[index], raw)

    def _start_read(self, block: Block, raw: torch.Tensor) -> None:
        self._loading[block.index] = (raw, self._read(block, raw))

    def _read(self, block: Block, raw: torch.Tensor) -> list[Future[None]]:
        return [self.store.read(self.kind, sg.key, self._sg_bytes(raw, sg), sg.numel * self.itemsize, urgent=True)
                for sg in block.subgroups]  # fmt: skip

    def fetch(self, index: int) -> None:
        """Materialise block ``index``'s parameters on the device (blocking until its reads are done)."""
        if index in self._live:
            return
        block = self.layout.blocks[index]
        if self._gatherer is not None:
            self.prefetch(index)
            flat, held = self._gathering.pop(index).result()
        else:
            with trace.span(f"wait for block {index}'s update", "update-wait"):
                self.updates.wait_block(index)  # an overlapped step may still be updating this block
            if index not in self._loading:
                self._start_read(block, self.pool.acquire(block.numel * self.itemsize))
            flat, held = self._collect(block, *self._loading.pop(index))
        for slot in block.slots:
            slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._live[index] = held

    def _collect(self, block: Block, raw: torch.Tensor, reads: list[Future[None]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for a block's reads; its tensor on the device, and what to hold until ``release``."""
        for read in reads:
            read.result()
        flat = typed_view(raw, self.dtype, block.numel)
        if self.device.type == "cpu":
            return flat, raw
        flat = flat.to(self.device)
        self.pool.release(raw)
        return flat, flat

    def _read_and_gather(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """On the gather thread: the block once updated, read (this rank's chunk) and all-gathered."""
        block = self.layout.blocks[index]
        self.updates.wait_block(index)
        raw = self.pool.acquire(block.numel * self.itemsize)
        flat, held = self._collect(block, raw, self._read(block, raw))
        with trace.span(f"all-gather {index}", "comm", block=index):
            self.partition.gather_block(flat, block, self._gather_group)
        return flat, held

    def read_block(self, index: int) -> torch.Tensor:
        """A copy of block ``index``'s parameters as its flat buffer (every rank's chunk gathered: a collective under
        data parallelism), leaving the module's parameters as they are (hand-back and export read this way)."""
        block = self.layout.blocks[index]
        raw = self.pool.acquire(block.numel * self.itemsize)
        try:
            for read in self._read(block, raw):
                read.result()
            flat = typed_view(raw, self.dtype, block.numel).clone()
        finally:
            self.pool.release(raw)
        self.partition.gather_block(flat, block)
        return flat

    def release(self, index: int) -> None:
        held = self._live.pop(index, None)
        if held is None:
            return
        for slot in self.layout.blocks[index].slots:
            slot.param.data = self._empty
        if self.device.type == "cpu":
            self.pool.release(held)

    def release_all(self) -> None:
        for index in list(self._live):
            self.release(index)
        gathering, self._gathering = list(self._gathering.values()), {}
        for future in gathering:  # every rank takes part in each gather it queued, used or not
            if future.exception() is None and self.device.type == "cpu":
                self.pool.release(future.result()[1])
        for raw, reads in list(self._loading.values()):
            for read in reads:
                read.result()
            self.pool.release(raw)
        self._loading.clear()

    def close(self) -> None:
        """Release every block, wait for parameter writes, then give the buffers back (the engine is closing)."""
        self.release_all()
        self.flush()
        if self._gatherer is not None:
            self._gatherer.shutdown(wait=True)
        self.pool.close()
        self.out_pool.close()

    # -- after the step -----------------------------------------------------------------------------------------
    def store_update(self, sg: Subgroup, master: torch.Tensor) -> None:
        """Publish a subgroup's new fp32 master as the 16-bit parameters the next forward pass reads."""
        block = self.layout.blocks[sg.block]
        if block.resident:
            self.resident_flat[sg.offset : sg.offset + sg.numel].copy_(master)
            return
        raw = self.out_pool.acquire(sg.numel * self.itemsize)
        typed_view(raw, self.dtype, sg.numel).copy_(master)
        write = self.store.write(PARAM, sg.key, raw, sg.numel * self.itemsize)
        write.add_done_callback(lambda _f: self.out_pool.release(raw))
        self._pending_writes.append(write)

    def gather_resident(self) -> None:
        """After a step: every rank updated its chunk of the resident block; collect the others' chunks."""
        self.partition.gather_block(self.resident_flat, self.layout.resident)

    def flush(self) -> None:
        """Wait for parameter write-backs (and raise their errors)."""
        writes, self._pending_writes = self._pending_writes, []
        for write in writes:
            write.result()
