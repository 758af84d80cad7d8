"""The vertical schedule (GreedySnake): every micro-batch through one block before the next block starts.

Each block's parameters are fetched once in forward and once in backward per iteration, whatever the number of
micro-batches M, instead of once per micro-batch. Micro-batches visit the blocks in snake order (the direction
alternates per block, so the micro-batch at the turn is the one whose activation was produced last). Only
block-boundary activations are kept, one per micro-batch per boundary, on the device, in host memory or on
storage (``schedule.checkpoint_host`` / ``checkpoint_nvme`` fractions); backward walks the blocks from the last,
recomputing each block from its checkpoints, or going through its kept forward graph (in memory, ``kept.py``, or on
storage, ``spill.py``), and accumulating the block's gradients over all M micro-batches before they leave it.

The module opts in with two methods (the shipped GPT has them):

    def vertical_pre(self, batch) -> Tensor      # resident layers before the blocks: hidden states (b, t, d)
    def vertical_loss(self, hidden, batch) -> Tensor  # resident layers after the blocks and the loss (a scalar)

and its blocks are the ones the engine streams (its ``nn.ModuleList``, or ``offload_blocks()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_smartinf import trace
from lightning_smartinf.schedule.calls import RecomputeState
from lightning_smartinf.schedule.kept import kept_blocks, parameter_references
from lightning_smartinf.schedule.parked import ParkedEngine, snake, split_batch
from lightning_smartinf.schedule.spill import GraphSpill
from lightning_smartinf.storage.aligned import aligned_bytes, typed_view
from lightning_smartinf.storage.counters import READ, WRITE, TrafficCounters
from lightning_smartinf.storage.store import TensorStore

CHECKPOINT = "checkpoint"
DEVICE_HOST_LINK = "device_host"


class VerticalModule(Protocol):
    def vertical_pre(self, batch: Any) -> torch.Tensor: ...

    def vertical_loss(self, hidden: torch.Tensor, batch: Any) -> torch.Tensor: ...


class VerticalEngine(ParkedEngine, Protocol):
    """What the vertical schedule needs from the engine: the parked schedule's hooks, plus the blocks' own forwards
    and the counters its checkpoint tiers add to."""

    counters: TrafficCounters
    block_forwards: list[Callable[..., Any]]
    graphs: GraphSpill

    def block_parameters(self, index: int) -> list[torch.nn.Parameter]: ...


def has_protocol(module: object) -> bool:
    """The module has ``vertical_pre``/``vertical_loss``, and its ``training_step`` is not overridden below the class
    that defines them, nor on the instance (a step changed that way, e.g. scaling its loss, must run: the module
    then trains parked, through its own ``training_step``)."""
    if not all(callable(getattr(module, name, None)) for name in ("vertical_pre", "vertical_loss")):
        return False
    if "training_step" in vars(module):  # replaced on the instance
        return False
    mro = type(module).__mro__
    step = next((i for i, c in enumerate(mro) if "training_step" in c.__dict__), len(mro))
    loss = next((i for i, c in enumerate(mro) if "vertical_loss" in c.__dict__), len(mro))
    return step >= loss


class CheckpointTiers:
    """Keeps block-boundary activations on the device, in host memory or on storage, and counts what moves."""

    def __init__(self, micro_batches: int, host_fraction: float, nvme_fraction: float, store: TensorStore,
                 counters: TrafficCounters, device: torch.device) -> None:  # fmt: skip
        n_nvme = round(nvme_fraction * micro_batches)
        n_host = min(round(host_fraction * micro_batches), micro_batches - n_nvme)
        # the last micro-batches of each boundary go to the slower tiers
        self.tier = ["device"] * (micro_batches - n_host - n_nvme) + ["host"] * n_host + ["nvme"] * n_nvme
        self.store, self.counters, self.device = store, counters, device
        self._saved: dict[tuple[int, int], Any] = {}

    def put(self, boundary: int, micro: int, hidden: torch.Tensor) -> None:
        tier = self.tier[micro]
        hidden = hidden.detach()
        if tier == "device":
            self._saved[(boundary, micro)] = hidden
            return
        nbytes = hidden.numel() * hidden.element_size()
        if tier == "host":
            self.counters.add(DEVICE_HOST_LINK, CHECKPOINT, WRITE, nbytes)
            self._saved[(boundary, micro)] = hidden.to("cpu", copy=True)
            return
        raw = aligned_bytes(nbytes)
        typed_view(raw, hidden.dtype, hidden.numel()).copy_(hidden.reshape(-1))
        self.store.write(CHECKPOINT, f"b{boundary}m{micro}", raw, nbytes).result()
        self._saved[(boundary, micro)] = (hidden.shape, hidden.dtype, nbytes)

    def get(self, boundary: int, micro: int, keep: bool = False) -> torch.Tensor:
        """The checkpoint, moved back to the device; ``keep`` leaves it stored for a later read (backward)."""
        saved = self._saved[(boundary, micro)] if keep else self._saved.pop((boundary, micro))
        tier = self.tier[micro]
        if tier == "device":
            return saved  # type: ignore[no-any-return]
        if tier == "host":
            self.counters.add(DEVICE_HOST_LINK, CHECKPOINT, READ, saved.numel() * saved.element_size())
            return saved.to(self.device)  # type: ignore[no-any-return]
        shape, dtype, nbytes = saved
        raw = aligned_bytes(nbytes)
        self.store.read(CHECKPOINT, f"b{boundary}m{micro}", raw, nbytes, urgent=True).result()
        return typed_view(raw, dtype, nbytes // torch.empty((), dtype=dtype).element_size()).view(shape).to(self.device)

    def clear(self) -> None:
        self._saved.clear()


class VerticalSchedule:
    """Runs one iteration (forward and backward over M micro-batches) block by block; returns the mean loss."""

    def __init__(self, engine: VerticalEngine, micro_batches: int, tiers: CheckpointTiers, eager: bool = False,
                 keep_activations: float = 0.0, spill_activations: float = 0.0) -> None:  # fmt: skip
        self.engine, self.micro_batches, self.tiers, self.eager = engine, micro_batches, tiers, eager
        blocks = len(engine.block_forwards)
        self.keep = kept_blocks(blocks, keep_activations)
        """Blocks (0-based) whose forward graph is kept in memory for backward instead of recomputed (``kept.py``)."""
        self.spilled = kept_blocks(blocks, min(1.0, keep_activations + spill_activations)) - self.keep
        """Blocks whose graph is kept on storage (``spill.py``): the ones before those kept in memory."""

    def run(self, module: VerticalModule, batch: Any) -> torch.Tensor:
        return self.run_micros(module, split_batch(batch, self.micro_batches), self.micro_batches)

    def run_micros(self, module: VerticalModule, micros: list[Any], divisor: int) -> torch.Tensor:
        """One iteration over ``micros`` (at most ``micro_batches`` of them), each loss divided by ``divisor``;
        returns the sum of the divided losses."""
        try:
            return self._iteration(module, micros, divisor)
        finally:
            self.tiers.clear()
            self.engine.graphs.clear()

    def _iteration(self, module: VerticalModule, micros: list[Any], divisor: int) -> torch.Tensor:
        engine, blocks, n, spill = self.engine, len(self.engine.block_forwards), len(micros), self.engine.graphs
        with trace.span("embed", "compute"):
            embedded = [module.vertical_pre(mb) for mb in micros]  # keeps the resident layers' graphs (boundary 0)
        for m, hidden in enumerate(embedded):
            self.tiers.put(0, m, hidden)
        replay: dict[tuple[int, int], RecomputeState] = {}
        graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # kept blocks: (input, output)
        with torch.no_grad():
            for b in range(blocks):
                engine.enter_block(b + 1, backward=False)
                for m in snake(n, b):
                    kept = b in self.keep or b in self.spilled
                    x = self.tiers.get(b, m, keep=not kept)
                    if kept:
                        x = x.detach().requires_grad_(True)
                        pack = spill.packer((b, m), [x]) if b in self.spilled else None
                        with torch.enable_grad(), parameter_references(engine.block_parameters(b + 1), spill=pack):
                            graphs[(b, m)] = (x, engine.block_forwards[b](x))
                        if pack is not None:
                            spill.flush((b, m))
                        self.tiers.put(b + 1, m, graphs[(b, m)][1])
                        continue
                    replay[(b, m)] = RecomputeState(engine.device)  # the recompute's dropout masks match
                    self.tiers.put(b + 1, m, engine.block_forwards[b](x))
                engine.exit_block(b + 1, backward=False)
        # head and loss per micro-batch; their gradients flow back into the blocks' last boundary
        grads: list[torch.Tensor | None] = [None] * n
        total = torch.zeros((), device=engine.device)
        for m in range(n):
            with trace.span("head and loss", "compute", micro_batch=m):
                hidden = self.tiers.get(blocks, m).requires_grad_(True)
                loss = module.vertical_loss(hidden, micros[m]) / divisor
            with trace.span("head backward", "compute", micro_batch=m):
                engine.scale_loss(loss).backward()
            grads[m], total = hidden.grad, total + loss.detach()
        if self.eager:  # each block's update starts when its backward below has finished
            engine.begin_eager_step()
        for b in reversed(range(blocks)):
            engine.enter_block(b + 1, backward=True)
            spill.prefetch([(b, m) for m in snake(n, b + 1)], urgent=True)  # already started unless the first
            spill.prefetch([(b - 1, m) for m in snake(n, b)])  # the next block's, behind this one's backward
            for m in snake(n, b + 1):  # continue the snake from where forward turned
                if (b, m) in graphs:
                    x, out = graphs.pop((b, m))
                else:
                    x = self.tiers.get(b, m).requires_grad_(True)
                    state = replay.pop((b, m))
                    with trace.span("recompute", "recompute"), state.forked(), state.replay(), torch.enable_grad():
                        out = engine.block_forwards[b](x)
                out.backward(grads[m])
                grads[m] = x.grad
                spill.release((b, m))
            engine.collect_block_grads(b + 1)
            engine.exit_block(b + 1, backward=True)
        for m, hidden in enumerate(embedded):
            hidden.backward(grads[m])
        engine.collect_resident_grads()
        return total
