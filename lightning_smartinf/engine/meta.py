"""Building a module with its parameters on the meta device (no memory), its buffers real.

The strategy enters ``meta_parameters()`` for ``trainer.init_module(empty_init=True)`` and around
``configure_model()``; the engine gives the parameters values block by block (``engine/materialize.py``). Modules
that initialize themselves can ask ``building_on_meta()`` to leave that to the engine. The hook on
``nn.Module.register_parameter`` is installed while some thread is inside the context and removed when the last
one leaves; meanwhile it passes parameters through for threads that never entered it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_register_parameter = nn.Module.register_parameter
_state = threading.local()
_installed = 0
"""Threads inside ``meta_parameters()``, counted once per outermost entry; the hook is in place while positive."""
_lock = threading.Lock()


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
    global _installed
    outermost = not building_on_meta()
    if outermost:
        with _lock:
            _installed += 1
            nn.Module.register_parameter = _register  # type: ignore[method-assign,assignment]
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        if outermost:
            with _lock:
                _installed -= 1
                if _installed == 0:
                    nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]
