"""Loading DeepSpeed's JIT-compiled ops (async I/O, CPU Adam) with a word to the user about what the wait is.

The ops are built per Python environment: torch's default cache (``~/.cache/torch_extensions/py311_cpu``) is one
directory for every environment on the machine, so two virtualenvs with different torch or DeepSpeed versions
rebuild each other's ops at every switch (minutes each). Unless the user set ``TORCH_EXTENSIONS_DIR``, it is set to
a directory named after the environment's prefix (``environment_extensions_dir``), for this process and the ones it
starts (DeepSpeed's own engine in ``smartinf-bench``).

The first load compiles the op (minutes); torch guards the build with a ``lock`` file in the build directory and
waits, without a limit, while one exists. A build killed part-way leaves that file behind, and every later load
would then hang silently. So before loading we say when a compile is coming, remove a lock that no live build holds,
and wait on one that a live build holds for a bounded time only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning_smartinf.errors import SetupError
from lightning_smartinf.extras import available

log = logging.getLogger(__name__)


class BuildLockTimeout(SetupError, TimeoutError):
    """A live build of a DeepSpeed op held its lock longer than we wait."""


def environment_extensions_dir() -> Path:
    """This environment's own op cache: under the user's cache, named by the environment's prefix and a hash of its
    path (``sys.prefix`` differs per virtualenv), so no two environments share one."""
    prefix = Path(sys.prefix).resolve()
    tag = f"{prefix.name}-{hashlib.sha256(str(prefix).encode()).hexdigest()[:10]}"
    return Path("~/.cache/lightning_smartinf/torch_extensions").expanduser() / tag


def use_environment_extensions_dir() -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` to ``environment_extensions_dir()`` unless the user set it; return it."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(environment_extensions_dir())
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def extension_build_directory(name: str) -> Path:
    """Where torch builds the extension ``name`` (in this environment's op cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    use_environment_extensions_dir()
    return Path(_get_build_directory(name, False))


def build_lock(name: str) -> Path | None:
    """The build lock of op ``name`` if one exists now (a build in progress, or one killed part-way)."""
    lock = extension_build_directory(name) / "lock"
    return lock if lock.exists() else None


def build_in_progress(directory: Path) -> bool:
    """Whether a live process is building in ``directory``: torch runs ninja (and the compiler under it) with the
    build directory as its working directory."""
    target = directory.resolve()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = (proc / "cwd").resolve()
        except OSError:
            continue
        if cwd == target or target in cwd.parents:
            return True
    return False


def clear_stale_lock(name: str, directory: Path, grace: float = 10.0, patience: float = 1800.0) -> None:
    """A build lock with no live build behind it (left by a killed compile) is removed, with a warning; one with a
    build behind it is waited on for up to ``patience`` seconds, then an error names the lock and the fix. torch
    itself would wait on either forever."""
    lock = directory / "lock"
    started = time.monotonic()
    warned = False
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if not build_in_progress(directory):
            if age >= grace:
                log.warning("DeepSpeed's %s op: removed the build lock %s, which no live build holds (a compile "
                            "was killed part-way); building again", name, lock)  # fmt: skip
                lock.unlink(missing_ok=True)
                return
        elif not warned:
            log.warning("DeepSpeed's %s op is being built by another process (lock %s): waiting for it", name, lock)
            warned = True
        if time.monotonic() - started > patience:
            raise BuildLockTimeout(
                f"DeepSpeed's {name} op: the build holding {lock} has not finished in {patience:.0f} s; stop it, then "
                f"`rm {lock}` and run again"
            )
        time.sleep(1.0)


def load_op(builder: Any) -> Any:
    """``builder.load()``, logging a first-use compile; a build lock left by a killed build is cleared first, and
    one held by a live build is waited on with a limit (``clear_stale_lock``)."""
    directory = extension_build_directory(builder.NAME)
    clear_stale_lock(builder.NAME, directory)
    if not (directory / f"{builder.NAME}.so").exists():
        log.info("compiling DeepSpeed's %s op in %s (first use only; a few minutes)", builder.NAME, directory)
    return builder.load(verbose=False)


def build_all() -> list[str]:
    """Compile (or load) every op the engine can use, in this process; returns the names of those that loaded."""
    use_environment_extensions_dir()
    loaded: list[str] = []
    if not available("deepspeed"):
        return loaded
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    for builder in (AsyncIOBuilder(), CPUAdamBuilder()):
        if builder.is_compatible(verbose=False):
            load_op(builder)
            loaded.append(builder.NAME)
    return loaded
