"""An engine's parts, built from its config before the first step: the layouts, the state directories (checked,
locked, each with its I/O backend), the parameter streamers, the updater, the gradient store, what the host memory
budget places in RAM, and every block's starting state on storage.

Set-up runs once and reads everything; run time (engine.py) only composes the parts it is given here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_smartinf.compress.topk import TopKCompressor
from lightning_smartinf.config import CompressionConfig, OffloadConfig, UpdateConfig, parse_bytes
from lightning_smartinf.core import FROZEN, HOST_LINK, Layout, ParamSlot, Subgroup, block_pairs, owned_slots
from lightning_smartinf.engine.fence import StateFence
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.engine.layout import build_layout, eight_bit_params
from lightning_smartinf.engine.loss_scale import DynamicLossScaler
from lightning_smartinf.engine.materialize import Materializer
from lightning_smartinf.engine.overlap import OverlappedStep
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.partition import Partition
from lightning_smartinf.engine.placement import HostPlacement
from lightning_smartinf.engine.pretrained import PretrainedSource
from lightning_smartinf.engine.sizing import (
    PlannedSizes,
    Tiers,
    check_host_memory,
    place_in_host_memory,
    planned_pool_bytes,
    planned_storage_bytes,
)
from lightning_smartinf.engine.snapshot import planned_signature
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.memory import release_free_heap
from lightning_smartinf.schedule.horizontal import find_blocks
from lightning_smartinf.storage.aligned import aligned_bytes
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import IOBackend, IOSettings, backend_for
from lightning_smartinf.storage.lock import StateLock
from lightning_smartinf.storage.space import prepare_directory
from lightning_smartinf.storage.store import (
    FileStore,
    HostStore,
    StripedStore,
    TensorStore,
    TieredStore,
    WrittenSum,
)
from lightning_smartinf.update import quant8
from lightning_smartinf.update.base import Updater
from lightning_smartinf.update.cpu_adam import load_cpu_adam
from lightning_smartinf.update.host import HostUpdater
from lightning_smartinf.update.opencl import device_specs
from lightning_smartinf.update.optimizers import OptimizerRule, rule_for, with_catch_up
from lightning_smartinf.update.smart import SmartUpdater, wire_dtype

log = logging.getLogger(__name__)


@dataclass
class Directories:
    """The state directories this run took: their locks, I/O backends and stores (closed together)."""

    io: IOSettings
    check_free_space: bool
    verify_io: bool
    counters: TrafficCounters
    locks: list[StateLock] = field(default_factory=list)
    backends: list[IOBackend] = field(default_factory=list)
    stores: list[FileStore] = field(default_factory=list)

    def open(self, directory: Path, needed: int, key: str, link: str) -> FileStore:
        """Check ``directory`` can hold ``needed`` bytes and lock it for this run (config key ``key``), give it its
        own I/O backend, and count its traffic on ``link``."""
        prepare_directory(directory, needed, self.check_free_space, key)
        lock = StateLock(directory, key)
        lock.acquire()
        self.locks.append(lock)
        backend = backend_for(directory, self.io)
        self.backends.append(backend)
        store = FileStore(directory, backend, self.counters, link, self.verify_io)
        self.stores.append(store)
        return store

    def written(self, path: Path) -> WrittenSum | None:
        """What this run wrote to the state file ``path``, as its store recorded it (None: nothing recorded)."""
        return next((found for store in self.stores if (found := store.written(path)) is not None), None)

    def replaced(self, files: dict[Path, WrittenSum]) -> None:
        """State files were replaced outside the stores (a checkpoint restored): later reads of ``files`` are
        checked against the sums of the bytes put there, not those of this run's earlier writes."""
        for store in self.stores:
            for path, written in files.items():
                store.record_written(path, written)

    def release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.release_locks()


