"""The horizontal schedule: every micro-batch runs through the whole model, block after block, for any module.

Each streamed block's ``forward`` is wrapped in an autograd function that fetches the block's parameters, runs it
without building a graph (keeping only its input), and releases them. Backward fetches them again, recomputes the
block with the saved RNG and autocast state, backpropagates through it, hands the parameter gradients to the
engine and releases the block. Parameters are read twice per micro-batch (forward and backward); activation memory
is one block input per block, as with activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn


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


class _RecomputeState:
    """RNG and autocast state at forward time, restored for the recompute in backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)

    def restore(self) -> torch.autocast:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast)


class _StreamedBlock(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, runner: BlockRunner, index: int, fn: Callable[..., Any], *inputs: torch.Tensor
    ) -> Any:
        ctx.runner, ctx.index, ctx.fn = runner, index, fn
        ctx.recompute = _RecomputeState(runner.device)
        ctx.save_for_backward(*inputs)
        runner.enter_block(index, backward=False)
        try:
            return fn(*inputs)
        finally:
            runner.exit_block(index, backward=False)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        runner: BlockRunner = ctx.runner
        runner.enter_block(ctx.index, backward=True)
        try:
            with torch.random.fork_rng(devices=[runner.device] if runner.device.type == "cuda" else []):
                with ctx.recompute.restore(), torch.enable_grad():
                    outputs = ctx.fn(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad and g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            runner.collect_block_grads(ctx.index)
        finally:
            runner.exit_block(ctx.index, backward=True)
        return (None, None, None, *[x.grad if x.requires_grad else None for x in inputs])


def wrap_blocks(runner: BlockRunner, modules: Sequence[nn.Module]) -> list[Callable[..., Any]]:
    """Route each block's forward through the streaming function; block ``i`` of ``modules`` is engine block i+1.

    Returns the original forwards, which schedules that stream blocks themselves (vertical) call directly."""
    originals = [module.forward for module in modules]
    for i, module in enumerate(modules):
        original = module.forward

        def forward(*args: Any, _index: int = i + 1, _fn: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
                raise TypeError(
                    "smart_infinity streams blocks whose forward takes tensors as positional arguments only; "
                    f"block {_index} got {[type(a).__name__ for a in args]} and keywords {sorted(kwargs)}"
                )
            return _StreamedBlock.apply(runner, _index, _fn, *args)

        module.forward = forward  # type: ignore[method-assign]
    return originals


def unwrap_blocks(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        if "forward" in module.__dict__:
            del module.forward
