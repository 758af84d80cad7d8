"""The optional dependencies: which extra brings each, and the one line a run gives where one is missing.

The base install trains (``smartinf-train``'s default job): without DeepSpeed the engine's I/O is a thread pool of
pread/pwrite and its Adam is torch's; without matplotlib a run writes no PNG. What cannot fall back (SmartUpdate's
OpenCL devices without pyopencl, ``smartinf-bench``'s DeepSpeed baseline) stops with the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from lightning_smartinf.errors import ConfigError

EXTRAS = {"deepspeed": "deepspeed", "pyopencl": "smart", "matplotlib": "plots"}
"""Module -> the extra of ``lightning-smartinf`` that installs it (``all`` installs every one)."""


def missing(module: str, what: str) -> str:
    """The line for ``what`` (a feature, a command) without ``module``."""
    return f"{what} needs {module}, which is not installed: pip install 'lightning-smartinf[{EXTRAS[module]}]'"


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(module: str, what: str) -> ModuleType:
    """``module`` imported, or a ConfigError with the one line naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports failed: that error is the one to see
        raise ConfigError(missing(module.split(".")[0], what)) from err


def pyplot(what: str) -> ModuleType:
    """matplotlib's pyplot drawing to files (the Agg backend, no display), or the one line naming the extra."""
    require("matplotlib", what).use("Agg")
    return importlib.import_module("matplotlib.pyplot")