@dataclass
class EngineParts:
    """Everything an engine runs with, built by ``build``."""

    rule: OptimizerRule | None
    compression: CompressionConfig
    scaler: DynamicLossScaler | None
    counters: TrafficCounters
    block_modules: list[nn.Module]
    layout: Layout
    """Blocks, flat buffers and subgroups of the trainable parameters (engine/layout.py)."""
    frozen_layout: Layout
    """The streamed blocks' frozen parameters (``requires_grad=False``): their own flat buffers and files."""
    frozen_dtype: torch.dtype | None
    itemsize: int
    frozen_itemsize: int
    partition: Partition
    """This rank's share of every block and the collectives over it (engine/partition.py)."""
    overlapped: OverlappedStep
    """The step running behind the next forward: its thread, events and failure (engine/overlap.py)."""
    fence: StateFence
    """Subgroups a checkpoint in the background is still copying: the step waits there (engine/fence.py)."""
    materializer: Materializer
    """Gives meta parameters their values, or reads them from ``init_from`` (engine/materialize.py)."""
    directories: Directories
    disk: FileStore | StripedStore
    """The state directories (``offload.nvme_path``), each with its own I/O backend."""
    root: Path
    backend: IOBackend
    """The first directory's backend (named in logs and used by the planner's disk probe)."""
    params: ParamStreamer
    """16-bit parameters: read ahead per block, written back per updated subgroup (engine/params.py)."""
    frozen: ParamStreamer | None
    """Frozen parameters of the streamed blocks, in their own dtype, streamed with their block and never written
    back (None when every streamed parameter trains)."""
    updater: Updater | None
    """The optimizer update: on the host or on near-storage devices (update/); None without an optimizer."""
    grads: GradientAccumulator
    """fp32 gradients between backward and the step (engine/grads.py)."""
    grad_flat: torch.Tensor
    """One streamed block's fp32 gradient, gathered from its parameters' ``.grad`` before it joins the store."""
    placement: HostPlacement = field(default_factory=lambda: HostPlacement(0, False, frozenset(), 0))
    """What ``offload.host_memory_budget`` put in host memory (engine/placement.py)."""
    originals: list[torch.Tensor] | None = None
    """Without an optimizer nothing changes the weights and the 16-bit copies may have rounded them, so the
    trainable parameters' own tensors are kept for the hand-back (not for a model built on meta: its values came
    from init_from or its init, and stay there)."""

    @property
    def streamers(self) -> list[ParamStreamer]:
        """The trainable parameters' streamer, and the frozen ones' where the blocks have any."""
        return [self.params] if self.frozen is None else [self.params, self.frozen]

    @property
    def pool_bytes(self) -> int:
        """Host memory held by the buffer pools (fixed at set-up)."""
        pools = self.params.host_bytes + self.grads.host_bytes + self.grad_flat.numel()
        pools += self.frozen.host_bytes if self.frozen is not None else 0
        return pools + (getattr(self.updater, "host_bytes", 0) or 0)


def rank_path(path: str, rank: int, world: int) -> Path:
    """A rank's own directory: ``{rank}`` in ``path`` replaced, or, with several ranks and no ``{rank}``,
    ``path/rank{rank}`` (two ranks never share a state directory)."""
    if "{rank}" in path:
        path = path.replace("{rank}", str(rank))
    elif world > 1:
        path = f"{path}/rank{rank}"
    return Path(path).expanduser().resolve()


def _frozen_dtype(layout: Layout) -> torch.dtype | None:
    """The one dtype of the streamed blocks' frozen parameters (None: there are none)."""
    dtypes = {slot.dtype for block in layout.streamed for slot in block.slots}
    if len(dtypes) > 1:
        names = {slot.dtype: slot.name for block in layout.streamed for slot in block.slots}
        raise ConfigError("the frozen parameters of the streamed blocks mix dtypes (" + ", ".join(
            f"{name}: {str(dtype).removeprefix('torch.')}" for dtype, name in names.items()) + "): give them one "
            "dtype, e.g. model.requires_grad_(False).to(torch.bfloat16) before adding trainable adapters")  # fmt: skip
    return dtypes.pop() if dtypes else None


