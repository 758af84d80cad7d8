"""The vertical schedule for any module: the module's own ``training_step`` per micro-batch, parked at every block.

Each micro-batch runs the user's ``training_step`` on a thread of its own. A streamed block's call does not run
there: the thread parks it and waits. Once all M micro-batches have parked at the same block, the block is fetched
once, run for every micro-batch (no graph kept: its inputs are saved for the recompute), released, and each thread
resumes with its output, one thread at a time, to the next block or to its loss. The threads only ever run one at a
time, in micro-batch order, so the resident layers between blocks see the same RNG and computation order each
iteration. Masks, rotary tables and caches come from the model's own code, so every attention implementation
behaves as in plain training.

Backward is explicit, block by block from the last: a block's outputs reach the threads' graphs as fresh leaves, so
the loss's backward stops at the last block's outputs; then each block is fetched once, recomputed for every
micro-batch under the RNG and autocast state of its forward, and backpropagated from its outputs' gradients; the
gradients of its inputs flow on into whatever produced them (an earlier block's outputs or the resident layers).

Kept graphs (GreedySnake): while ``keep_bytes`` lasts, a block runs for its micro-batches with autograd on and its
graph is kept for backward instead of recomputed (a quarter less compute for it); the parameters it saved are kept
as references and re-read when the block is fetched for backward (``kept.py``). A round whose graphs would overrun
what is left is dropped and recomputed as usual, or, with ``spill``, kept on storage (``spill.py``): its saved
activations are written as its forward ends and read back one block ahead of its backward.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from lightning_smartinf.errors import ConfigError
from lightning_smartinf.schedule.calls import (
    Flat,
    RecomputeState,
    call,
    differentiable,
    flatten,
    recompute,
    set_route,
    training_call,
)
from lightning_smartinf.schedule.kept import parameter_references
from lightning_smartinf.schedule.spill import GraphSpill

STRUCTURE_HELP = (
    "schedule=vertical runs the module's training_step once per micro-batch and each streamed block for all of them "
    "together, so every micro-batch must call the same blocks in the same order; use schedule=horizontal, or give the "
    "module vertical_pre/vertical_loss (docs/vertical.md)"
)


class ParkedEngine(Protocol):
    """What the parked schedule needs from the engine."""

    device: torch.device

    def enter_block(self, index: int, backward: bool) -> None: ...

    def exit_block(self, index: int, backward: bool) -> None: ...

    def collect_block_grads(self, index: int) -> None: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def begin_eager_step(self) -> None: ...

    def collect_resident_grads(self) -> None: ...

    def block_parameters(self, index: int) -> list[torch.nn.Parameter]: ...

    @property
    def graphs(self) -> GraphSpill: ...


def split_batch(batch: Any, micro_batches: int) -> list[Any]:
    """``batch`` (a tensor, or any pytree of tensors: dicts from a tokenizer, tuples) cut along dim 0 into equal
    micro-batches; other leaves are shared by all of them."""
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) != 1:
        raise TypeError(
            "schedule=vertical splits the batch's tensors along dim 0 into schedule.micro_batches; this batch has "
            f"{'no tensor' if not sizes else f'tensors of different lengths {sorted(sizes)}'}"
        )
    size = sizes.pop()
    if size % micro_batches:
        raise ConfigError(
            f"schedule=vertical: batch of {size} does not split into schedule.micro_batches={micro_batches}; make the "
            "DataLoader batch size a multiple of it"
        )
    chunks = [leaf.chunk(micro_batches) if isinstance(leaf, torch.Tensor) and leaf.dim() else None for leaf in leaves]
    return [
        pytree.tree_unflatten([c[m] if c is not None else leaf for c, leaf in zip(chunks, leaves, strict=True)], spec)
        for m in range(micro_batches)
    ]


def snake(micro_batches: int, block: int) -> range:
    """Micro-batch order through the ``block``-th block of the pass: forward on even ones, backward on odd ones."""
    return range(micro_batches) if block % 2 == 0 else range(micro_batches - 1, -1, -1)


@dataclass
class _Parked:
    """A block call waiting on its thread."""

    index: int
    fn: Callable[..., Any]
    inputs: Flat
    grad: bool
    autocast: tuple[bool, torch.dtype]


@dataclass
class _Record:
    """What backward needs of one (block, micro-batch): the call, its RNG/autocast state, the outputs handed on."""

    call: _Parked
    state: RecomputeState
    outputs: list[torch.Tensor]
    handback: Any
    """The output as the thread gets it: the block's result with its tensors replaced by ``outputs``."""
    kept: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """A kept graph: the detached inputs it starts from and its outputs (None: recompute in backward)."""


