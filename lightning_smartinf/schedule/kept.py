"""A block's forward graph kept for its backward, instead of recomputing the block from its input.

GreedySnake recomputes nothing it can afford to keep: when a block's activations fit the memory they may use, its
forward runs with autograd on and backward goes straight through the saved graph, saving one block forward per
micro-batch (a quarter of the compute). The catch is the parameters: they are streamed, so the buffer the forward
read them from holds another block by the time backward runs. ``parameter_references`` stores every saved tensor
that is a view of the block's parameters as a reference (its shape, strides and place in the block) and rebuilds it
from the parameters fetched again for backward; every other saved tensor (the activations) is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_smartinf.schedule.spill import PackFn, Spilled


@dataclass(frozen=True)
class _ParamView:
    """A saved tensor that was a view of one of the block's parameter buffers (``buffer``: the index of its first
    parameter in ``params``), by position relative to that parameter."""

    buffer: int
    size: torch.Size
    stride: tuple[int, ...]
    position: int


def parameter_references(params: Sequence[torch.Tensor], sizes: dict[int, int] | None = None,
                         spill: PackFn | None = None) -> torch.autograd.graph.saved_tensors_hooks:  # fmt: skip
    """Saved-tensor hooks for one forward of a block whose parameters ``params`` are views of a few buffers (as the
    engine fetches them: the trainable ones in one, the frozen ones in another); the backward must run while the
    block is fetched again. ``sizes``, if given, gets the bytes of every other saved storage (what the kept graph
    costs in memory), by storage; ``spill``, if given, may take any other saved tensor to storage (``spill.py``)."""
    anchors: dict[int, tuple[int, torch.dtype, int]] = {}  # storage -> (index of its first param, dtype, offset)
    for i, p in enumerate(params):
        if p.data.numel():
            anchors.setdefault(p.data.untyped_storage().data_ptr(), (i, p.dtype, int(p.data.storage_offset())))

    def pack(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        found = anchors.get(storage.data_ptr())
        if found is not None and tensor.dtype == found[1]:
            return _ParamView(found[0], tensor.size(), tensor.stride(), int(tensor.storage_offset()) - found[2])
        if spill is not None and found is None and (spilled := spill(tensor)) is not None:
            return spilled
        if sizes is not None and found is None:
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _ParamView):
            current = params[saved.buffer].data
            return current.as_strided(saved.size, saved.stride, current.storage_offset() + saved.position)
        if isinstance(saved, Spilled):
            return saved.tensor()
        return saved  # type: ignore[no-any-return]

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def kept_blocks(blocks: int, share: float) -> set[int]:
    """Which blocks (0-based) keep their graphs for ``schedule.keep_activations=share``: the last ones, whose
    backward comes first, so their memory is freed first."""
    count = round(share * blocks)
    return set(range(blocks - count, blocks))


def activation_bytes(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     params: Sequence[torch.Tensor]) -> int:  # fmt: skip
    """Bytes a kept graph of ``forward(x)`` holds beyond the parameters (each storage counted once): what keeping a
    block instead of recomputing it costs in memory, measured on the real block (``schedule=auto``)."""
    storages: dict[int, int] = {}
    param_storages = {p.data.untyped_storage().data_ptr() for p in params}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = x.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    del out
    return sum(storages.values())