def optimizer_rule(optimizer: Optimizer | None, compression: CompressionConfig) -> OptimizerRule | None:
    """The update rule of ``optimizer``; with SmartComp's catch-up, its catch-up form."""
    rule = rule_for(optimizer) if optimizer is not None else None
    if rule is not None and compression.kind == "topk":
        if compression.catch_up:
            return with_catch_up(rule)
        if rule.name in ("adam", "adamw") and compression.error_feedback:
            log.warning(
                "compression.error_feedback=true without compression.catch_up=true: under Adam the saved-up "
                "residual arrives as one normalised step, which trains worse than top-k alone "
                "(docs/compression.md); add compression.catch_up=true"
            )
    return rule


def build(model: nn.Module, optimizer: Optimizer | None, offload: OffloadConfig, update: UpdateConfig,
          device: torch.device, param_dtype: torch.dtype, loss_scaling: bool = False,
          compression: CompressionConfig | None = None, rank: int = 0, world: int = 1,
          init_from: str | Path | None = None, ranks_per_host: int = 1,
          check: Callable[[dict[str, Any]], None] | None = None) -> EngineParts:  # fmt: skip
    """Every part of an engine for ``model``, its state directories locked and its starting state written (block by
    block: set-up holds one block at a time whatever the model's size). On failure the locks are released.
    ``check``: given the engine's signature once its layout is known, before anything is written (a checkpoint to
    resume from refuses a run it cannot be restored onto there)."""
    compression = compression or CompressionConfig()
    rule = optimizer_rule(optimizer, compression)
    block_list = find_blocks(model)
    if not block_list:
        raise ConfigError(
            f"smart_infinity found no repeated blocks to stream in {type(model).__name__} (no nn.ModuleList with "
            "parameters): define offload_blocks() on the LightningModule, returning the (name, module) pairs of "
            "its layers, e.g. [(f'model.layers.{i}', layer) for i, layer in enumerate(self.model.layers)]"
        )
    groups = [g["params"] for g in optimizer.param_groups] if optimizer else [list(model.parameters())]
    eight_bit = None
    if rule is not None and offload.state_precision == quant8.INT8:
        eight_bit = eight_bit_params(model, offload.min_8bit_size, offload.fp32_embedding_state)
    layout = build_layout(model, block_list, groups, offload.subgroup_size, rank, world, eight_bit=eight_bit)
    fixed = [p for p in model.parameters() if not p.requires_grad]
    frozen_layout = build_layout(model, block_list, [fixed], offload.subgroup_size, rank, world, frozen=True)
    if check is not None:
        check(planned_signature(rule.name if rule else None, offload.state_precision, layout, frozen_layout))
    frozen_dtype = _frozen_dtype(frozen_layout)
    itemsize = torch.empty((), dtype=param_dtype).element_size()
    frozen_itemsize = torch.empty((), dtype=frozen_dtype).element_size() if frozen_dtype else 0
    materializer = Materializer(model, PretrainedSource(init_from, model) if init_from else None, device)
    materializer.check(dict(model.named_parameters()))
    counters = TrafficCounters()
    io = IOSettings(offload.io_backend, offload.io_threads, offload.aio_intra_op_parallelism, offload.aio_block_size,
                    offload.aio_queue_depth)  # fmt: skip
    directories = Directories(io, offload.check_free_space, offload.verify_io, counters)
    roots = [rank_path(path, rank, world) for path in offload.paths]
    needed = planned_storage_bytes(layout, rule, offload, itemsize, update.backend == "host", frozen_layout,
                                   frozen_itemsize)  # fmt: skip
    try:
        stores = [
            directories.open(root, nbytes, "offload.nvme_path" + (f"[{index}]" if len(roots) > 1 else ""), HOST_LINK)
            for index, (root, nbytes) in enumerate(zip(roots, needed, strict=True))
        ]
        log.info("smart_infinity storage backend: %s%s", directories.backends[0].name,
                 f"; state striped over {len(roots)} directories" if len(roots) > 1 else "")  # fmt: skip
        disk: FileStore | StripedStore = stores[0] if len(stores) == 1 else StripedStore(stores)
        partition, overlapped = Partition(layout), OverlappedStep(len(layout.blocks), device.type == "cpu")
        pin, on_disk = device.type == "cuda", offload.params == "nvme"
        # placement first: ``auto`` counts the buffer pools the engine is about to allocate (their shapes are known
        # before any is made), then each store a placement splits between RAM and disk is built with its RAM names
        budget = offload.host_memory_budget
        placing = budget == "auto" or parse_bytes("offload.host_memory_budget", budget) > 0
        host_update = rule is not None and update.backend == "host"
        tiers = Tiers(params=placing and on_disk, frozen=placing and on_disk and frozen_dtype is not None,
                      state=placing and host_update, grads=placing and offload.grads == "nvme" and
                      (rule is None or host_update))  # fmt: skip
        sizes = PlannedSizes(rule, layout, frozen_layout, itemsize, frozen_itemsize,
                             planned_pool_bytes(layout, frozen_layout, itemsize, frozen_itemsize, rule, offload,
                                                update, compression, param_dtype))  # fmt: skip
        placement = place_in_host_memory(sizes, offload.host_memory_budget, ranks_per_host, device, tiers.grads,
                                         tiers.state, tiers.frozen, tiers.params)
        param_store: TensorStore = disk if on_disk else HostStore(pin=pin)
        if tiers.params:
            param_store = TieredStore(disk, HostStore(pin=pin), placement.params)
        allocator = disk.allocator if on_disk else None
        gather_group = dist.new_group() if world > 1 else None  # the streamer's all-gathers, apart
        params = ParamStreamer(layout, param_store, param_dtype, device, offload.prefetch, partition, allocator,
                               overlapped, gather_group)  # fmt: skip
        frozen = None
        if frozen_dtype is not None:  # read only: nothing to wait for, a gather group of its own under DP
            frozen_store: TensorStore = disk if on_disk else param_store
            if tiers.frozen:
                frozen_store = TieredStore(disk, HostStore(pin=pin), placement.frozen)
            frozen = ParamStreamer(frozen_layout, frozen_store, frozen_dtype, device, offload.prefetch,
                                   Partition(frozen_layout), allocator, None,
                                   dist.new_group() if world > 1 else None, kind=FROZEN)  # fmt: skip
        state_tier = TieredStore(disk, HostStore(), placement.state) if tiers.state else None
        updater = None
        if rule is not None:
            updater = make_updater(rule, update, offload, layout, disk, roots[0], directories, state_tier,
                                   param_dtype, compression, device)  # fmt: skip
        if isinstance(updater, SmartUpdater) and offload.grads == "nvme":  # into the devices' own stores
            grad_store: TensorStore = updater.gradient_store()
        elif tiers.grads:
            in_ram = frozenset(sg.key for sg in layout.subgroups) if placement.grads else frozenset()
            grad_store = TieredStore(disk, HostStore(), in_ram)
        elif offload.grads == "nvme":
            grad_store = disk
        else:
            grad_store = HostStore()
        grad_allocator = None if isinstance(grad_store, HostStore) else disk.allocator  # any page-locked one serves
        grads = GradientAccumulator(layout, grad_store, offload.step_lookahead, grad_allocator)
        parts = EngineParts(
            rule=rule, compression=compression, scaler=DynamicLossScaler() if loss_scaling else None,
            counters=counters, block_modules=[m for _, m in block_list], layout=layout, frozen_layout=frozen_layout,
            frozen_dtype=frozen_dtype, itemsize=itemsize, frozen_itemsize=frozen_itemsize, partition=partition,
            overlapped=overlapped, fence=StateFence(), materializer=materializer, directories=directories, disk=disk,
            root=roots[0], backend=directories.backends[0], params=params, frozen=frozen, updater=updater,
            grads=grads, grad_flat=aligned_bytes(layout.max_block_numel * 4), placement=placement,
        )  # fmt: skip
        check_host_memory(parts, device, needed)
        slots = [slot for block in layout.blocks for slot in block.slots]
        if updater is None and not any(slot.param.is_meta for slot in slots):
            parts.originals = [slot.param.data for slot in slots]
        write_initial_state(parts, model, device)
    except BaseException:
        directories.release_locks()
        raise
    return parts