@dataclass
class _Round:
    index: int
    records: dict[int, _Record] = field(default_factory=dict)


class _Abort(BaseException):
    """Ends a parked thread whose iteration failed elsewhere."""


class _Worker:
    def __init__(self, micro: int) -> None:
        self.micro = micro
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.thread: threading.Thread | None = None


class ParkedVertical:
    """Runs one iteration of ``step`` (the module's training_step on a micro-batch) block by block; returns the mean
    loss. ``eager``: each block's update starts when its backward is done (``engine.begin_eager_step``).
    ``keep_rounds`` / ``keep_bytes``: how many block calls (over all micro-batches) may keep their forward graphs
    in memory per iteration, and the memory those graphs may take (either 0: none in memory). ``spill``: the
    block calls beyond those keep their graphs on storage (``spill.py``) instead of recomputing in backward."""

    def __init__(self, engine: ParkedEngine, micro_batches: int, eager: bool = False, keep_rounds: int = 0,
                 keep_bytes: int = 0, spill: bool = False) -> None:  # fmt: skip
        self.engine, self.micro_batches, self.eager = engine, micro_batches, eager
        self.keep_rounds, self.keep_bytes, self.spill = keep_rounds, keep_bytes, spill
        self._reports: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._local = threading.local()
        self._keep_left = 0
        self._round_bytes = 0
        """What the last kept round's graphs took: the estimate for the next (the blocks are alike)."""
        self.kept_rounds = 0
        """Rounds (block calls over all micro-batches) of the last iteration whose graphs were kept in memory."""
        self.spilled_rounds = 0
        """Rounds of the last iteration whose graphs were kept on storage."""

    # -- the threads' side ------------------------------------------------------------------------------------------
    def call_block(self, index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Park this micro-batch's call of block ``index`` until the block runs for every micro-batch."""
        worker: _Worker = self._local.worker
        device = self.engine.device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self._reports.put(("park", worker.micro, _Parked(index, fn, training_call(args, kwargs),
                                                         torch.is_grad_enabled(), autocast)))  # fmt: skip
        reply = worker.inbox.get()
        if reply is _Abort:
            raise _Abort()
        return reply

    def _body(
        self, worker: _Worker, step: Callable[[], Any], context: Callable[[], AbstractContextManager[Any]]
    ) -> None:
        self._local.worker = worker
        set_route(self)
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        try:
            worker.inbox.get()  # the go
            with context():
                result = step()
            self._reports.put(("done", worker.micro, result))
        except _Abort:
            self._reports.put(("aborted", worker.micro, None))
        except BaseException as err:  # noqa: BLE001 - re-raised on the trainer's thread
            self._reports.put(("error", worker.micro, err))

    # -- the trainer's side -----------------------------------------------------------------------------------------
    def run(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        context: Callable[[], AbstractContextManager[Any]],
    ) -> torch.Tensor:
        """``step(micro_batch)`` returns a loss (or a dict with ``"loss"``); ``context`` is entered on each thread
        around it (the precision plugin's autocast, which is per thread)."""
        micros = split_batch(batch, self.micro_batches)
        return self.run_calls([functools.partial(step, micro) for micro in micros], context, self.micro_batches)

    def run_calls(
        self, steps: Sequence[Callable[[], Any]], context: Callable[[], AbstractContextManager[Any]], divisor: int
    ) -> torch.Tensor:
        """One iteration over ``steps`` (one per micro-batch, each returning its loss), every loss divided by
        ``divisor`` (Lightning divides by ``accumulate_grad_batches`` even in a short last window); returns the
        sum of the divided losses."""
        workers = [_Worker(m) for m in range(len(steps))]
        self._keep_left, self.kept_rounds, self.spilled_rounds = self.keep_bytes, 0, 0
        for worker, step in zip(workers, steps, strict=True):
            worker.thread = threading.Thread(target=self._body, args=(worker, step, context),
                                             name=f"smartinf-micro{worker.micro}", daemon=True)  # fmt: skip
            worker.thread.start()
        try:
            rounds, losses = self._forward(workers)
        except BaseException:
            self._abort(workers)
            self.engine.graphs.clear()
            raise
        for worker in workers:
            assert worker.thread is not None
            worker.thread.join()
        try:
            return self._backward(rounds, losses, divisor)
        finally:
            self.engine.graphs.clear()

    def _resume(self, worker: _Worker, message: Any) -> tuple[str, Any]:
        """Hand ``message`` to one thread and wait until it parks again, finishes or fails."""
        worker.inbox.put(message)
        kind, micro, payload = self._reports.get()
        assert micro == worker.micro
        if kind == "error":
            raise payload
        return kind, payload

    def _abort(self, workers: Sequence[_Worker]) -> None:
        for worker in workers:
            if worker.thread is not None and worker.thread.is_alive():
                worker.inbox.put(_Abort)
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join()
        while not self._reports.empty():
            self._reports.get()

    def _forward(self, workers: Sequence[_Worker]) -> tuple[list[_Round], list[torch.Tensor]]:
        states = [self._resume(worker, None) for worker in workers]
        rounds: list[_Round] = []
        while states[0][0] == "park":
            parked: list[_Parked] = []
            for m, (kind, payload) in enumerate(states):
                if kind != "park" or payload.index != states[0][1].index:
                    where = f"called block {payload.index}" if kind == "park" else "finished its training_step"
                    raise RuntimeError(f"micro-batch {m} {where} while micro-batch 0 called block "
                                       f"{states[0][1].index}: {STRUCTURE_HELP}")  # fmt: skip
                parked.append(payload)
            if self.eager and any(r.index == parked[0].index for r in rounds):
                raise RuntimeError(f"block {parked[0].index} runs twice per forward, so its gradient is final only "
                                   "after the last call: turn schedule.eager_update off")  # fmt: skip
            rounds.append(self._run_round(len(rounds), parked))
            states = [self._resume(worker, rounds[-1].records[w].handback) for w, worker in enumerate(workers)]
        if any(kind != "done" for kind, _ in states):
            raise RuntimeError(f"some micro-batches called a block after others finished: {STRUCTURE_HELP}")
        return rounds, [self._loss_of(payload) for _, payload in states]

    def _run_round(self, position: int, parked: list[_Parked]) -> _Round:
        """Run one block (fetched once) for every parked micro-batch, in snake order; its graphs are kept while the
        budget lasts (the last kept round's size is the estimate)."""
        engine, index = self.engine, parked[0].index
        this = _Round(index)
        grad = all(p.grad for p in parked)
        keep = (grad and self.kept_rounds < self.keep_rounds and self._keep_left > 0
                and self._round_bytes <= self._keep_left)  # fmt: skip
        spill = grad and self.spill and not keep
        sizes: dict[int, int] = {}
        engine.enter_block(index, backward=False)
        try:
            for m in snake(len(parked), position):
                p = parked[m]
                enabled, dtype = p.autocast
                with torch.autocast(engine.device.type, dtype=dtype, enabled=enabled):
                    state = RecomputeState(engine.device)
                    kept: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                    if keep or spill:
                        inputs = [x.detach().requires_grad_(x.requires_grad) for x in p.inputs.tensors]
                        pack = engine.graphs.packer((position, m), inputs) if spill else None
                        with torch.enable_grad(), parameter_references(engine.block_parameters(index), sizes, pack):
                            result = flatten(call(p.fn, p.inputs, inputs), f"the output of block {index}")
                        if pack is not None:
                            engine.graphs.flush((position, m))
                        kept = (inputs, result.tensors)
                    else:
                        with torch.no_grad():
                            result = flatten(call(p.fn, p.inputs, p.inputs.tensors), f"the output of block {index}")
                leaves = [t.detach().requires_grad_() if p.grad and differentiable(t) else t for t in result.tensors]
                this.records[m] = _Record(p, state, leaves, result.rebuild(leaves), kept)
        finally:
            engine.exit_block(index, backward=False)
        self.spilled_rounds += spill
        if keep:
            self._round_bytes = sum(sizes.values())
            if self._round_bytes > self._keep_left:  # over the budget: recompute this round after all
                for record in this.records.values():
                    record.kept = None
                self._keep_left = 0
            else:
                self._keep_left -= self._round_bytes
                self.kept_rounds += 1
        return this

    @staticmethod
    def _loss_of(result: Any) -> torch.Tensor:
        loss = result.get("loss") if isinstance(result, dict) else result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                "schedule=vertical needs training_step to return the loss as a scalar tensor (or a dict with "
                f"'loss'); it returned {type(result).__name__}"
            )
        return loss

    def _backward(self, rounds: list[_Round], losses: list[torch.Tensor], divisor: int) -> torch.Tensor:
        engine, n = self.engine, len(losses)
        total = torch.zeros((), device=engine.device)
        for loss in losses:  # down to the last block's outputs (leaves) and into the resident layers after it
            engine.scale_loss(loss / divisor).backward()
            total = total + loss.detach() / divisor
        if self.eager:
            engine.begin_eager_step()
        for position in reversed(range(len(rounds))):
            this = rounds[position]
            engine.enter_block(this.index, backward=True)
            targets: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            spill = engine.graphs
            spill.prefetch([(position, m) for m in snake(n, position + 1)], urgent=True)
            spill.prefetch([(position - 1, m) for m in snake(n, position)])  # behind this block's backward
            try:
                for m in snake(n, position + 1):  # continue the snake from where forward turned
                    self._recompute(this.records.pop(m), targets, grads)
                    spill.release((position, m))
                engine.collect_block_grads(this.index)
            finally:
                engine.exit_block(this.index, backward=True)
            if targets:  # on into earlier blocks' outputs and the resident layers between
                torch.autograd.backward(targets, grads, retain_graph=True)
        engine.collect_resident_grads()
        return total

    @staticmethod
    def _recompute(record: _Record, targets: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        pairs = [(o, o.grad) for o in record.outputs if o.requires_grad and o.grad is not None]
        if not pairs:
            return
        inputs = record.call.inputs
        if record.kept is not None:  # straight through the graph kept in forward
            tensors, outputs = record.kept
            record.kept = None
        else:
            tensors, outputs = recompute(record.call.fn, inputs, inputs.tensors, record.state)
        by_id = {id(o): i for i, o in enumerate(record.outputs)}
        recomputed = [(outputs[by_id[id(o)]], g) for o, g in pairs]
        recomputed = [(o, g) for o, g in recomputed if o.requires_grad]  # not for a block frozen with frozen inputs
        if not recomputed:
            return
        torch.autograd.backward([o for o, _ in recomputed], [g for _, g in recomputed])
        for original, detached in zip(inputs.tensors, tensors, strict=True):
            if original.requires_grad and detached.grad is not None:
                targets.append(original)
                grads.append(detached.grad)
