"""lightning-smartinf: SSD-offloaded LLM training as a PyTorch Lightning strategy.

Importing the package registers ``"smart_infinity"`` (and its presets) in Lightning's StrategyRegistry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_smartinf.strategy import SmartInfinityStrategy

if SmartInfinityStrategy.strategy_name not in StrategyRegistry:
    SmartInfinityStrategy.register_strategies(StrategyRegistry)

__all__ = ["SmartInfinityStrategy"]
__version__ = "0.1.0"
