"""PEFT adapters (LoRA) inside a model, recognised without importing peft: which parameters are adapters, the
checkpoint name of a wrapped base weight, and the adapters' own init for a model built on meta.

``get_peft_model`` moves each targeted layer's weight under ``base_layer`` (``...q_proj.base_layer.weight``, which a
pretrained directory names ``...q_proj.weight``) and adds adapter modules beside it (``lora_A``, ``lora_B``: the
tuner layer's ``adapter_layer_names``), which no pretrained directory holds: they take PEFT's init.
"""

from __future__ import annotations

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
