"""The offload engine: owns a model's parameters, gradients and optimizer state, and streams them.

Lightning-free: the strategy builds one from config and calls ``backward`` and ``step``. Data flow per iteration
(docs/engine.md): 16-bit params stream store -> device per block in forward and backward; fp32 gradients leave
block by block into the gradient store; the step streams subgroups (gradient, master, state) through the updater
and publishes new 16-bit params to the param store.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_smartinf import trace
from lightning_smartinf.compress.topk import TopKCompressor
from lightning_smartinf.config import CompressionConfig, OffloadConfig, UpdateConfig, parse_bytes
from lightning_smartinf.core import FROZEN, HOST_LINK, Block, Layout, ParamSlot, StepContext, Subgroup
from lightning_smartinf.engine.fence import StateFence
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.engine.handback import WeightHandback
from lightning_smartinf.engine.layout import build_layout
from lightning_smartinf.engine.loss_scale import DynamicLossScaler
from lightning_smartinf.engine.materialize import Materializer
from lightning_smartinf.engine.overlap import OverlappedStep
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.partition import Partition
from lightning_smartinf.engine.placement import HostPlacement, auto_budget, place
from lightning_smartinf.engine.pretrained import PretrainedSource
from lightning_smartinf.errors import ConfigError, HostMemoryError
from lightning_smartinf.memory import host_available_bytes, release_free_heap
from lightning_smartinf.schedule.horizontal import find_blocks, unwrap_blocks, wrap_blocks
from lightning_smartinf.storage.aligned import align_up, aligned_bytes, typed_view
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import IOBackend, IOSettings, backend_for
from lightning_smartinf.storage.lock import StateLock
from lightning_smartinf.storage.space import human_bytes, prepare_directory
from lightning_smartinf.storage.store import FileStore, HostStore, StripedStore, TensorStore, TieredStore, stripe_of
from lightning_smartinf.update.base import Updater
from lightning_smartinf.update.cpu_adam import load_cpu_adam
from lightning_smartinf.update.host import HostUpdater
from lightning_smartinf.update.optimizers import OptimizerRule, hyperparameters, rule_for, with_catch_up
from lightning_smartinf.update.smart import SmartUpdater, device_specs

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    applied: bool
    grad_norm: float
    loss_scale: float


def planned_storage_bytes(
    layout: Layout, rule: OptimizerRule | None, cfg: OffloadConfig, itemsize: int, state_here: bool,
    frozen: Layout | None = None, frozen_itemsize: int = 0,
) -> list[int]:  # fmt: skip
    """Bytes the files under each directory of ``nvme_path`` take (each padded to 4 KiB); ``state_here``: master,
    state and gradients live here too (the host update), rather than in near-storage devices' directories;
    ``frozen``: the streamed blocks' frozen parameters, ``frozen_itemsize`` bytes an element, beside the 16-bit
    ones."""
    totals = [0] * len(cfg.paths)
    for sg in layout.subgroups:
        fp32 = align_up(sg.numel * 4)
        total = fp32 * (1 + len(rule.states)) if rule and state_here else 0
        total += fp32 if cfg.grads == "nvme" and state_here else 0
        streamed = not layout.blocks[sg.block].resident
        total += align_up(sg.numel * itemsize) if cfg.params == "nvme" and streamed else 0
        totals[stripe_of(sg.key, len(totals))] += total
    for sg in frozen.subgroups if frozen is not None and cfg.params == "nvme" else ():
        totals[stripe_of(sg.key, len(totals))] += align_up(sg.numel * frozen_itemsize)
    return totals


def _frozen_dtype(layout: Layout) -> torch.dtype | None:
    """The one dtype of the streamed blocks' frozen parameters (None: there are none)."""
    dtypes = {slot.dtype for block in layout.streamed for slot in block.slots}
    if len(dtypes) > 1:
        names = {slot.dtype: slot.name for block in layout.streamed for slot in block.slots}
        raise ConfigError("the frozen parameters of the streamed blocks mix dtypes (" + ", ".join(
            f"{name}: {str(dtype).removeprefix('torch.')}" for dtype, name in names.items()) + "): give them one "
            "dtype, e.g. model.requires_grad_(False).to(torch.bfloat16) before adding trainable adapters")  # fmt: skip
    return dtypes.pop() if dtypes else None


