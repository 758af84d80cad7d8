"""SmartUpdate: the optimizer update on near-storage devices, so optimizer state never crosses the host link.

Each device owns the subgroups assigned to it round-robin and keeps their fp32 master and optimizer state in its
own directory, which it reads and writes over its internal link (counted as ``device<k>``). Per subgroup the host
link carries only the gradient in and the updated parameters out (``update.wire``: fp32, or 16-bit).

The transfer handler: every device has two fixed slots of buffers, sized by the largest subgroup and allocated once
(page-aligned host memory wrapped with ``CL_MEM_USE_HOST_PTR``, so O_DIRECT reads land in the device buffer, as a
SmartSSD's P2P buffer would). While the kernel updates one slot, the next subgroup's state loads into the other;
updated parameters go back to the trainer first, and the state write-back is deferred and overlaps the next load.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_smartinf.compress.topk import VALUE_DTYPES, SparseGradient, TopKCompressor, max_nnz
from lightning_smartinf.config import CompressionConfig
from lightning_smartinf.core import GRAD, HOST_LINK, MASTER, PARAM, Layout, StepContext, Subgroup, device_link
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.extras import require
from lightning_smartinf.storage.aligned import Allocator, align_up, aligned_bytes, allocated_bytes, typed_view
from lightning_smartinf.storage.counters import READ, WRITE, TrafficCounters
from lightning_smartinf.storage.store import FileStore, RoutedStore
from lightning_smartinf.update import quant8
from lightning_smartinf.update.arguments import DENSE, KERNEL_ARGUMENTS, catch_up_scalars, kernel_scalars
from lightning_smartinf.update.base import GradientSource
from lightning_smartinf.update.device_state import DeviceQuantizer
from lightning_smartinf.update.messages import (
    EndOfStep,
    Failed,
    Inbound,
    Job,
    NoGradient,
    Outbound,
    SentGradient,
    StepFinished,
    Stop,
    StoredGradient,
    Updated,
)
from lightning_smartinf.update.opencl import (
    KERNEL_SOURCE,
    SMART_NEEDS,
    SPARSE_SOURCE,
    DeviceSpec,
    NamedKernel,
    build_program,
    launch_shape,
    open_device,
)
from lightning_smartinf.update.optimizers import LAST_STEP, OptimizerRule

UPDATED = "updated_param"
"""Kind of the parameters a device sends back (Smart-Infinity's 'updated params' on the host link)."""
INDEX, VALUE, SQUARE = "grad_index", "grad_value", "grad_square"
"""Kinds of a compressed gradient on the host link."""


SLOTS = 2
"""Host buffer sets per device: one job being updated while the next one's data arrives."""


class _Slot:
    """One fixed set of device buffers: master, optimizer state, gradient in, parameters out."""

    def __init__(self, cl: Any, context: Any, rule: OptimizerRule, numel: int, grad_dtype: torch.dtype,
                 param_dtype: torch.dtype, max_nnz: int, squares: bool, allocator: Allocator,
                 state_bytes: int) -> None:  # fmt: skip
        sizes = self.sizes(rule, numel, grad_dtype, param_dtype, max_nnz, squares, state_bytes)
        self.allocator = allocator  # the device store's: page-locked, so its aio reads and writes need no bounce
        self.host = {kind: allocator.allocate(size) for kind, size in sizes.items()}
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR
        self.buffers = {kind: cl.Buffer(context, flags, hostbuf=raw.numpy()) for kind, raw in self.host.items()}
        self.maps: list[Any] = []
        self.writes: list[Future[None]] = []
        self.sg: Subgroup | None = None
        self.wide: dict[str, Any] = {}
        """8-bit state: each state kind widened to fp32, in device memory (update/device_state.py)."""

    @staticmethod
    def sizes(rule: OptimizerRule, numel: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, max_nnz: int,
              squares: bool, state_bytes: int) -> dict[str, int]:  # fmt: skip
        """Bytes of each of its host buffers (``state_bytes``: of each state kind's, ``quant8.largest_payload``)."""
        sizes = {MASTER: 4 * numel, **{k: state_bytes for k in rule.state_kinds}}
        sizes[GRAD] = torch.empty((), dtype=grad_dtype).element_size() * numel
        sizes[PARAM] = torch.empty((), dtype=param_dtype).element_size() * numel
        if max_nnz:  # SmartComp: int32 indices and 16-bit values in, decompressed into "grad"
            sizes[INDEX], sizes[VALUE] = 4 * max_nnz, 2 * max_nnz
            if squares:  # catch-up: the sums of squares travel too
                sizes[SQUARE] = 2 * max_nnz
        return sizes

    def map(self, cl: Any, queue_: Any) -> None:
        """Hand the buffers to the host (with USE_HOST_PTR the host memory then holds the device's latest bits)."""
        flags = cl.map_flags.READ | cl.map_flags.WRITE
        self.maps = [cl.enqueue_map_buffer(queue_, buf, flags, 0, (raw.numel(),), np.uint8)[0]
                     for buf, raw in zip(self.buffers.values(), self.host.values(), strict=True)]  # fmt: skip
        queue_.finish()

    def unmap(self, queue_: Any) -> None:
        for mapped in self.maps:
            mapped.base.release(queue_)
        self.maps = []

    def wait_writes(self) -> None:
        writes, self.writes = self.writes, []
        for write in writes:
            write.result()

    def close(self, queue_: Any) -> None:
        """Unmap and release the device buffers, then free the host memory under them."""
        self.wait_writes()
        self.unmap(queue_)
        queue_.finish()
        for buffer in self.buffers.values():
            buffer.release()
        self.buffers = {}
        for raw in self.host.values():
            self.allocator.free(raw)
        self.host = {}


class NearStorageDevice:
    """An OpenCL device, the directory it owns, and a worker thread running its transfer handler."""

    def __init__(self, index: int, spec: DeviceSpec, directory: Path, rule: OptimizerRule, store: FileStore,
                 max_numel: int, wire_dtype: torch.dtype, compression: CompressionConfig | None,
                 outbox: queue.Queue[Outbound], precision: str, state_bytes: int) -> None:  # fmt: skip
        """``wire_dtype`` is both the gradient's dtype in and the parameters' dtype out; ``precision``: of the
        optimizer state in the device's files (``offload.state_precision``; with ``8bit``, the subgroups that keep
        fp32 state step as with ``fp32``); ``state_bytes``: of each state buffer."""
        cl = require("pyopencl", SMART_NEEDS)

        grad_dtype = param_dtype = wire_dtype

        self.cl, self.index, self.rule, self.store = cl, index, rule, store
        self.directory = directory
        self.host_view = FileStore(store.root, store.backend, store.counters, HOST_LINK)
        """The same directory as seen by the trainer, whose writes cross the host link."""
        self.device, self.context, self.program = open_device(spec, grad_dtype, param_dtype)
        self.queue = cl.CommandQueue(self.context)
        dense = rule.name if rule.name != "adamw" else "adam"
        self.kernel = NamedKernel(self.program, dense, KERNEL_SOURCE, KERNEL_ARGUMENTS[dense])
        nnz = 0
        if compression is not None:
            values = VALUE_DTYPES[compression.value_dtype]
            sparse = build_program(self.context, self.device, values, values, None, SPARSE_SOURCE)
            self.zero_fill, self.scatter, self.decay, self.catch_up = (
                NamedKernel(sparse, name, SPARSE_SOURCE, KERNEL_ARGUMENTS[name])
                for name in ("zero_fill", "scatter", "adam_decay", "adam_catch_up")
            )
            nnz = max_nnz(max_numel, compression)
        squares = compression is not None and compression.catch_up
        self.precision = precision
        self.quantizer = DeviceQuantizer(cl, self.context, self.device) if precision == quant8.INT8 else None
        self.slots = [_Slot(cl, self.context, rule, max_numel, grad_dtype, param_dtype, nnz, squares,
                            store.allocator, state_bytes) for _ in range(SLOTS)]  # fmt: skip
        if self.quantizer is not None:
            for slot in self.slots:
                slot.wide = self.quantizer.wide_buffers(rule.state_kinds, max_numel)
        for slot in self.slots:
            slot.map(cl, self.queue)
        self.grad_dtype, self.param_dtype = grad_dtype, param_dtype
        self.inbox: queue.Queue[Inbound] = queue.Queue(maxsize=1)
        """One job at a time: the trainer's hand-off blocks while the device holds a job it has not started."""
        self.outbox = outbox
        """Shared by the updater's devices; never bounded, so the handler never waits on the trainer."""
        self.link = device_link(index)
        self._thread = threading.Thread(target=self._run, name=f"smartinf-{self.link}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return f"{self.link}: {self.device.name} ({self.directory})"

    @property
    def host_bytes(self) -> int:
        return sum(raw.numel() for slot in self.slots for raw in slot.host.values())

    # -- the transfer handler, on the device's own thread --------------------------------------------------------
    def _quantized(self, sg: Subgroup) -> bool:
        """Whether ``sg``'s state is 8-bit (the device widens and quantizes it around the optimizer kernel)."""
        return self.quantizer is not None and sg.precision == quant8.INT8

    def _run(self) -> None:
        previous: tuple[_Slot, Any] | None = None
        turn = 0
        while True:
            job = self.inbox.get()
            if isinstance(job, Stop):
                return
            try:
                if isinstance(job, EndOfStep):  # finish the subgroup in flight
                    if previous is not None:
                        self._finish(*previous)
                        previous = None
                    self.outbox.put(StepFinished(self.index))
                    continue
                slot = self.slots[turn % 2]
                turn += 1
                slot.wait_writes()  # its last subgroup's deferred state write-back
                reads = self._load(slot, job)
                if previous is not None:  # the load above overlaps the previous kernel
                    self._finish(*previous)
                for read in reads:
                    read.result()
                slot.unmap(self.queue)
                previous = (slot, self._launch(slot, job))
            except BaseException as err:  # noqa: BLE001 - surfaced to the trainer's thread
                previous = None
                self.outbox.put(Failed(self.index, err))

    def _launch(self, slot: _Slot, job: Job) -> Any:
        """Enqueue the subgroup's kernels (one in-order queue) and return the last one's event."""
        b, n = slot.buffers, np.uint32(job.sg.numel)
        sparse = job.gradient
        if self.quantizer is not None and self._quantized(job.sg):  # 8-bit state: widened, stepped, quantized back
            for spec in self.rule.states:
                init = spec.init if job.ctx.step == 1 else None
                self.quantizer.widen(self.queue, b[spec.kind], slot.wide[spec.kind], spec.kind, job.sg.numel, init)
        if not isinstance(sparse, SparseGradient):
            return self._narrow(slot, job, self.kernel(self.queue, *launch_shape(job.sg.numel),
                                                       **self._arguments(slot, job)))  # fmt: skip
        nnz = np.uint32(sparse.indices.numel())
        received = {"index": b[INDEX], "value": b[VALUE], "nnz": nnz}
        if sparse.squares is not None:  # catch-up: decay every element, then move the received ones
            decay, *scalars = job.scalars
            self.decay(self.queue, (job.sg.numel,), None, master=b[MASTER], param_out=b[PARAM], n=n, decay=decay)
            state = {kind: b[kind] for kind in self.rule.state_kinds}  # exp_avg, exp_avg_sq, last_step
            hyper = dict(zip(self.catch_up.arguments[10:], scalars, strict=True))  # beta1 ... bc2_sqrt
            return self.catch_up(self.queue, (int(nnz),), None, master=b[MASTER], **state, param_out=b[PARAM], n=n,
                                 **received, square=b[SQUARE], **hyper)  # fmt: skip
        # decompress: zero-fill, scatter, then the optimizer kernel on the dense gradient
        self.zero_fill(self.queue, (job.sg.numel,), None, grad=b[GRAD], n=n)
        self.scatter(self.queue, (int(nnz),), None, grad=b[GRAD], n=n, **received)
        return self._narrow(slot, job, self.kernel(self.queue, *launch_shape(job.sg.numel),
                                                   **self._arguments(slot, job)))  # fmt: skip

    def _narrow(self, slot: _Slot, job: Job, event: Any) -> Any:
        """8-bit state: quantize the stepped state back into the buffers written to storage; the last event."""
        if self.quantizer is None or not self._quantized(job.sg):
            return event
        for kind in self.rule.state_kinds:
            event = self.quantizer.narrow(self.queue, slot.wide[kind], slot.buffers[kind], kind, job.sg.numel)
        return event

    def _load(self, slot: _Slot, job: Job) -> list[Future[None]]:
        sg, first = job.sg, job.ctx.step == 1
        slot.sg = sg
        reads = [self.store.read(MASTER, sg.key, slot.host[MASTER], sg.numel * 4)]
        state_bytes = quant8.payload(sg.numel, sg.precision)
        for spec in self.rule.states:
            if first:
                if not self._quantized(sg):  # 8-bit state starts on the device (DeviceQuantizer.widen)
                    typed_view(slot.host[spec.kind], torch.float32, sg.numel).fill_(spec.init)
            else:
                reads.append(self.store.read(spec.kind, sg.key, slot.host[spec.kind], state_bytes))
        grad = typed_view(slot.host[GRAD], self.grad_dtype, sg.numel)
        match job.gradient:
            case SparseGradient() as sparse:  # indices and values over the host link, scattered on the device
                nnz = sparse.indices.numel()
                typed_view(slot.host[INDEX], torch.int32, nnz).copy_(sparse.indices)
                typed_view(slot.host[VALUE], sparse.values.dtype, nnz).copy_(sparse.values)
                self.store.counters.add(HOST_LINK, INDEX, WRITE, nnz * 4)
                self.store.counters.add(HOST_LINK, VALUE, WRITE, nnz * sparse.values.element_size())
                if sparse.squares is not None:
                    typed_view(slot.host[SQUARE], sparse.squares.dtype, nnz).copy_(sparse.squares)
                    self.store.counters.add(HOST_LINK, SQUARE, WRITE, nnz * sparse.squares.element_size())
            case SentGradient(values):  # over the host link now
                grad.copy_(values)
                self.store.counters.add(HOST_LINK, GRAD, WRITE, values.numel() * values.element_size())
            case StoredGradient():  # written into this device's directory during backward; read over its own link
                reads.append(self.store.read(GRAD, sg.key, slot.host[GRAD], sg.numel * 4))
            case NoGradient():
                grad.zero_()
        return reads

    def _arguments(self, slot: _Slot, job: Job) -> dict[str, Any]:
        """The dense kernel's arguments by name. Its state parameters take the rule's state buffers in order; one
        the rule has none for (SGD without momentum) gets the master buffer, which the kernel then never reads."""
        b, names = slot.buffers, self.kernel.arguments
        state_params = names[1 : names.index("grad")]
        state = [(slot.wide if self._quantized(job.sg) else b)[kind] for kind in self.rule.state_kinds
                 if kind != LAST_STEP]
        state += [b[MASTER]] * (len(state_params) - len(state))
        scalars = names[len(DENSE) + len(state_params) :]
        return {"master": b[MASTER], **dict(zip(state_params, state, strict=True)), "grad": b[GRAD],
                "param_out": b[PARAM], "n": np.uint32(job.sg.numel), "inv_scale": np.float32(job.ctx.inv_scale),
                "clip_coef": np.float32(job.ctx.clip_coef), **dict(zip(scalars, job.scalars, strict=True))}  # fmt: skip

    def _finish(self, slot: _Slot, event: Any) -> None:
        """Kernel done: parameters back to the trainer first, then the deferred state write-back."""
        event.wait()
        slot.map(self.cl, self.queue)
        sg = slot.sg
        assert sg is not None
        params = typed_view(slot.host[PARAM], self.param_dtype, sg.numel).clone()
        self.store.counters.add(HOST_LINK, UPDATED, READ, params.numel() * params.element_size())
        self.outbox.put(Updated(sg, params))
        state_bytes = quant8.payload(sg.numel, sg.precision)
        slot.writes.append(self.store.write(MASTER, sg.key, slot.host[MASTER], sg.numel * 4))
        for kind in self.rule.state_kinds:
            slot.writes.append(self.store.write(kind, sg.key, slot.host[kind], state_bytes))

    def drain(self) -> None:
        for slot in self.slots:
            slot.wait_writes()

    def close(self) -> None:
        """Stop the transfer handler, then free the slots (their memory is page-locked)."""
        self.inbox.put(Stop())
        self._thread.join()
        for slot in self.slots:
            slot.close(self.queue)
            if self.quantizer is not None:
                self.quantizer.release(slot.wide)
        self.slots = []


def wire_dtype(wire: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients and parameters cross the host link in (``update.wire``: ``16bit`` sends the training
    precision, else fp32)."""
    return param_dtype if wire == "16bit" else torch.float32


class SmartUpdater:
    """Streams each subgroup's gradient to the device that owns it and gets its updated parameters back."""

    @staticmethod
    def planned_host_bytes(rule: OptimizerRule, devices: int, max_numel: int, wire_dtype: torch.dtype,
                           compression: CompressionConfig | None, state_bytes: int) -> int:  # fmt: skip
        """``host_bytes`` before any device is opened: each device's slots of host buffers (``state_bytes``: of
        each state buffer, ``quant8.largest_payload``)."""
        nnz = max_nnz(max_numel, compression) if compression is not None else 0
        squares = compression is not None and compression.catch_up
        sizes = _Slot.sizes(rule, max_numel, wire_dtype, wire_dtype, nnz, squares, state_bytes)
        return devices * SLOTS * sum(allocated_bytes(n) for n in sizes.values())

    def __init__(
        self,
        rule: OptimizerRule,
        specs: Sequence[DeviceSpec],
        root: Path,
        make_store: Callable[[Path, str, int], FileStore],
        counters: TrafficCounters,
        layout: Layout,
        wire_dtype: torch.dtype,
        grads_on_device: bool,
        compressor: TopKCompressor | None = None,
        precision: str = quant8.FP32,
    ) -> None:
        self.rule = rule
        self.precision = precision
        """Of the optimizer state in the devices' files (``offload.state_precision``)."""
        if precision != quant8.FP32 and compressor is not None and compressor.cfg.catch_up:
            raise ConfigError(f"offload.state_precision={precision} with compression.catch_up=true: the catch-up "
                              "kernel keeps fp32 state; set compression.catch_up=false or offload.state_precision=fp32")
        self.compressor = compressor
        self.grads_on_device = grads_on_device
        self.counters = counters
        self.wire_dtype = wire_dtype
        self.devices: list[NearStorageDevice] = []
        self.outbox: queue.Queue[Outbound] = queue.Queue()
        owned = [0] * len(specs)
        for sg in layout.subgroups:
            state = align_up(quant8.payload(sg.numel, sg.precision)) * len(rule.states)
            owned[sg.index % len(specs)] += align_up(sg.numel * 4) * (1 + grads_on_device) + state
        for k, spec in enumerate(specs):
            directory = Path(spec.path).expanduser().resolve() if spec.path else root / device_link(k)
            store = make_store(directory, device_link(k), owned[k])
            compression = compressor.cfg if compressor is not None else None
            self.devices.append(NearStorageDevice(k, spec, directory, rule, store, layout.max_subgroup_numel,
                                                  wire_dtype, compression, self.outbox, precision,
                                                  quant8.largest_payload(layout.subgroups)))  # fmt: skip
        self._routes = {sg.key: self.owner(sg).host_view for sg in layout.subgroups}
        wire = "fp32" if wire_dtype == torch.float32 else str(wire_dtype).replace("torch.", "")
        eight = "; 8-bit state" if precision == quant8.INT8 else ""
        self.name = (f"smart ({len(self.devices)} OpenCL device(s): {self.devices[0].device.name}; {wire} on the "
                     f"wire{eight})")  # fmt: skip
        if compressor is not None:
            self.name += f"; SmartComp {compressor.describe()}"

    @property
    def host_bytes(self) -> int:
        return sum(d.host_bytes for d in self.devices)

    def owner(self, sg: Subgroup) -> NearStorageDevice:
        return self.devices[sg.index % len(self.devices)]

    def gradient_store(self) -> RoutedStore:
        """Where the trainer writes accumulated gradients: each into its owning device's directory, over the host
        link; the device then reads it over its own link during the step."""
        return RoutedStore(dict(self._routes))

    def initialize(self, subgroups: Sequence[Subgroup], master_of: Callable[[Subgroup], torch.Tensor]) -> None:
        for sg in subgroups:
            raw = aligned_bytes(sg.numel * 4)
            typed_view(raw, torch.float32, sg.numel).copy_(master_of(sg))
            self.owner(sg).store.write(MASTER, sg.key, raw, sg.numel * 4).result()

    def step(
        self, subgroups: Iterable[Subgroup], grads: GradientSource, ctx: StepContext
    ) -> Iterator[tuple[Subgroup, torch.Tensor]]:
        compressor = self.compressor if self.compressor and ctx.step > self.compressor.cfg.warmup_steps else None
        if compressor is not None and compressor.cfg.catch_up:  # every job this step runs the catch-up kernels
            start = compressor.cfg.warmup_steps
            scalar_sets = [catch_up_scalars(self.rule, hyper, ctx.step, start) for hyper in ctx.hyper]
        else:
            scalar_sets = [kernel_scalars(self.rule, hyper, ctx.step) for hyper in ctx.hyper]
        pending = 0
        grads.sync()
        for sg in subgroups:
            scalars = scalar_sets[sg.param_group]
            if self.grads_on_device:
                grads.sync()  # its gradient file is complete (subgroups may arrive while backward still runs)
                job = Job(sg, StoredGradient() if grads.holds(sg) else NoGradient(), ctx, scalars)
            else:
                grad = grads.fetch(sg).result()
                if compressor is not None:
                    job = Job(sg, compressor.compress(sg, grad, ctx), ctx, scalars)
                else:
                    job = Job(sg, SentGradient(grad.to(self.wire_dtype, copy=True)), ctx, scalars)
                grads.release(sg)
            self.owner(sg).inbox.put(job)  # blocks while that device still holds a job it has not started
            pending += 1
            while pending and not self.outbox.empty():  # what finished meanwhile goes back to the trainer now
                pending -= 1
                yield self._receive(self.outbox.get())
        for device in self.devices:
            device.inbox.put(EndOfStep())
        finished = 0
        while finished < len(self.devices) or pending:
            message = self.outbox.get()
            if isinstance(message, StepFinished):
                finished += 1
                continue
            pending -= 1
            yield self._receive(message)
        for device in self.devices:  # the step is durable (and write errors surface) before it returns
            device.drain()

    @staticmethod
    def _receive(message: Outbound) -> tuple[Subgroup, torch.Tensor]:
        match message:
            case Updated(sg, params):
                return sg, params
            case Failed(device, error):
                raise RuntimeError(f"near-storage device {device} failed: {error}") from error
        raise AssertionError(f"unexpected {message} before the step's end")

    def read_master(self, sg: Subgroup) -> torch.Tensor:
        raw = aligned_bytes(sg.numel * 4)
        self.owner(sg).store.read(MASTER, sg.key, raw, sg.numel * 4).result()
        return typed_view(raw, torch.float32, sg.numel).clone()

    def state_directories(self) -> list[Path]:
        return [d.directory for d in self.devices]

    def close(self) -> None:
        for device in self.devices:
            device.drain()
        for device in self.devices:
            device.close()
