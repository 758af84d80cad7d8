"""A streamed block's call, whatever it looks like, as a flat list of tensors plus everything else held aside.

Hugging Face decoder layers take keywords (``attention_mask``, ``position_ids``, ``position_embeddings`` as a tuple,
a cache object), litgpt's blocks take ``None`` positionally, and outputs may be a tensor, a tuple or a
``ModelOutput``. Schedules need the tensors alone (to save them, recompute from them and route gradients to them),
so a call is flattened with torch's pytree utilities into its tensor leaves and a template that rebuilds it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from lightning_smartinf import trace
from lightning_smartinf.ecosystem.caches import is_kv_cache


@dataclass
class Flat:
    """A pytree with its tensor leaves taken out: ``rebuild(tensors)`` puts (new) tensors back in their places."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    tensor_at: list[int]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_at]

    def rebuild(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for i, tensor in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


def flatten(tree: Any, what: str) -> Flat:
    """Split ``tree`` into tensor leaves and the rest; ``what`` names it in the error for a leaf hiding tensors."""
    leaves, spec = pytree.tree_flatten(tree)
    for leaf in leaves:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            raise TypeError(
                f"smart_infinity streams blocks through their tensors, but {what} holds a {type(leaf).__name__} "
                "dataclass that torch's pytree cannot look into, so its tensors would get no gradient: register it "
                "with torch.utils._pytree.register_dataclass, or pass its tensors directly"
            )
    return Flat(spec, leaves, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)])


def training_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flat:
    """A block call as trained: under autograd a key/value cache object is passed as ``None`` (``use_cache=False``
    semantics: a block recomputed in backward would append to it twice, and no cache outlives a block)."""
    if torch.is_grad_enabled():
        args = tuple(None if is_kv_cache(a) else a for a in args)
        kwargs = {k: None if is_kv_cache(v) else v for k, v in kwargs.items()}
    return flatten((args, kwargs), "a block's arguments")


def call(fn: Callable[..., Any], inputs: Flat, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
    """Run ``fn`` on the call ``inputs`` with ``tensors`` in place of its tensor leaves."""
    args, kwargs = inputs.rebuild(tensors)
    return fn(*args, **kwargs)


def differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class RecomputeState:
    """RNG and autocast state at a block's forward, restored when backward recomputes it (dropout masks match)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)

    def replay(self) -> torch.autocast:
        """Within ``torch.random.fork_rng``: set the saved RNG state and return the saved autocast context."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast)

    def forked(self) -> Any:
        """A context that leaves the caller's RNG as it was after the replay."""
        return torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])


def recompute(
    fn: Callable[..., Any], inputs: Flat, saved: list[torch.Tensor] | tuple[torch.Tensor, ...], state: RecomputeState
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rerun a block call for its backward: on detached copies of ``saved`` (its input tensors), with grad, under
    its forward's RNG and autocast ``state``. Returns the copies (their ``.grad`` is the inputs' gradient once the
    outputs are backpropagated) and the output tensors."""
    tensors = [x.detach().requires_grad_(x.requires_grad) for x in saved]
    with trace.span("recompute", "recompute"), state.forked():
        with state.replay(), torch.enable_grad():
            outputs = flatten(call(fn, inputs, tensors), "a block's output").tensors
    return tensors, outputs


class BlockRoute(Protocol):
    """Where a streamed block's call goes from the thread that makes it (the vertical schedule parks it)."""

    def call_block(self, index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


_route = threading.local()


def route() -> BlockRoute | None:
    """The route set for this thread, if any; block calls on other threads stream one at a time (horizontal)."""
    return getattr(_route, "current", None)


def set_route(current: BlockRoute | None) -> None:
    _route.current = current
