"""lightning-smartinf: SSD-offloaded LLM training as a PyTorch Lightning strategy.

Importing the package registers ``"smart_infinity"`` (and its presets) in the Trainer's StrategyRegistry and in
Fabric's (``L.Fabric(strategy="smart_infinity")``); both strategies live in ``lightning_smartinf.lightning``, the
one layer that speaks Lightning. Without Lightning the package still imports, and so do the engine, storage,
updaters, compression, schedules and checkpoints below it (``tests/test_layers.py`` imports them with Lightning
absent; ``tests/layers.py`` holds the table of layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

__all__ = ["SmartInfinityStrategy"]
__version__ = "0.1.0"


def _register() -> None:
    try:
        import lightning  # noqa: F401
    except ImportError:  # no Lightning: nothing to register with; the layers below it work without it
        return
    from lightning_smartinf.lightning.registry import register

    register()


def __getattr__(name: str) -> Any:
    if name == "SmartInfinityStrategy":
        from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

        return SmartInfinityStrategy
    raise AttributeError(f"module 'lightning_smartinf' has no attribute {name!r}")


_register()
