"""PEFT adapters (LoRA) inside a model, recognised without importing peft: which parameters are adapters, the
checkpoint name of a wrapped base weight, and the adapters' own init for a model built on meta.

``get_peft_model`` moves each targeted layer's weight under ``base_layer`` (``...q_proj.base_layer.weight``, which a
pretrained directory names ``...q_proj.weight``) and adds adapter modules beside it (``lora_A``, ``lora_B``: the
tuner layer's ``adapter_layer_names``), which no pretrained directory holds: they take PEFT's init.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

BASE_LAYER = ".base_layer."


def checkpoint_name(module_name: str) -> str:
    """The name a pretrained directory gives a parameter that PEFT wrapped (``.base_layer.`` dropped)."""
    return module_name.replace(BASE_LAYER, ".")


def adapter_parameters(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id of every adapter parameter -> (its tuner layer, the adapter's name), for the tuner layers in ``model``."""
    found: dict[int, tuple[nn.Module, str]] = {}
    for layer in model.modules():
        for attribute in getattr(layer, "adapter_layer_names", ()):
            container = getattr(layer, attribute, None)
            if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
                continue
            for adapter, part in container.items():
                params = [part] if isinstance(part, nn.Parameter) else list(part.parameters())
                for p in params:
                    found[id(p)] = (layer, adapter)
    return found


def _peft_config(model: nn.Module, adapter: str) -> Any:
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return configs[adapter]
    return None


def initialize_adapters(model: nn.Module, layers: list[tuple[nn.Module, str]]) -> None:
    """Give adapters built on meta (their parameters already real, unfilled) PEFT's own init, as its config says:
    ``reset_lora_parameters(adapter, init_lora_weights)`` (LoRA's B zero: the model starts as its base)."""
    done: set[tuple[int, str]] = set()
    for layer, adapter in layers:
        if (id(layer), adapter) in done:
            continue
        done.add((id(layer), adapter))
        reset = getattr(layer, "reset_lora_parameters", None)
        if reset is None:
            raise NotImplementedError(
                f"{type(layer).__name__}: only LoRA adapters can be built on meta; build this PEFT model eagerly"
            )
        config = _peft_config(model, adapter)
        reset(adapter, getattr(config, "init_lora_weights", True))


@dataclass(frozen=True)
class Merge:
    """One LoRA layer's merge: ``base += scaling x B @ A`` (transposed for a ``fan_in_fan_out`` layer)."""

    base: str
    lora_a: str
    lora_b: str
    scaling: float
    transpose: bool


def lora_merges(model: nn.Module) -> list[Merge]:
    """Every LoRA layer of ``model`` with its adapters' parameter names, as ``merge_and_unload`` would merge them."""
    merges = []
    for name, layer in model.named_modules():
        lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
            continue
        for adapter in lora_a:
            merges.append(Merge(f"{name}.base_layer.weight", f"{name}.lora_A.{adapter}.weight",
                                f"{name}.lora_B.{adapter}.weight", float(layer.scaling[adapter]),
                                bool(getattr(layer, "fan_in_fan_out", False))))  # fmt: skip
    return merges


def merged_name(name: str) -> str:
    """A merged model's name for a parameter of a PEFT model: the base layer's own (``.base_layer.`` dropped) under
    the base model's prefix (PEFT's ``base_model.model.`` dropped)."""
    return checkpoint_name(name).replace("base_model.model.", "", 1)


def merge_block(tensors: dict[str, Any], merges: list[Merge]) -> dict[str, Any]:
    """One block's tensors with its LoRA adapters merged into their base weights and left out, renamed as the
    merged model names them (``merge_and_unload`` semantics, computed in fp32)."""
    out = dict(tensors)
    for m in merges:
        if m.base not in out:
            continue
        delta = out.pop(m.lora_b).float() @ out.pop(m.lora_a).float()  # (out, r) @ (r, in) -> (out, in)
        base = out[m.base]
        out[m.base] = (base.float() + m.scaling * (delta.T if m.transpose else delta)).to(base.dtype)
    return {merged_name(name): value for name, value in out.items()}
