"""Accumulates fp32 gradients per subgroup across micro-batches, in a store (NVMe or host RAM), for the step.

Backward hands over one block's gradients at a time. The first micro-batch after a step writes each subgroup's
gradient; later ones read, add and write back (ZeRO-Infinity's NVMe gradient path). Each write also records the
subgroup's gradient norm and finiteness, so the global norm for clipping and the fp16 overflow check are known
when backward ends, without another pass over the gradients.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from lightning_smartinf.core import GRAD, Block, Layout, ParamSlot, Subgroup
from lightning_smartinf.storage.aligned import Allocator, BufferPool, typed_view
from lightning_smartinf.storage.store import TensorStore, done_future, in_host_memory


def gather_grads(slots: list[ParamSlot], flat: torch.Tensor) -> None:
    """Move the parameters' autograd gradients into ``flat`` (their block's layout; zero where a parameter has
    none) and drop them from the parameters."""
    flat.zero_()
    for slot in slots:
        if slot.param.grad is not None:
            flat[slot.offset : slot.offset + slot.numel].copy_(slot.param.grad.reshape(-1))
            slot.param.grad = None


class GradientAccumulator:
    def __init__(self, layout: Layout, store: TensorStore, lookahead: int, allocator: Allocator | None = None) -> None:
        self.layout = layout
        self.store = store
        self.pool = BufferPool(*self.pool_shape(layout, lookahead), allocator=allocator)
        self._held: dict[int, torch.Tensor] = {}
        self._written: set[int] = set()
        self._norms: dict[int, torch.Tensor] = {}
        self._pending: list[Future[None]] = []

    @staticmethod
    def pool_shape(layout: Layout, lookahead: int) -> tuple[int, int]:
        """(buffers, bytes each): backward's in-flight writes plus the step's read-ahead, one subgroup each."""
        return lookahead + 3, layout.max_subgroup_numel * 4

    @property
    def host_bytes(self) -> int:
        return self.pool.total_bytes

    def add_block(self, block: Block, flat_grad: torch.Tensor) -> None:
        """Accumulate a block's flat fp32 gradient (block layout, host memory) into its subgroups."""
        for sg in block.subgroups:
            self.add_subgroup(sg, flat_grad[sg.offset : sg.offset + sg.numel])

    def add_subgroup(self, sg: Subgroup, grad: torch.Tensor) -> None:
        host = in_host_memory(self.store, sg.key)  # in RAM: accumulate where it is stored, no copy in or out
        raw = host.slot(GRAD, sg.key, sg.numel * 4) if host is not None else self.pool.acquire(sg.numel * 4)
        acc = typed_view(raw, torch.float32, sg.numel)
        if sg.index in self._written:
            if host is None:
                self.sync()  # an earlier write of this subgroup may still be in flight
                self.store.read(GRAD, sg.key, raw, sg.numel * 4).result()
            acc.add_(grad)
        else:
            acc.copy_(grad)
        self._norms[sg.index] = torch.linalg.vector_norm(acc)
        self._written.add(sg.index)
        if host is None:
            write = self.store.write(GRAD, sg.key, raw, sg.numel * 4)
            write.add_done_callback(lambda _f: self.pool.release(raw))
            self._pending.append(write)

    def sync(self) -> None:
        """Wait until every gradient write has landed (and raise its error)."""
        pending, self._pending = self._pending, []
        for write in pending:
            write.result()

    def global_norm(self) -> torch.Tensor:
        """fp32 L2 norm over every accumulated gradient, combined as clip_grad_norm_ does (inf/nan if any is)."""
        if not self._norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(list(self._norms.values())))

    # -- GradientSource, for the updater --------------------------------------------------------------------------
    def fetch(self, sg: Subgroup) -> Future[torch.Tensor]:
        self.sync()
        host = in_host_memory(self.store, sg.key)
        if host is not None:  # the stored gradient itself (the step may scale it in place: it is spent after)
            raw = host.slot(GRAD, sg.key, sg.numel * 4)
        else:
            raw = self._held[sg.index] = self.pool.acquire(sg.numel * 4)
        grad = typed_view(raw, torch.float32, sg.numel)
        read: Future[None] = done_future()
        if sg.index not in self._written:  # no gradient reached this subgroup: it steps with zeros
            grad.zero_()
        elif host is None:
            read = self.store.read(GRAD, sg.key, raw, sg.numel * 4)
        out: Future[torch.Tensor] = Future()
        read.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(grad))
        return out

    def holds(self, sg: Subgroup) -> bool:
        return sg.index in self._written

    def release(self, sg: Subgroup) -> None:
        raw = self._held.pop(sg.index, None)
        if raw is not None:  # a gradient in host memory was lent in place, not from the pool
            self.pool.release(raw)

    def close(self) -> None:
        """Wait for gradient writes, then give the buffers back (the engine is closing)."""
        self.sync()
        self.pool.close()

    def reset(self) -> None:
        """Forget the accumulated gradients (after a step, applied or skipped)."""
        self.sync()
        self._written.clear()
        self._norms.clear()
