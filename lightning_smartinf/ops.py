"""Loading DeepSpeed's JIT-compiled ops (async I/O, CPU Adam) with a word to the user about what the wait is.

The first load compiles the op (minutes); torch guards the build with a ``lock`` file in the build directory and
waits, without a limit, while one exists. A build killed part-way leaves that file behind, and every later load
then hangs silently. So before loading we say when a compile is coming, and name a leftover lock and how to clear it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, False))


def build_lock(name: str) -> Path | None:
    """The build lock of op ``name`` if one exists now (a build in progress, or one killed part-way)."""
    lock = _build_directory(name) / "lock"
    return lock if lock.exists() else None


def load_op(builder: Any) -> Any:
    """``builder.load()``, logging a first-use compile and warning about a build lock left by a killed build."""
    directory = _build_directory(builder.NAME)
    lock = build_lock(builder.NAME)
    if lock is not None:
        log.warning(
            "DeepSpeed's %s op: waiting for the build lock %s. If no other process is compiling it, a killed build "
            "left it behind and this waits forever: delete that file",
            builder.NAME,
            lock,
        )
    elif not (directory / f"{builder.NAME}.so").exists():
        log.info("compiling DeepSpeed's %s op in %s (first use only; a few minutes)", builder.NAME, directory)
    return builder.load(verbose=False)


def build_all() -> list[str]:
    """Compile (or load) every op the engine can use, in this process; returns the names of those that loaded."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    loaded = []
    for builder in (AsyncIOBuilder(), CPUAdamBuilder()):
        if builder.is_compatible(verbose=False):
            load_op(builder)
            loaded.append(builder.NAME)
    return loaded
