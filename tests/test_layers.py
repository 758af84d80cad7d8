"""The package's layers import one way (docs/architecture.md): every import of a package module, including those
under ``TYPE_CHECKING`` and inside functions, read from the source's syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_smartinf"

BOTTOM = {"core", "errors", "trace"}
"""Modules that import nothing of the package."""

FORBIDDEN: dict[str, set[str]] = {
    "storage": {"engine", "update", "compress", "schedule", "checkpoint", "config", "strategy", "precision",
                "fabric"},
    "update": {"engine", "schedule", "checkpoint", "strategy", "precision", "fabric"},
    "compress": {"engine", "update", "schedule", "checkpoint", "strategy", "precision", "fabric"},
    "schedule": {"engine", "update", "compress", "checkpoint", "strategy", "precision", "fabric"},
    "checkpoint": {"engine", "update", "compress", "schedule", "strategy", "precision", "fabric"},
    "engine": {"strategy", "fabric", "precision", "monitor", "timeline", "cli", "bench", "models", "data"},
    "ecosystem": {"engine", "update", "compress", "schedule", "checkpoint", "storage", "config", "strategy",
                  "precision", "fabric", "monitor", "timeline", "cli", "bench", "models", "data", "processes",
                  "meta"},
}
"""For each layer, the parts of the package it must not import (those above it, and its siblings)."""


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, as dotted names below ``lightning_smartinf``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith("lightning_smartinf."):
                found.add(name.removeprefix("lightning_smartinf."))
            elif name == "lightning_smartinf":
                found.add("")
    return found


def _modules() -> list[tuple[str, Path]]:
    return [(".".join(p.relative_to(PACKAGE).with_suffix("").parts), p) for p in sorted(PACKAGE.rglob("*.py"))]


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer: str) -> None:
    wrong = [
        f"{module} imports {target}"
        for module, path in _modules()
        if _top(module) == layer
        for target in _imports(path)
        if _top(target) in FORBIDDEN[layer]
    ]
    assert not wrong, wrong


def test_bottom_modules_import_nothing_of_the_package() -> None:
    wrong = {module: sorted(_imports(path)) for module, path in _modules() if module in BOTTOM and _imports(path)}
    assert not wrong, wrong


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport lightning_smartinf.engine.engine\n"
        "from lightning_smartinf.update import smart\nif TYPE_CHECKING:\n    from lightning_smartinf.config import X\n"
        "def f():\n    from lightning_smartinf.schedule.vertical import Y\n"
    )
    found = {_top(name) for name in _imports(source)}
    assert found == {"engine", "update", "config", "schedule"}


def _engine_writes(path: Path) -> list[str]:
    """Assignments to an attribute of something named ``engine`` (``engine.x = ``, ``self.engine.x += ``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute):
                owner = target.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "engine":
                    found.append(f"{path.name}:{node.lineno} sets engine.{target.attr}")
    return found


def test_only_the_engine_writes_its_state() -> None:
    """Callers configure the engine through its methods (configure_step, count_micro_batch, discard_gradients)."""
    wrong = [w for module, path in _modules() if _top(module) != "engine" for w in _engine_writes(path)]
    assert not wrong, wrong


def test_the_layers_below_the_strategy_import_and_train_without_lightning() -> None:
    """The engine is Lightning-free in fact: with ``lightning`` unimportable, every lower layer imports and an
    engine trains a plain torch model one step."""
    import subprocess
    import sys

    script = """
import sys
for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
    sys.modules[name] = None
import tempfile, torch
from torch import nn
import lightning_smartinf.storage.store, lightning_smartinf.update.host, lightning_smartinf.compress.topk
import lightning_smartinf.schedule.vertical, lightning_smartinf.checkpoint.manifest, lightning_smartinf.ecosystem.hf
from lightning_smartinf.config import OffloadConfig, UpdateConfig
from lightning_smartinf.engine.engine import OffloadEngine

model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8) for _ in range(2)]))
blocks = model[0]
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
with tempfile.TemporaryDirectory() as root:
    engine = OffloadEngine(model, opt, OffloadConfig(nvme_path=root, io_backend="threads", host_memory_budget="0"),
                           UpdateConfig(host_adam="torch"), torch.device("cpu"), torch.float32)
    x = torch.randn(4, 8)
    engine.backward(blocks[1](blocks[0](x)).square().mean())
    assert engine.step().applied
    engine.close()
assert "lightning" not in [m.split(".")[0] for m, v in sys.modules.items() if v is not None]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