def make_updater(rule: OptimizerRule, update: UpdateConfig, offload: OffloadConfig, layout: Layout,
                 disk: FileStore | StripedStore, root: Path, directories: Directories, tier: TieredStore | None,
                 param_dtype: torch.dtype, compression: CompressionConfig,
                 device: torch.device) -> Updater:  # fmt: skip
    """The host update (its state in ``tier`` where a host memory budget may place some of it in RAM), or the
    near-storage devices, each in a directory of its own."""
    if update.backend == "host":
        # with 8-bit state the update runs fused with the (de)quantization (update/quant8.cpp): DeepSpeed's Adam
        # would only sit in memory
        adam = rule.name in ("adam", "adamw") and offload.state_precision == quant8.FP32
        kernel = load_cpu_adam(update.host_adam) if adam else None
        return HostUpdater(rule, tier or disk, layout.max_subgroup_numel, offload.step_lookahead, kernel,
                           offload.state_precision, quant8.largest_payload(layout.subgroups))  # fmt: skip
    if update.wire == "16bit" and param_dtype == torch.float32:
        raise ConfigError("update.wire=16bit needs a 16-bit training precision (bf16-mixed or 16-mixed)")
    wire = wire_dtype(update.wire, param_dtype)
    specs = [dataclasses.replace(s, path=str(rank_path(s.path, layout.rank, layout.world))) if s.path else s
             for s in device_specs(update.devices)]  # fmt: skip

    def make_store(directory: Path, link: str, needed: int) -> FileStore:
        return directories.open(directory, needed, f"update.devices[{link.removeprefix('device')}].path", link)

    compressor = TopKCompressor(compression, layout, device) if compression.kind == "topk" else None
    return SmartUpdater(rule, specs, root, make_store, directories.counters, layout, wire, offload.grads == "nvme",
                        compressor, offload.state_precision)  # fmt: skip


