"""The offload engine: owns a model's parameters, gradients and optimizer state, and streams them.

Lightning-free: both strategies build one from config and call ``backward`` and ``step``. Its parts are built at
set-up by ``engine/build.py``; this class composes them at run time. Data flow per iteration (docs/engine.md):
16-bit params stream store -> device per block in forward and backward; fp32 gradients leave block by block into
the gradient store; the step streams subgroups (gradient, master, state) through the updater and publishes new
16-bit params to the param store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_smartinf import trace
from lightning_smartinf.compress.topk import TopKCompressor
from lightning_smartinf.config import CompressionConfig, OffloadConfig, UpdateConfig
from lightning_smartinf.core import Block, Layout, StepContext
from lightning_smartinf.engine.build import Directories, build
from lightning_smartinf.engine.fence import StateFence
from lightning_smartinf.engine.grads import GradientAccumulator, gather_grads
from lightning_smartinf.engine.handback import WeightHandback
from lightning_smartinf.engine.loss_scale import DynamicLossScaler, inverse_scale
from lightning_smartinf.engine.materialize import Materializer
from lightning_smartinf.engine.overlap import OverlappedStep
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.partition import Partition
from lightning_smartinf.engine.placement import HostPlacement
from lightning_smartinf.engine.stepping import StepRunner
from lightning_smartinf.schedule.horizontal import BlockHooks
from lightning_smartinf.schedule.spill import GraphSpill
from lightning_smartinf.storage.aligned import typed_view
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import IOBackend
from lightning_smartinf.storage.store import FileStore, StripedStore, WrittenSum
from lightning_smartinf.update.base import Updater
from lightning_smartinf.update.optimizers import OptimizerRule, hyperparameters
from lightning_smartinf.update.smart import SmartUpdater

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    applied: bool
    grad_norm: float
    loss_scale: float


class OffloadEngine:
    """Parameters, gradients and optimizer state of one model, offloaded per ``OffloadConfig``."""

    # The parts, built at set-up by engine/build.py (``EngineParts`` says what each is), in the order data meets them.
    layout: Layout
    frozen_layout: Layout
    partition: Partition
    materializer: Materializer
    directories: Directories
    disk: FileStore | StripedStore
    backend: IOBackend
    root: Path
    overlapped: OverlappedStep
    fence: StateFence
    params: ParamStreamer
    frozen: ParamStreamer | None
    placement: HostPlacement
    updater: Updater | None
    grads: GradientAccumulator
    counters: TrafficCounters
    scaler: DynamicLossScaler | None
    rule: OptimizerRule | None
    compression: CompressionConfig
    block_modules: list[nn.Module]
    itemsize: int
    frozen_itemsize: int
    frozen_dtype: torch.dtype | None
    grad_flat: torch.Tensor
    originals: list[torch.Tensor] | None

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        offload: OffloadConfig,
        update: UpdateConfig,
        device: torch.device,
        param_dtype: torch.dtype,
        loss_scaling: bool = False,
        compression: CompressionConfig | None = None,
        overlap: float = 0.0,
        rank: int = 0,
        world: int = 1,
        init_from: str | Path | None = None,
        ranks_per_host: int = 1,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.model, self.optimizer, self.cfg = model, optimizer, offload
        self.device, self.param_dtype = device, param_dtype
        self.clip_norm: float | None = None
        self.step_count = 0
        self.micro_batches = 0
        self.overlap = overlap
        self.ranks_per_host = ranks_per_host
        """Ranks sharing this host's memory: ``offload.host_memory_budget=auto`` gives each its share."""
        self._eager_norm = 0.0
        parts = build(model, optimizer, offload, update, device, param_dtype, loss_scaling, compression, rank, world,
                      init_from, ranks_per_host, check)  # fmt: skip
        self.parts = parts
        """The parts as build made them; each is also named below, once, for the code that runs with it."""
        self.layout = parts.layout
        self.frozen_layout = parts.frozen_layout
        self.partition = parts.partition
        self.materializer = parts.materializer
        self.directories = parts.directories
        self.disk = parts.disk
        self.backend = parts.backend
        self.root = parts.root
        self.overlapped = parts.overlapped
        self.fence = parts.fence
        self.params = parts.params
        self.frozen = parts.frozen
        self.placement = parts.placement
        self.updater = parts.updater
        self.grads = parts.grads
        self.counters = parts.counters
        self.scaler = parts.scaler
        self.rule = parts.rule
        self.compression = parts.compression
        self.block_modules = parts.block_modules
        self.itemsize = parts.itemsize
        self.frozen_itemsize = parts.frozen_itemsize
        self.frozen_dtype = parts.frozen_dtype
        self.grad_flat = parts.grad_flat
        self.originals = parts.originals
        self.steps = StepRunner(parts.layout, parts.updater, parts.params, parts.grads, parts.overlapped,
                                parts.fence) if parts.updater is not None else None  # fmt: skip
        self.hooks = BlockHooks(self, parts.block_modules)
        self.hooks.wrap()
        self.block_forwards = self.hooks.forwards
        """The blocks' original forwards (the vertical schedule calls them between its own fetches)."""
        self.weights = WeightHandback(parts, model, device, self.hooks, self.block_masters, self.wait_step)
        """The trained weights back into the module between stages (engine/handback.py)."""
        self.graphs = GraphSpill(parts.disk, parts.disk.allocator)
        """Kept graphs on storage, for the vertical schedules (schedule/spill.py): nothing is held until used."""

    def written(self, path: Path) -> WrittenSum | None:
        """What this run wrote to the state file ``path`` (a checkpoint's copy of it is checked against it)."""
        return self.directories.written(path)

    def replaced(self, files: dict[Path, WrittenSum]) -> None:
        """State files were replaced outside the stores (a checkpoint restored with these sums)."""
        self.directories.replaced(files)

    @property
    def compressor(self) -> TopKCompressor | None:
        """SmartComp's compressor when gradients travel compressed (``update=smart``, ``compression=topk``)."""
        return self.updater.compressor if isinstance(self.updater, SmartUpdater) else None

    @property
    def host_memory_bytes(self) -> int:
        """Host memory held by the engine's buffer pools (fixed at set-up)."""
        return self.parts.pool_bytes

    # -- the schedule's hooks (BlockRunner) ------------------------------------------------------------------------
    @property
    def streamers(self) -> list[ParamStreamer]:
        return self.parts.streamers

    def enter_block(self, index: int, backward: bool) -> None:
        with trace.span(f"fetch {index}", "wait", block=index):
            for streamer in self.streamers:
                streamer.fetch(index)
        step = -1 if backward else 1
        for ahead in range(1, self.cfg.prefetch + 1):
            for streamer in self.streamers:
                streamer.prefetch(index + step * ahead)
        trace.begin(("block", index))

    def exit_block(self, index: int, backward: bool) -> None:
        trace.end(("block", index), f"{'backward' if backward else 'forward'} {index}", "compute", block=index)
        for streamer in self.streamers:
            streamer.release(index)

    def release_blocks(self) -> None:
        """Release every fetched or prefetched block, trainable and frozen parameters both."""
        for streamer in self.streamers:
            streamer.release_all()

    def block_parameters(self, index: int) -> list[torch.nn.Parameter]:
        """The streamed parameters of block ``index``, trainable then frozen (views of one buffer each while the
        block is fetched)."""
        return [slot.param for layout in (self.layout, self.frozen_layout) for slot in layout.blocks[index].slots]

    def collect_block_grads(self, index: int) -> None:
        block = self.layout.blocks[index]
        self._release_gradients()
        with trace.span(f"grads {index}", "grads", block=index):
            flat = typed_view(self.grad_flat, torch.float32, block.numel)
            gather_grads(block.slots, flat)
            self.partition.reduce_block(flat, block)
            self.grads.add_block(block, flat)
        if self.steps is not None:
            self.steps.stream_block(index)

    # -- training ---------------------------------------------------------------------------------------------------
    def configure_step(self, *, overlap: float | None = None, clip_norm: float | None = None) -> None:
        """Set how the next steps run: the share of each step overlapped with the next forward
        (``schedule.overlap``), and the global gradient norm to clip to (Lightning's ``gradient_clip_val``)."""
        if overlap is not None:
            self.overlap = overlap
        if clip_norm is not None:
            self.clip_norm = clip_norm

    def count_micro_batch(self) -> None:
        """One more micro-batch's gradients accumulated (a schedule that ran its own backward)."""
        self.micro_batches += 1

    def discard_gradients(self) -> None:
        """Drop what was accumulated since the last step (Lightning skipped the step: training_step returned None)."""
        self.grads.reset()
        self.micro_batches = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch and move the resident block's gradients into the gradient store."""
        self.scale_loss(loss).backward()
        self.collect_resident_grads()
        self.micro_batches += 1

    def collect_resident_grads(self) -> None:
        """Move the resident block's gradients (accumulated by autograd on the params) into the gradient store."""
        resident = self.layout.resident
        self._release_gradients()
        if resident.numel:
            trace.begin("resident grads")
            flat = torch.zeros(resident.numel, dtype=torch.float32)
            gather_grads(resident.slots, flat)
            self.partition.reduce_block(flat, resident)
            self.grads.add_block(resident, flat)
            trace.end("resident grads", "grads resident", "grads")
        if self.steps is not None and self.steps.eager is not None:
            self._eager_norm = float(self.partition.global_norm(self.grads.global_norm()))
        if self.steps is not None:
            self.steps.stream_block(0)

    def _release_gradients(self) -> None:
        """Before new gradients enter the store: an overlapped step forgets the gradients it consumed at its very
        end, after its last block is published, so the next backward (whose forward waited only for each block's
        update) waits for that step to finish. Not during an eager step, which consumes this backward's blocks."""
        if self.overlapped.started and (self.steps is None or self.steps.eager is None):
            with trace.span("wait for the step to let go of the gradients", "update-wait"):
                self.wait_step()

    def begin_eager_step(self) -> None:
        """Start this iteration's update now: blocks join it from ``collect_block_grads`` as backward finishes
        them, the resident block last. Exact only without clipping and loss scaling (checked by the strategy)."""
        assert self.steps is not None and self.optimizer is not None and self.scaler is None
        self.wait_step()
        self.step_count += 1
        self.steps.begin_eager(StepContext(self.step_count, hyperparameters(self.optimizer)))

    def gradient_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients accumulated since the last step, unscaled: what clipping compares
        with (a collective under data parallelism: every rank calls it)."""
        return self.partition.global_norm(self.grads.global_norm()) * inverse_scale(self.scaler)

    def step(self) -> StepResult:
        """Apply one optimizer step to every subgroup (or skip it on fp16 overflow), then reset the gradients."""
        if self.steps is None or self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer")
        with trace.span("optimizer step", "step", overlap=self.overlap):
            if self.steps.eager is not None:  # the update has been running since backward began
                self.steps.eager = None
                self.micro_batches = 0
                self.steps.wait(self.overlap)
                return StepResult(True, self._eager_norm, 1.0)
            self.wait_step()
            self.params.release_all()
            scale = self.scaler.scale if self.scaler is not None else 1.0
            norm = self.gradient_norm()
            found_inf = not bool(torch.isfinite(norm))
            if self.scaler is not None:
                self.scaler.update(found_inf)
                if found_inf:
                    self.discard_gradients()
                    return StepResult(False, float(norm), scale)
            clip_coef = 1.0
            if self.clip_norm is not None and self.clip_norm > 0:
                clip_coef = float(torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0))
            self.step_count += 1
            ctx = StepContext(self.step_count, hyperparameters(self.optimizer), inverse_scale(self.scaler), clip_coef)
            self.micro_batches = 0
            if self.overlap == 0.0:
                self.steps.apply(ctx)
                self.params.gather_resident()
            else:
                self.steps.start(ctx, self.overlap)
            return StepResult(True, float(norm), scale)

    def wait_step(self) -> None:
        """Block until an overlapped step has finished (before checkpoints, reads of the masters, shutdown)."""
        self.overlapped.join()

    # -- inspection ----------------------------------------------------------------------------------------------
    def block_masters(self, block: Block) -> torch.Tensor:
        """One block's fp32 masters as its flat buffer, every rank's chunk gathered (a collective under DP)."""
        if self.updater is None:
            raise RuntimeError("no master weights: this engine was built without an optimizer")
        self.wait_step()
        flat = torch.zeros(block.numel, dtype=torch.float32)
        for sg in block.subgroups:
            flat[sg.offset : sg.offset + sg.numel] = self.updater.read_master(sg)
        self.partition.gather_block(flat, block)
        return flat

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master value, by parameter name (reads the whole state: for tests and export)."""
        out: dict[str, torch.Tensor] = {}
        for block in self.layout.blocks:
            flat = self.block_masters(block)
            for slot in block.slots:
                out[slot.name] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        return out

    def close(self) -> None:
        self.wait_step()
        self.release_blocks()
        self.hooks.unwrap()
        if self.updater is not None:
            self.updater.close()
        self.grads.close()
        for streamer in self.streamers:
            streamer.close()
        self.graphs.close()
        self.directories.close()
