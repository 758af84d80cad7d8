"""The horizontal schedule: every micro-batch runs through the whole model, block after block, for any module.

Each streamed block's ``forward`` is wrapped in an autograd function that fetches the block's parameters, runs it
without building a graph (keeping only its inputs), and releases them. Any call signature works: positional and
keyword arguments, ``None``s, tuples, cache objects and ``ModelOutput`` results (``schedule/calls.py``).
Backward fetches them again, recomputes the block with the saved RNG and autocast state, backpropagates through
it, hands the parameter gradients to the engine and releases the block. Parameters are read twice per
micro-batch (forward and backward); activation memory is one block call's inputs per block, as with activation
checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_smartinf.schedule.calls import (
    Flat,
    RecomputeState,
    call,
    differentiable,
    flatten,
    recompute,
    route,
    training_call,
)


class BlockRunner(Protocol):
    """What the schedule asks of the engine around each block."""

    device: torch.device

    def enter_block(self, index: int, backward: bool) -> None: ...

    def exit_block(self, index: int, backward: bool) -> None: ...

    def collect_block_grads(self, index: int) -> None: ...


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules to stream: ``model.offload_blocks()`` if defined, else the elements of every ``nn.ModuleList``."""
    custom = getattr(model, "offload_blocks", None)
    if callable(custom):
        return list(custom())
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if isinstance(module, nn.ModuleList):
            taken.append(name)
            blocks.extend(
                (f"{name}.{i}", child) for i, child in enumerate(module) if any(True for _ in child.parameters())
            )
    return blocks


class _StreamedBlock(torch.autograd.Function):
    """One block call on its tensor leaves: forward runs it without a graph (keeping only its inputs), backward
    fetches the block again, recomputes it from them and backpropagates. The output's structure is handed back
    through ``out`` (a one-element list), since a Function returns tensors only. ``anchor``, an empty tensor that
    requires grad, is passed when the block's parameters train but none of its inputs need a gradient (a frozen
    embedding, frozen earlier blocks): without it autograd would not call this backward at all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, runner: BlockRunner, index: int, fn: Callable[..., Any], inputs: Flat, out: list[Flat],
        anchor: torch.Tensor | None, *tensors: torch.Tensor,
    ) -> Any:  # fmt: skip
        ctx.runner, ctx.index, ctx.fn, ctx.inputs = runner, index, fn, inputs
        ctx.recompute = RecomputeState(runner.device)
        ctx.save_for_backward(*tensors)
        runner.enter_block(index, backward=False)
        try:
            result = flatten(call(fn, inputs, tensors), f"the output of block {index}")
        finally:
            runner.exit_block(index, backward=False)
        out.append(result)
        outputs = result.tensors
        ctx.mark_non_differentiable(*[o for o in outputs if not differentiable(o)])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        runner: BlockRunner = ctx.runner
        runner.enter_block(ctx.index, backward=True)
        try:
            tensors, outputs = recompute(ctx.fn, ctx.inputs, ctx.saved_tensors, ctx.recompute)
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            runner.collect_block_grads(ctx.index)
        finally:
            runner.exit_block(ctx.index, backward=True)
        return (None, None, None, None, None, None, *[x.grad if x.requires_grad else None for x in tensors])


def stream_call(
    runner: BlockRunner, index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    trainable: bool = True,
) -> Any:  # fmt: skip
    """Call block ``index`` (engine numbering) with its parameters streamed in for the call and for its backward;
    ``trainable``: some of the block's parameters require gradients."""
    inputs = training_call(args, kwargs)
    out: list[Flat] = []
    needs_anchor = trainable and torch.is_grad_enabled() and not any(t.requires_grad for t in inputs.tensors)
    anchor = torch.empty(0, requires_grad=True) if needs_anchor else None
    tensors = _StreamedBlock.apply(runner, index, fn, inputs, out, anchor, *inputs.tensors)
    return out[0].rebuild(tensors)


def wrap_blocks(runner: BlockRunner, modules: Sequence[nn.Module]) -> list[Callable[..., Any]]:
    """Route each block's forward through the streaming function; block ``i`` of ``modules`` is engine block i+1.
    A thread with a route set (the vertical schedule's micro-batches) hands its calls to that route instead.

    Returns the original forwards, which schedules that stream blocks themselves (vertical) call directly."""
    originals = [module.forward for module in modules]
    for i, module in enumerate(modules):
        original = module.forward

        def forward(*args: Any, _index: int = i + 1, _fn: Callable[..., Any] = original, _module: nn.Module = module,
                    **kwargs: Any) -> Any:  # fmt: skip
            parked = route()
            if parked is not None:
                return parked.call_block(_index, _fn, args, kwargs)
            trainable = any(p.requires_grad for p in _module.parameters())
            return stream_call(runner, _index, _fn, args, kwargs, trainable)

        module.forward = forward  # type: ignore[method-assign]
    return originals


class BlockHooks:
    """The blocks' ``forward`` routed through ``runner``'s streaming (``wrap``) or the modules' own again
    (``unwrap``). ``forwards`` holds the original forwards, which schedules that stream blocks themselves call
    directly: one list for the hooks' lifetime, refilled by each ``wrap``."""

    def __init__(self, runner: BlockRunner, modules: Sequence[nn.Module]) -> None:
        self.runner, self.modules = runner, modules
        self.forwards: list[Callable[..., Any]] = []

    def wrap(self) -> None:
        self.forwards[:] = wrap_blocks(self.runner, self.modules)

    def unwrap(self) -> None:
        unwrap_blocks(self.modules)


def unwrap_blocks(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        if "forward" in module.__dict__:
            del module.forward