def write_initial_state(parts: EngineParts, model: nn.Module, device: torch.device) -> None:
    """Write every block's starting state, one block at a time: its parameters get values where they have none
    (meta) or come from ``init_from``, then its master and 16-bit copies go to storage and its host tensors are
    freed, so set-up holds one block at a time whatever the model's size."""
    owned = {id(slot.param) for slot in owned_slots(parts.layout, parts.frozen_layout)}
    outside = [ParamSlot(n, p, 0, p.numel(), p.shape, p.dtype) for n, p in model.named_parameters()
               if id(p) not in owned]  # fmt: skip
    world = parts.layout.world
    _share(parts.materializer.materialize(outside, None), world)
    for slot in outside:  # frozen ones outside the blocks stay in the module, on the training device
        if slot.param.device != device:
            slot.param.data = slot.param.data.to(device)
    if parts.materializer.pretrained is not None:
        parts.materializer.pretrained.fill_buffers(model)
    for block, fixed in block_pairs(parts.layout, parts.frozen_layout):
        _share(parts.materializer.materialize(block.slots + fixed.slots, block), world)
        if parts.updater is not None:
            parts.updater.initialize(block.subgroups, lambda sg: initial_master(parts.layout, sg))
        parts.params.initialize_block(block)
        if parts.frozen is not None:
            parts.frozen.initialize_block(fixed)
        release_free_heap()


def _share(initialized: list[ParamSlot], world: int) -> None:
    """Data parallel: parameters a rank's init route just filled take rank 0's values (as DDP starts)."""
    if world > 1:
        for slot in initialized:
            torch.distributed.broadcast(slot.param.data, 0)


def initial_master(layout: Layout, sg: Subgroup) -> torch.Tensor:
    """A subgroup's fp32 master, from its parameters' values at set-up."""
    block = layout.blocks[sg.block]
    flat = torch.zeros(sg.numel, dtype=torch.float32)
    for slot in block.slots:
        lo, hi = max(slot.offset, sg.offset), min(slot.offset + slot.numel, sg.offset + sg.numel)
        if lo < hi:
            values = slot.param.data.reshape(-1)[lo - slot.offset : hi - slot.offset]
            flat[lo - sg.offset : hi - sg.offset].copy_(values)
    return flat
