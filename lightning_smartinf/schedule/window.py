"""``accumulate_grad_batches=A`` under the vertical schedule: the A batches of a window run as one vertical pass.

Lightning calls ``training_step`` once per batch and steps the optimizer after the A-th. Run as it comes, each batch
would read every block's parameters from storage twice, A times per step. Instead the strategy holds the first
calls of each window (they return a placeholder loss and run no backward of their own) and runs the whole window at
its last batch as one vertical pass: every block is read once in forward and once in backward per step, whatever A.
Each batch's loss is divided by A, as Lightning divides it, also in a short last window at the end of an epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass
class Call:
    """One ``training_step`` call as Lightning made it: ``args[0]`` is the batch."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class AccumulationWindow:
    """The calls of the current window, held until the batch that ends it."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.held: list[Call] = []

    def hold(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.held.append(Call(args, kwargs))

    def take(self) -> list[Call]:
        calls, self.held = self.held, []
        return calls


def concat_batches(batches: Sequence[Any]) -> Any:
    """Batches of the same structure joined along dim 0 (tensors with a batch dimension; other leaves from the
    first batch): the window as one batch, for a schedule that splits a batch into micro-batches itself."""
    if len(batches) == 1:
        return batches[0]
    flat = [pytree.tree_flatten(b) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise TypeError(
            "accumulate_grad_batches under the vertical schedule runs a window's batches together, so they must "
            "have the same structure; these differ: use schedule=horizontal"
        )
    leaves = [
        torch.cat(group) if isinstance(group[0], torch.Tensor) and group[0].dim() else group[0]
        for group in zip(*(leaves for leaves, _ in flat), strict=True)
    ]
    return pytree.tree_unflatten(leaves, spec)


def tokens_of(batch: Any) -> tuple[int, int]:
    """``(sequences, tokens)`` of a batch: from its first tensor with a batch dimension (a (b, t) token tensor, or a
    tokenizer's dict of them); ``(b, b)`` for a batch of one dimension."""
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return leaf.shape[0], leaf.shape[0] * (leaf.shape[1] if leaf.dim() > 1 else 1)
    raise TypeError("the batch holds no tensor with a batch dimension")
