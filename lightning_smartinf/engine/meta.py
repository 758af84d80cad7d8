"""Building a module with its parameters on the meta device (no memory), its buffers real.

The strategy enters ``meta_parameters()`` for ``trainer.init_module(empty_init=True)`` and around
``configure_model()``; the engine gives the parameters values block by block (``engine/materialize.py``). Modules
that initialize themselves can ask ``building_on_meta()`` to leave that to the engine. The hook on
``nn.Module.register_parameter`` stays installed after first use and passes parameters through outside the
context (so other threads, which never entered it, are unaffected).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_register_parameter = nn.Module.register_parameter
_state = threading.local()


def building_on_meta() -> bool:
    """Whether this thread is inside ``meta_parameters()``."""
    return getattr(_state, "depth", 0) > 0


def _register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is not None and not param.is_meta and building_on_meta():
        param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    _register_parameter(module, name, param)


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Within it, every parameter this thread registers is created on the meta device (buffers as they are)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    nn.Module.register_parameter = _register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _state.depth -= 1
