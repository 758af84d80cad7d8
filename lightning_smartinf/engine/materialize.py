"""Models built without their weights: parameters on the meta device, given values one block at a time at set-up.

``meta_parameters()`` (``lightning_smartinf/engine/meta.py``) is the context the strategy's
``tensor_init_context(empty_init=True)`` and ``model_sharded_context()`` (around ``configure_model``) enter: every
parameter a module registers becomes a meta tensor of its shape and dtype, so building a 175B model costs no memory.
Buffers stay real (rotary tables, masks: small, and computed by the modules' own
``__init__``). Unlike Lightning's default ``empty_init``, which leaves
uninitialized host memory that trains to NaN, nothing is left without a value: at set-up the engine calls
``Materializer.materialize`` for each block in turn, which swaps each meta parameter for a real one (the same
Parameter object, which the optimizer holds) and fills it from the pretrained file or the module's init route,
before the block's master and 16-bit copies are written and its memory freed.

The init route, checked before anything is written: the LightningModule's ``init_weights(module)``, called for
every submodule of a block in ``nn.Module.apply`` order (children first), as Hugging Face's ``_init_weights``;
otherwise each owning module's ``reset_parameters()`` (torch's layers, FSDP's convention). A parameter left
unfilled by either is an error that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_smartinf.core import Block, ParamSlot
from lightning_smartinf.ecosystem.adapters import initialize_adapters
from lightning_smartinf.errors import ConfigError

if TYPE_CHECKING:
    from lightning_smartinf.engine.pretrained import PretrainedSource


def owners(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Module]:
    """The modules that hold any of ``params`` directly, in ``model.modules()`` order."""
    wanted = {id(p) for p in params}
    return [m for m in model.modules() if any(id(p) in wanted for p in m._parameters.values() if p is not None)]


class Materializer:
    """Gives meta parameters their values, one group at a time (see the module docstring)."""

    def __init__(self, model: nn.Module, pretrained: PretrainedSource | None, device: torch.device) -> None:
        self.model = model
        self.pretrained = pretrained
        self.device = device
        hook = getattr(model, "init_weights", None)
        self.init_weights: Callable[[nn.Module], Any] | None = hook if callable(hook) else None

    def check(self, params: dict[str, nn.Parameter]) -> None:
        """Before anything is written: every meta parameter has a route to a value."""
        if self.pretrained is not None or self.init_weights is not None:
            return
        for name, p in params.items():
            if not p.is_meta:
                continue
            owner = owners(self.model, [p])
            if not owner or not all(callable(getattr(m, "reset_parameters", None)) for m in owner):
                kind = type(owner[0]).__name__ if owner else "?"
                raise ConfigError(
                    f"parameter {name} was built on the meta device (trainer.init_module(empty_init=True) or "
                    f"configure_model) and its module ({kind}) has no reset_parameters(): give it a value with "
                    "init_from=PATH (pretrained safetensors), or define init_weights(self, module) on the "
                    "LightningModule (called for every submodule, as Hugging Face's _init_weights)"
                )

    def materialize(self, slots: list[ParamSlot], block: Block | None) -> list[ParamSlot]:
        """Give ``slots``' parameters (a block's, or the frozen ones when ``block`` is None) real host tensors
        with their values: from the pretrained file where one is given, else the init route. Returns the slots
        the init route filled (data parallel ranks take rank 0's values of those)."""
        if self.pretrained is not None:
            adapters = []
            for slot in slots:
                if slot.param.is_meta:
                    _swap_in(slot.param, torch.empty(slot.shape, dtype=slot.dtype))
                if slot.name in self.pretrained.adapters:
                    adapters.append(slot)
                else:
                    self.pretrained.fill(slot.name, slot.param)
            with torch.no_grad():  # the adapters no checkpoint holds: PEFT's own init (random A; LoRA's B zero)
                initialize_adapters(self.model, [self.pretrained.adapters[s.name] for s in adapters])
            return adapters
        metas = [s for s in slots if s.param.is_meta]
        if not metas:
            return []
        for slot in metas:  # NaN first: a value the route forgot is caught, never trained on
            _swap_in(slot.param, torch.full(slot.shape, float("nan"), dtype=slot.dtype))
        targets = [s.param for s in metas]
        with torch.no_grad():
            if self.init_weights is not None:
                roots = [block.module] if block is not None and block.module is not None else []
                roots = roots or owners(self.model, targets)
                # a root's other parameters (frozen, shared, already written) keep the values they have
                wanted = {id(p) for p in targets}
                others = [p for root in roots for p in root.parameters() if id(p) not in wanted]
                kept = [p.detach().clone() for p in others]
                for root in roots:
                    root.apply(self.init_weights)
                for p, value in zip(others, kept, strict=True):
                    p.copy_(value)
            else:
                for module in owners(self.model, targets):
                    module.reset_parameters()  # type: ignore[operator]
        for slot in metas:
            if slot.param.is_floating_point() and bool(torch.isnan(slot.param).any()):
                raise ConfigError(
                    f"the init route left parameter {slot.name} without a value (NaN): make init_weights(module) "
                    "or reset_parameters() set every parameter of the modules it handles"
                )
        return metas


def _swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Turn the meta ``param`` into a real one holding ``value``, keeping the object (the optimizer holds it)."""
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
