"""The names the Trainer's and Fabric's strategy registries know this package by, registered without importing the
strategies: each name maps to a factory that imports its strategy (and the engine below it) only when a Trainer or
Fabric asks for it, so ``import lightning_smartinf`` stays light."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch.strategies import Strategy, StrategyRegistry

TRAINER_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "smart_infinity": ("SSD-offloaded training (smart_infinity)", {}),
    "smart_infinity_cpu_params": ("smart_infinity with 16-bit params and gradients in host RAM",
                                  {"offload": {"params": "cpu", "grads": "cpu"}}),
}  # fmt: skip
"""Name: (description, the keywords the strategy is built with)."""


def trainer_strategy(**settings: Any) -> Strategy:
    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

    return SmartInfinityStrategy(**settings)


def fabric_strategy(**settings: Any) -> FabricStrategy:
    from lightning_smartinf.lightning.fabric import SmartInfinityFabricStrategy

    return SmartInfinityFabricStrategy(**settings)


def register() -> None:
    """Register every name once (importing the package again registers nothing twice)."""
    for name, (description, settings) in TRAINER_PRESETS.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, trainer_strategy, description=description, **settings)
    if "smart_infinity" not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register("smart_infinity", fabric_strategy, description=TRAINER_PRESETS["smart_infinity"][0])
