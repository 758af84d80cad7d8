"""lightning-smartinf: SSD-offloaded LLM training as a PyTorch Lightning strategy.

Importing the package registers ``"smart_infinity"`` (and its presets) in Lightning's StrategyRegistry. Lightning is
needed by the strategy alone: without it the package still imports, and so do the engine, storage, updaters,
compression, schedules and checkpoints below it (``tests/test_layers.py`` imports them with Lightning absent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.strategy import SmartInfinityStrategy

__all__ = ["SmartInfinityStrategy"]
__version__ = "0.1.0"


def _register() -> None:
    try:
        from lightning.pytorch.strategies import StrategyRegistry
    except ImportError:  # no Lightning: nothing to register with; the layers below the strategy work without it
        return
    from lightning_smartinf.strategy import SmartInfinityStrategy

    if SmartInfinityStrategy.strategy_name not in StrategyRegistry:
        SmartInfinityStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    if name == "SmartInfinityStrategy":
        from lightning_smartinf.strategy import SmartInfinityStrategy

        return SmartInfinityStrategy
    raise AttributeError(f"module 'lightning_smartinf' has no attribute {name!r}")


_register()
