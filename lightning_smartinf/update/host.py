"""ZeRO-Infinity's update: master and optimizer state stream storage -> host memory -> CPU math -> storage.

Per subgroup the host link carries 4 B/param of gradient plus 12 B/param (Adam: master, exp_avg, exp_avg_sq) each
way; with ``offload.state_precision=8bit`` the state tensors travel block-wise quantized (update/quant8.py), about
6 B/param, and are widened to fp32 only for the update's math. The next ``lookahead`` subgroups' state is read while
the current one updates, and write-backs complete in the background; buffers come from two fixed pools, one for the
masters and one for the state sized for the largest state tensor (a quarter of fp32's with 8-bit state), so host
memory does not grow with the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf import trace
from lightning_smartinf.core import MASTER, StepContext, Subgroup
from lightning_smartinf.storage.aligned import BufferPool, align_up, typed_view
from lightning_smartinf.storage.store import FileStore, HostStore, StripedStore, TieredStore, in_host_memory
from lightning_smartinf.update import quant8
from lightning_smartinf.update.base import GradientSource
from lightning_smartinf.update.cpu_adam import DeepSpeedCPUAdamKernel
from lightning_smartinf.update.optimizers import OptimizerRule, torch_update


def _zero_padding(raw: torch.Tensor, payload: int) -> None:
    """Zero a pooled buffer's bytes between the payload and the aligned end that an O_DIRECT write stores: what an
    earlier subgroup left there would make state files, and checkpoints, differ from run to run."""
    raw[payload : align_up(payload)].zero_()


class _Loaded:
    """A subgroup's master and state buffers, with the reads that fill them: pooled buffers for state on storage,
    or (``host``) the stored tensors themselves for state in host memory, updated in place. ``sizes``: each kind's
    payload in bytes; ``pool_of``: the pool each kind's buffer comes from."""

    def __init__(self, sg: Subgroup, sizes: dict[str, int], pool_of: Callable[[str], BufferPool],
                 host: HostStore | None = None) -> None:  # fmt: skip
        self.sg = sg
        self.sizes = sizes
        self.in_place = host is not None
        if host is not None:
            self.raw = {kind: host.slot(kind, sg.key, size) for kind, size in sizes.items()}
        else:
            self.raw = {kind: pool_of(kind).acquire(size) for kind, size in sizes.items()}
        self.reads: list[Future[None]] = []

    def tensor(self, kind: str) -> torch.Tensor:
        return typed_view(self.raw[kind], torch.float32, self.sg.numel)