def rank_path(path: str, rank: int, world: int) -> Path:
    """A rank's own directory: ``{rank}`` in ``path`` replaced, or, with several ranks and no ``{rank}``,
    ``path/rank{rank}`` (two ranks never share a state directory)."""
    if "{rank}" in path:
        path = path.replace("{rank}", str(rank))
    elif world > 1:
        path = f"{path}/rank{rank}"
    return Path(path).expanduser().resolve()


class OffloadEngine:
    """Parameters, gradients and optimizer state of one model, offloaded per ``OffloadConfig``."""

    # The components, all built at set-up (``__init__`` and ``_build``), in the order data meets them.
    layout: Layout
    """Blocks, flat buffers and subgroups (engine/layout.py)."""
    partition: Partition
    """This rank's share of every block and the collectives over it (engine/partition.py)."""
    materializer: Materializer
    """Gives meta parameters their values, or reads them from ``init_from`` (engine/materialize.py)."""
    disk: FileStore | StripedStore
    """The state directories (``offload.nvme_path``), each with its own I/O backend."""
    backend: IOBackend
    """The first directory's backend (named in logs and used by the planner's disk probe)."""
    root: Path
    overlapped: OverlappedStep
    """The step running behind the next forward: its thread, events and failure (engine/overlap.py)."""
    fence: StateFence
    """Subgroups whose state a checkpoint in the background is still copying: the step waits there (engine/fence.py)."""
    params: ParamStreamer
    """16-bit parameters: read ahead per block, written back per updated subgroup (engine/params.py)."""
    frozen_layout: Layout
    """The streamed blocks' frozen parameters (``requires_grad=False``): their own flat buffers and files."""
    frozen: ParamStreamer | None
    """Frozen parameters of the streamed blocks, in their own dtype, streamed with their block and never written
    back (None when every streamed parameter trains)."""
    placement: HostPlacement
    """What ``offload.host_memory_budget`` put in host memory (engine/placement.py)."""
    updater: Updater | None
    """The optimizer update: on the host or on near-storage devices (update/); None without an optimizer."""
    grads: GradientAccumulator
    """fp32 gradients between backward and the step (engine/grads.py)."""
    weights: WeightHandback
    """The trained weights back into the module between stages (engine/handback.py)."""
    counters: TrafficCounters
    scaler: DynamicLossScaler | None
    rule: OptimizerRule | None

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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.cfg = offload
        self.device = device
        self.param_dtype = param_dtype
        self.itemsize = torch.empty((), dtype=param_dtype).element_size()
        self.counters = TrafficCounters()
        self.scaler = DynamicLossScaler() if loss_scaling else None
        self.rule = rule_for(optimizer) if optimizer is not None else None
        self.clip_norm: float | None = None
        self.step_count = 0
        self.micro_batches = 0
        self.compression = compression or CompressionConfig()
        if self.rule is not None and self.compression.kind == "topk":
            if self.compression.catch_up:
                self.rule = with_catch_up(self.rule)
            elif self.rule.name in ("adam", "adamw") and self.compression.error_feedback:
                log.warning(
                    "compression.error_feedback=true without compression.catch_up=true: under Adam the saved-up "
                    "residual arrives as one normalised step, which trains worse than top-k alone "
                    "(docs/compression.md); add compression.catch_up=true"
                )
        self.overlap = overlap
        self.ranks_per_host = ranks_per_host
        """Ranks sharing this host's memory: ``offload.host_memory_budget=auto`` gives each its share."""
        self._eager: queue.Queue[Subgroup | None] | None = None
        self._eager_norm = 0.0

        block_list = find_blocks(model)
        if not block_list:
            raise ConfigError(
                f"smart_infinity found no repeated blocks to stream in {type(model).__name__} (no nn.ModuleList with "
                "parameters): define offload_blocks() on the LightningModule, returning the (name, module) pairs of "
                "its layers, e.g. [(f'model.layers.{i}', layer) for i, layer in enumerate(self.model.layers)]"
            )
        self.block_modules = [m for _, m in block_list]
        groups = [g["params"] for g in optimizer.param_groups] if optimizer else [list(model.parameters())]
        self.layout = build_layout(model, block_list, groups, offload.subgroup_size, rank, world)
        fixed = [p for p in model.parameters() if not p.requires_grad]
        self.frozen_layout = build_layout(model, block_list, [fixed], offload.subgroup_size, rank, world, frozen=True)
        self.frozen_dtype = _frozen_dtype(self.frozen_layout)
        self.frozen_itemsize = torch.empty((), dtype=self.frozen_dtype).element_size() if self.frozen_dtype else 0
        self.partition = Partition(self.layout)
        self.overlapped = OverlappedStep(len(self.layout.blocks))
        self.fence = StateFence()
        self.materializer = Materializer(model, PretrainedSource(init_from, model) if init_from else None, device)
        self.materializer.check(dict(model.named_parameters()))

        roots = [rank_path(path, rank, world) for path in offload.paths]
        host_update = update.backend == "host"
        needed = planned_storage_bytes(self.layout, self.rule, offload, self.itemsize, host_update,
                                       self.frozen_layout, self.frozen_itemsize)  # fmt: skip
        self._locks: list[StateLock] = []
        try:
            self._build(roots, needed, update)
        except BaseException:
            self._release_locks()
            raise

    def _lock(self, directory: Path, needed: int, key: str) -> None:
        """Check the directory can hold ``needed`` bytes and take it for this run (see ``StateLock``)."""
        prepare_directory(directory, needed, self.cfg.check_free_space, key)
        lock = StateLock(directory, key)
        lock.acquire()
        self._locks.append(lock)

    def _open_store(self, directory: Path, needed: int, key: str, link: str) -> FileStore:
        """Check and lock ``directory`` (config key ``key``), give it its own I/O backend, and count on ``link``."""
        self._lock(directory, needed, key)
        cfg = self.cfg
        settings = IOSettings(cfg.io_backend, cfg.io_threads, cfg.aio_intra_op_parallelism, cfg.aio_block_size,
                              cfg.aio_queue_depth)  # fmt: skip
        backend = backend_for(directory, settings)
        self._backends.append(backend)
        store = FileStore(directory, backend, self.counters, link, cfg.verify_io)
        self._file_stores.append(store)
        return store

    def forget_written(self) -> None:
        """State files were replaced outside the stores (a checkpoint restored): their write sums no longer hold."""
        for store in self._file_stores:
            store.forget_written()

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()

    def _build(self, roots: list[Path], needed: list[int], update: UpdateConfig) -> None:
        offload = self.cfg
        self._backends: list[IOBackend] = []
        self._file_stores: list[FileStore] = []
        stores = [
            self._open_store(root, nbytes, "offload.nvme_path" + (f"[{index}]" if len(roots) > 1 else ""), HOST_LINK)
            for index, (root, nbytes) in enumerate(zip(roots, needed, strict=True))
        ]
        self.root = roots[0]
        self.backend = self._backends[0]
        log.info("smart_infinity storage backend: %s%s", self.backend.name,
                 f"; state striped over {len(roots)} directories" if len(roots) > 1 else "")  # fmt: skip
        disk: FileStore | StripedStore = stores[0] if len(stores) == 1 else StripedStore(stores)
        self.disk = disk
        pin = self.device.type == "cuda"
        param_store: TensorStore = disk if offload.params == "nvme" else HostStore(pin=pin)
        gather_group = dist.new_group() if self.layout.world > 1 else None  # the streamer's all-gathers, apart
        self.params = ParamStreamer(self.layout, param_store, self.param_dtype, self.device, offload.prefetch,
                                    self.partition, disk.allocator if param_store is disk else None,
                                    self.overlapped, gather_group)  # fmt: skip
        # the stores a placement may split between RAM and disk are built first, empty of RAM names, so that
        # ``auto`` sees every buffer pool the engine allocates before it sizes the budget
        budget = self.cfg.host_memory_budget
        placing = budget == "auto" or parse_bytes("offload.host_memory_budget", budget) > 0
        self.frozen = None
        frozen_tier: TieredStore | None = None
        if self.frozen_dtype is not None:  # read only: nothing to wait for, a gather group of its own under DP
            frozen_store: TensorStore = param_store
            if placing and param_store is disk:
                frozen_store = frozen_tier = TieredStore(disk, HostStore(pin=pin), frozenset())
            self.frozen = ParamStreamer(self.frozen_layout, frozen_store, self.frozen_dtype, self.device,
                                        offload.prefetch, Partition(self.frozen_layout),
                                        disk.allocator if param_store is disk else None, None,
                                        dist.new_group() if self.layout.world > 1 else None, kind=FROZEN)  # fmt: skip
        host_update = self.rule is not None and update.backend == "host"
        state_tier = TieredStore(disk, HostStore(), frozenset()) if placing and host_update else None
        self.updater = None
        if self.rule is not None:
            self.updater = self._make_updater(self.rule, update, disk, state_tier)
        grad_tier: TieredStore | None = None
        if isinstance(self.updater, SmartUpdater) and offload.grads == "nvme":  # into the devices' own stores
            grad_store: TensorStore = self.updater.gradient_store()
        elif offload.grads == "nvme" and placing:
            grad_store = grad_tier = TieredStore(disk, HostStore(), frozenset())
        elif offload.grads == "nvme":
            grad_store = disk
        else:
            grad_store = HostStore()
        grad_allocator = None if isinstance(grad_store, HostStore) else disk.allocator  # any page-locked one serves
        self.grads = GradientAccumulator(self.layout, grad_store, offload.step_lookahead, grad_allocator)
        self._grad_flat = aligned_bytes(self.layout.max_block_numel * 4)
        self.placement = self._place(grad_tier is not None, state_tier is not None, frozen_tier is not None)
        if grad_tier is not None and self.placement.grads:
            grad_tier.host_keys = frozenset(sg.key for sg in self.layout.subgroups)
        if state_tier is not None:
            state_tier.host_keys = self.placement.state
        if frozen_tier is not None:
            frozen_tier.host_keys = self.placement.frozen
        self._check_host_memory(needed)
        self._initialize()

    def _place(self, grads: bool, state: bool, frozen: bool) -> HostPlacement:
        """``offload.host_memory_budget``: what of the state lives in host memory (engine/placement.py); ``grads``,
        ``state`` and ``frozen``: whether the gradients, the optimizer state and the frozen weights may go there."""
        setting = self.cfg.host_memory_budget
        if setting == "auto":
            available, reserved = host_available_bytes(), self._reserved_bytes()
            budget = auto_budget(available, self.ranks_per_host, reserved)
            log.info("smart_infinity host memory budget auto: half of %s available%s, less the %s the engine holds "
                     "whatever the budget (pools, resident set, set-up's working set): %s", human_bytes(available),
                     f" shared by {self.ranks_per_host} ranks" if self.ranks_per_host > 1 else "",
                     human_bytes(reserved), human_bytes(budget))  # fmt: skip
        else:
            budget = parse_bytes("offload.host_memory_budget", setting)
        kinds = len(self.rule.states) if self.rule is not None else 0
        placement = place(budget, self.layout, kinds, grads, state, self.frozen_layout if frozen else None,
                          self.frozen_itemsize)  # fmt: skip
        if budget:
            log.info("smart_infinity %s", placement.describe(self.layout, self.frozen_layout))
        return placement

    def _resident_bytes(self) -> int:
        """Host memory of the resident block: its 16-bit copy, its autograd gradients and the fp32 gradient
        gathered from them (on a GPU only the last stays on the host)."""
        numel = self.layout.resident.numel
        return numel * (2 * self.itemsize + 4) if self.device.type == "cpu" else numel * 4

    @property
    def block_pairs(self) -> list[tuple[Block, Block]]:
        """Each block of the layout with its twin in the frozen layout (same index: the same module)."""
        return list(zip(self.layout.blocks, self.frozen_layout.blocks, strict=True))

    @property
    def owned_slots(self) -> list[ParamSlot]:
        """Every parameter the engine owns, block by block: the trainable ones, then the block's frozen ones."""
        return [slot for block, fixed in self.block_pairs for slot in block.slots + fixed.slots]

    def _working_bytes(self) -> int:
        """Set-up's working set: the largest block in its own dtype (frozen parameters too)."""
        return max((sum(s.nbytes for s in b.slots + f.slots) for b, f in self.block_pairs), default=0)

    def _reserved_bytes(self) -> int:
        """Host memory the engine takes whatever the budget: its buffer pools, the resident set, set-up's working
        set."""
        return self.host_memory_bytes + self._resident_bytes() + self._working_bytes()

    def _check_host_memory(self, disk: list[int]) -> None:
        """Say what host memory and disk this run takes, and refuse before writing any state when the memory on
        top of the (already allocated) buffer pools does not fit what the host has left."""
        resident_bytes, working = self._resident_bytes(), self._working_bytes()
        available = host_available_bytes()
        log.info(
            "smart_infinity host memory: buffer pools %s, resident set %s, set-up working set (the largest block in "
            "its own dtype) %s; %s available; state on disk at most %s",
            human_bytes(self.host_memory_bytes), human_bytes(resident_bytes), human_bytes(working),
            human_bytes(available), " + ".join(human_bytes(n) for n in disk),
        )  # fmt: skip
        if resident_bytes + working > available:
            raise HostMemoryError(
                f"smart_infinity needs {human_bytes(resident_bytes + working)} of host memory beyond its buffer pools "
                f"({human_bytes(self.host_memory_bytes)}, allocated): the resident set (embeddings, head, norms: "
                f"{human_bytes(resident_bytes)}) and set-up's largest block ({human_bytes(working)}), but "
                f"{human_bytes(available)} is available: stream more of the model as blocks (offload_blocks()), "
                "train in 16-bit, or free memory"
            )

    # -- set-up -------------------------------------------------------------------------------------------------
    def _make_updater(self, rule: OptimizerRule, update: UpdateConfig, disk: FileStore | StripedStore,
                      tier: TieredStore | None) -> Updater:  # fmt: skip
        """The host update keeps its state in ``tier`` where a host memory budget may place some of it in RAM."""
        if update.backend == "host":
            kernel = load_cpu_adam(update.host_adam) if rule.name in ("adam", "adamw") else None
            return HostUpdater(rule, tier or disk, self.layout.max_subgroup_numel, self.cfg.step_lookahead, kernel)
        if update.wire == "16bit" and self.param_dtype == torch.float32:
            raise ConfigError("update.wire=16bit needs a 16-bit training precision (bf16-mixed or 16-mixed)")
        wire = self.param_dtype if update.wire == "16bit" else torch.float32
        layout = self.layout
        specs = [dataclasses.replace(s, path=str(rank_path(s.path, layout.rank, layout.world))) if s.path else s
                 for s in device_specs(update.devices)]  # fmt: skip
        cfg = self.cfg

        def make_store(directory: Path, link: str, needed: int) -> FileStore:
            return self._open_store(directory, needed, f"update.devices[{link.removeprefix('device')}].path", link)

        on_device = cfg.grads == "nvme"
        compressor = None
        if self.compression.kind == "topk":
            compressor = TopKCompressor(self.compression, self.layout, self.device)
        return SmartUpdater(rule, specs, self.root, make_store, self.counters, self.layout, wire, on_device, compressor)

    def _initialize(self) -> None:
        """Write every block's starting state, one block at a time: its parameters get values where they have
        none (meta) or come from ``init_from``, then its master and 16-bit copies go to storage and its host
        tensors are freed, so set-up holds one block at a time whatever the model's size."""
        self.weights = WeightHandback(self)
        owned = {id(slot.param) for slot in self.owned_slots}
        frozen = [ParamSlot(n, p, 0, p.numel(), p.shape, p.dtype) for n, p in self.model.named_parameters()
                  if id(p) not in owned]  # fmt: skip
        self._share(self.materializer.materialize(frozen, None))
        for slot in frozen:  # frozen ones outside the blocks stay in the module, on the training device
            if slot.param.device != self.device:
                slot.param.data = slot.param.data.to(self.device)
        if self.materializer.pretrained is not None:
            self.materializer.pretrained.fill_buffers(self.model)
        for block, fixed in self.block_pairs:
            self._share(self.materializer.materialize(block.slots + fixed.slots, block))
            if self.updater is not None:
                self.updater.initialize(block.subgroups, self._initial_master)
            self.params.initialize_block(block)
            if self.frozen is not None:
                self.frozen.initialize_block(fixed)
            release_free_heap()
        self.block_forwards = wrap_blocks(self, self.block_modules)

    def _share(self, initialized: list[ParamSlot]) -> None:
        """Data parallel: parameters a rank's init route just filled take rank 0's values (as DDP starts)."""
        if self.layout.world > 1:
            for slot in initialized:
                torch.distributed.broadcast(slot.param.data, 0)

    def _initial_master(self, sg: Subgroup) -> torch.Tensor:
        block = self.layout.blocks[sg.block]
        flat = torch.zeros(sg.numel, dtype=torch.float32)
        for slot in block.slots:
            lo, hi = max(slot.offset, sg.offset), min(slot.offset + slot.numel, sg.offset + sg.numel)
            if lo < hi:
                values = slot.param.data.reshape(-1)[lo - slot.offset : hi - slot.offset]
                flat[lo - sg.offset : hi - sg.offset].copy_(values)
        return flat

    @property
    def compressor(self) -> TopKCompressor | None:
        """SmartComp's compressor when gradients travel compressed (``update=smart``, ``compression=topk``)."""
        return self.updater.compressor if isinstance(self.updater, SmartUpdater) else None

    @property
    def host_memory_bytes(self) -> int:
        """Host memory held by the engine's buffer pools (fixed at set-up)."""
        pools = self.params.host_bytes + self.grads.host_bytes + self._grad_flat.numel()
        pools += self.frozen.host_bytes if self.frozen is not None else 0
        return pools + (getattr(self.updater, "host_bytes", 0) or 0)

    # -- the schedule's hooks (BlockRunner) ------------------------------------------------------------------------
    @property
    def streamers(self) -> list[ParamStreamer]:
        """The trainable parameters' streamer, and the frozen ones' where the blocks have any."""
        return [self.params] if self.frozen is None else [self.params, self.frozen]

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
        with trace.span(f"grads {index}", "grads", block=index):
            flat = typed_view(self._grad_flat, torch.float32, block.numel)
            self._gather_grads(block.slots, flat)
            self.partition.reduce_block(flat, block)
            self.grads.add_block(block, flat)
        self._stream_block(index)

    @staticmethod
    def _gather_grads(slots: list[ParamSlot], flat: torch.Tensor) -> None:
        flat.zero_()
        for slot in slots:
            if slot.param.grad is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(slot.param.grad.reshape(-1))
                slot.param.grad = None

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
        if resident.numel:
            trace.begin("resident grads")
            flat = torch.zeros(resident.numel, dtype=torch.float32)
            self._gather_grads(resident.slots, flat)
            self.partition.reduce_block(flat, resident)
            self.grads.add_block(resident, flat)
            trace.end("resident grads", "grads resident", "grads")
        if self._eager is not None:
            self._eager_norm = float(self.partition.global_norm(self.grads.global_norm()))
        self._stream_block(0)

    # -- eager updates: each block's update starts when its gradient is final (vertical schedule) -----------------
    def begin_eager_step(self) -> None:
        """Open this iteration's update stream; blocks join it from ``collect_block_grads`` as backward finishes
        them, the resident block last. Exact only without clipping and loss scaling (checked by the strategy)."""
        assert self.updater is not None and self.optimizer is not None and self.scaler is None
        self.wait_step()
        self.step_count += 1
        ctx = StepContext(self.step_count, hyperparameters(self.optimizer))
        self._eager = queue.Queue()
        stream = self._eager
        self.overlapped.start(lambda: self._apply(ctx, iter(stream.get, None)))

    def _stream_block(self, index: int) -> None:
        if self._eager is None:
            return
        block = self.layout.blocks[index]
        if block.subgroups:
            self.overlapped.stale(index)  # its parameters go stale until its update lands
        for sg in block.subgroups:
            self._eager.put(sg)
        if block.resident:  # backward is over: the stream is complete
            self._eager.put(None)

    def _inverse_scale(self) -> float:
        """GradScaler's fp32 reciprocal of the loss scale (1 without one), which clip_grad_norm_'s fp32 coefficient
        then sees applied to the norm."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())

    def gradient_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients accumulated since the last step, unscaled: what clipping compares
        with (a collective under data parallelism: every rank calls it)."""
        return self.partition.global_norm(self.grads.global_norm()) * self._inverse_scale()

    def step(self) -> StepResult:
        """Apply one optimizer step to every subgroup (or skip it on fp16 overflow), then reset the gradients."""
        with trace.span("optimizer step", "step", overlap=self.overlap):
            return self._step()

    def _step(self) -> StepResult:
        if self.updater is None or self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer")
        if self._eager is not None:  # the update has been running since backward began
            self._eager = None
            self.micro_batches = 0
            self._wait_overlapped()
            return StepResult(True, self._eager_norm, 1.0)
        self.wait_step()
        self.params.release_all()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        inv_scale = self._inverse_scale()
        norm = self.gradient_norm()
        found_inf = not bool(torch.isfinite(norm))
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if found_inf:
                self.grads.reset()
                self.micro_batches = 0
                return StepResult(False, float(norm), scale)
        clip_coef = 1.0
        if self.clip_norm is not None and self.clip_norm > 0:
            clip_coef = float(torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0))
        self.step_count += 1
        ctx = StepContext(self.step_count, hyperparameters(self.optimizer), inv_scale, clip_coef)
        self.micro_batches = 0
        if self.overlap == 0.0:
            self._apply(ctx)
            self.params.gather_resident()
        else:
            self._start_overlapped(ctx)
        return StepResult(True, float(norm), scale)

    def _apply(self, ctx: StepContext, subgroups: Iterable[Subgroup] | None = None) -> None:
        """Stream subgroups (default: all, in forward order) through the updater, publishing each block when done."""
        assert self.updater is not None
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

    def _start_overlapped(self, ctx: StepContext) -> None:
        """Run the step on a thread; return once the resident block and (1 - overlap) of the elements are done."""
        for block in self.layout.blocks:  # cleared here, before the caller can start the next forward
            if block.subgroups:
                self.overlapped.stale(block.index)
        self.overlapped.start(lambda: self._apply(ctx))
        self._wait_overlapped()

    def _wait_overlapped(self) -> None:
        with trace.span("wait for the step's non-overlapped share", "update-wait"):
            self.overlapped.wait_share((1.0 - self.overlap) * self.layout.local_numel)
        with trace.span("wait for the resident update", "update-wait"):
            self.overlapped.wait_block(0)  # the resident layers run first and outside the block hooks
        self.params.gather_resident()

    def wait_step(self) -> None:
        """Block until an overlapped step has finished (before checkpoints, reads of the masters, shutdown)."""
        self.overlapped.join()

    def republish_params(self) -> None:
        """Rewrite every 16-bit parameter from its fp32 master (after the masters were restored)."""
        assert self.updater is not None
        self.wait_step()
        self.params.release_all()
        for sg in self.layout.subgroups:
            self.params.store_update(sg, self.updater.read_master(sg))
        self.params.flush()
        self.params.gather_resident()

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
        unwrap_blocks(self.block_modules)
        if self.updater is not None:
            self.updater.close()
        self.grads.close()
        for streamer in self.streamers:
            streamer.close()
        for backend in self._backends:
            backend.close()
        self._release_locks()
