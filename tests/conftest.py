"""Session set-up (PoCL devices, DeepSpeed ops built once) and shared fixtures; helpers live in helpers.py."""

from __future__ import annotations

import os

# PoCL reads this once, at the first platform query of the process: three CPU devices for the SmartUpdate tests.
os.environ.setdefault("POCL_DEVICES", "pthread pthread pthread")

import logging  # noqa: E402
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import lightning_smartinf


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile DeepSpeed's ops here, once, before any test: otherwise the first command-line test would compile them
    inside a subprocess with a timeout, and a build killed part-way leaves a lock that hangs every later load."""
    from lightning_smartinf.ops import build_all, build_lock

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("building DeepSpeed's ops (first run on a machine only: a few minutes)")
        for name in ("async_io", "cpu_adam"):
            if (lock := build_lock(name)) is not None:
                reporter.write_line(f"found {lock}: waiting if a build holds it, removing it if none does")
    loaded = build_all()
    from lightning_smartinf.update import quant8

    if quant8.kernel() is not None:  # the 8-bit state kernel, for the same reason
        loaded.append(quant8.KERNEL)
    if reporter is not None:
        reporter.write_line(f"ops ready: {', '.join(loaded) or 'none compatible'}")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


@pytest.fixture
def smart(tmp_path: Path) -> Callable[..., lightning_smartinf.SmartInfinityStrategy]:
    """A factory of strategies with their state under the test's tmp_path (thread I/O, torch Adam: no compiles), all
    of it on storage (``host_memory_budget=0``): the suite checks the storage path, tests/engine/test_placement.py
    the default budget's placement in RAM."""

    def build(**offload: Any) -> lightning_smartinf.SmartInfinityStrategy:
        update = {"host_adam": "torch", **offload.pop("update", {})}
        settings = {"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads",
                    "host_memory_budget": "0", **offload}
        settings["nvme_path"] = str(settings["nvme_path"])
        return lightning_smartinf.SmartInfinityStrategy(offload=settings, update=update)

    build.root = tmp_path  # type: ignore[attr-defined]
    return build