class HostUpdater:
    """The optimizer update on the CPU, with state in a ``TensorStore``."""

    def __init__(
        self,
        rule: OptimizerRule,
        store: FileStore | StripedStore | TieredStore,
        max_subgroup_numel: int,
        lookahead: int,
        adam_kernel: DeepSpeedCPUAdamKernel | None,
        precision: str = quant8.FP32,
        state_bytes: int | None = None,
    ) -> None:
        """``state_bytes``: of the largest state tensor (``quant8.largest_payload`` of the subgroups; None: fp32's
        of the largest subgroup)."""
        self.rule = rule
        self.precision = precision
        """Of the optimizer state (``offload.state_precision``): ``fp32``, or ``8bit`` (block-wise quantized)."""
        self._max_numel = max_subgroup_numel
        self._wide: dict[str, torch.Tensor] = {}
        """8-bit state widened to fp32 for torch's math, where the fused kernel is not built (made at first use; the
        update runs on one thread, a subgroup at a time)."""
        self.store = store
        self.lookahead = lookahead
        self.adam_kernel = adam_kernel
        state_bytes = 4 * max_subgroup_numel if state_bytes is None else state_bytes
        (masters, master_bytes), *state = self.pool_shapes(rule, max_subgroup_numel, state_bytes, lookahead)
        self.pool = BufferPool(masters, master_bytes, allocator=store.allocator)
        """The masters' buffers."""
        self.state_pool = BufferPool(*state[0], allocator=store.allocator) if state else None
        """The optimizer state's buffers (None: a rule without state)."""
        kernel = "deepspeed cpu_adam" if adam_kernel and rule.name in ("adam", "adamw") else f"torch {rule.name}"
        if precision == quant8.INT8:
            compiled = quant8.kernel()
            kernel = (f"{rule.name} fused with 8-bit state, {compiled.isa()} gathers" if compiled
                      else f"torch {rule.name}, 8-bit state")  # fmt: skip
        self.name = f"host ({kernel})"

    @staticmethod
    def pool_shapes(rule: OptimizerRule, max_subgroup_numel: int, state_bytes: int,
                    lookahead: int) -> list[tuple[int, int]]:  # fmt: skip
        """(buffers, bytes each) of the masters' pool, then of the state's (where the rule has state), for the
        subgroups in flight (``lookahead`` being read, one updating, one being written back)."""
        flight = lookahead + 2
        shapes = [(flight, max_subgroup_numel * 4)]
        if rule.states:
            shapes.append((flight * len(rule.states), state_bytes))
        return shapes

    def _pool_of(self, kind: str) -> BufferPool:
        pool = self.pool if kind == MASTER else self.state_pool
        assert pool is not None, kind
        return pool

    @property
    def host_bytes(self) -> int:
        return self.pool.total_bytes + (self.state_pool.total_bytes if self.state_pool is not None else 0)

    def initialize(self, subgroups: Sequence[Subgroup], master_of: Callable[[Subgroup], torch.Tensor]) -> None:
        for sg in subgroups:
            raw = self.pool.acquire(sg.numel * 4)
            typed_view(raw, torch.float32, sg.numel).copy_(master_of(sg))
            _zero_padding(raw, sg.numel * 4)
            self.store.write(MASTER, sg.key, raw, sg.numel * 4).result()
            self.pool.release(raw)

    def _sizes(self, sg: Subgroup) -> dict[str, int]:
        state = quant8.payload(sg.numel, sg.precision)
        return {MASTER: sg.numel * 4, **{kind: state for kind in self.rule.state_kinds}}

    def _load(self, sg: Subgroup, first_step: bool) -> _Loaded:
        host = in_host_memory(self.store, sg.key)
        loaded = _Loaded(sg, self._sizes(sg), self._pool_of, host)
        if host is None:
            loaded.reads.append(self.store.read(MASTER, sg.key, loaded.raw[MASTER], sg.numel * 4))
        for spec in self.rule.states:
            size = loaded.sizes[spec.kind]
            if first_step:
                if sg.precision == quant8.FP32:
                    loaded.tensor(spec.kind).fill_(spec.init)
                _zero_padding(loaded.raw[spec.kind], size)
            elif host is None:
                loaded.reads.append(self.store.read(spec.kind, sg.key, loaded.raw[spec.kind], size))
        return loaded

    def _write_back(self, loaded: _Loaded, writes: list[Future[None]]) -> None:
        if loaded.in_place:  # updated where it is stored
            return
        for kind, raw in loaded.raw.items():
            future = self.store.write(kind, loaded.sg.key, raw, loaded.sizes[kind])
            future.add_done_callback(self._releaser(kind, raw))
            writes.append(future)

    def _releaser(self, kind: str, raw: torch.Tensor) -> Callable[[Future[None]], None]:
        pool = self._pool_of(kind)
        return lambda _future: pool.release(raw)

    def _state(self, loaded: _Loaded, first_step: bool) -> dict[str, torch.Tensor]:
        """The subgroup's state as fp32 tensors: its buffers themselves, or 8-bit state widened."""
        if loaded.sg.precision == quant8.FP32:
            return {kind: loaded.tensor(kind) for kind in self.rule.state_kinds}
        numel = loaded.sg.numel
        if not self._wide:
            self._wide = {spec.kind: torch.empty(self._max_numel) for spec in self.rule.states}
        wide = {spec.kind: self._wide[spec.kind][:numel] for spec in self.rule.states}
        for spec in self.rule.states:
            if first_step:
                wide[spec.kind].fill_(spec.init)
            else:
                quant8.dequantize(loaded.raw[spec.kind], numel, quant8.is_signed(spec.kind), wide[spec.kind])
        return wide

    def _apply(self, loaded: _Loaded, grad: torch.Tensor, ctx: StepContext) -> None:
        hyper = ctx.hyper[loaded.sg.param_group]
        ctx.prepare(grad)
        master = loaded.tensor(MASTER)
        quantized = loaded.sg.precision == quant8.INT8
        if quantized:
            raw = {kind: loaded.raw[kind] for kind in self.rule.state_kinds}
            inits = {spec.kind: spec.init for spec in self.rule.states}
            if quant8.fused_step(self.rule, master, grad, raw, hyper, ctx.step, inits):
                return
        state = self._state(loaded, ctx.step == 1)
        self._math(master, grad, state, hyper, ctx)
        if quantized:
            for kind, values in state.items():
                quant8.quantize(values, quant8.is_signed(kind), loaded.raw[kind])

    def _math(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict[str, Any],
              ctx: StepContext) -> None:  # fmt: skip
        if self.adam_kernel is not None and self.rule.name in ("adam", "adamw"):
            self.adam_kernel.update(
                self.rule.name == "adamw", master, grad, state["exp_avg"], state["exp_avg_sq"], hyper, ctx.step
            )
        else:
            torch_update(self.rule, master, grad, state, hyper, ctx.step)

    def step(
        self, subgroups: Iterable[Subgroup], grads: GradientSource, ctx: StepContext
    ) -> Iterator[tuple[Subgroup, torch.Tensor]]:
        first = ctx.step == 1
        queue: deque[tuple[_Loaded, Future[torch.Tensor]]] = deque()
        writes: list[Future[None]] = []
        upcoming = iter(subgroups)
        for sg in upcoming:
            queue.append((self._load(sg, first), grads.fetch(sg)))
            if len(queue) > self.lookahead:
                break
        current: _Loaded | None = None
        try:
            while queue:
                current, grad_future = queue.popleft()
                nxt = next(upcoming, None)
                if nxt is not None:
                    queue.append((self._load(nxt, first), grads.fetch(nxt)))
                with trace.span(f"wait for {current.sg.key}'s state and gradient", "wait"):
                    for read in current.reads:
                        read.result()
                    grad = grad_future.result()
                with trace.span(f"update {current.sg.key}", "update", elements=current.sg.numel):
                    self._apply(current, grad, ctx)
                grads.release(current.sg)
                loaded, current = current, None
                self._write_back(loaded, writes)
                yield loaded.sg, loaded.tensor(MASTER)
        except BaseException:  # a failed read or update: give the buffers back once no request still fills them
            for held in [current, *(item for item, _ in queue)]:
                if held is not None:
                    self._drop(held)
            raise
        for write in writes:  # the step is durable (and write errors surface) before it returns
            write.result()

    def _drop(self, loaded: _Loaded) -> None:
        """After a failure: wait out ``loaded``'s reads (whatever their outcome), then release its pooled buffers."""
        for read in loaded.reads:
            read.exception()
        if not loaded.in_place:
            for kind, raw in loaded.raw.items():
                self._pool_of(kind).release(raw)

    def state_directories(self) -> list[Path]:
        return self.store.roots

    def read_master(self, sg: Subgroup) -> torch.Tensor:
        raw = self.pool.acquire(align_up(sg.numel * 4))
        try:
            self.store.read(MASTER, sg.key, raw, sg.numel * 4).result()
            return typed_view(raw, torch.float32, sg.numel).clone()
        finally:
            self.pool.release(raw)

    def close(self) -> None:
        self.pool.close()
        if self.state_pool is not None:
            self.state_pool.close()
        if self.adam_kernel is not None:
            self.adam_kernel.close()
