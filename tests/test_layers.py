"""The package's layers import one way: every module sits in exactly one layer of the table in tests/layers.py,
imports only the layers and third-party packages that layer allows (every import, also under ``TYPE_CHECKING``, in
functions, relative or through the package root), and docs/architecture.md shows the same table."""

from __future__ import annotations

import ast
from pathlib import Path

import layers
import pytest

PACKAGE = layers.PACKAGE


def test_every_module_has_a_layer_and_imports_only_what_it_may() -> None:
    assert not layers.violations(), "\n".join(layers.violations())


def test_no_import_cycles() -> None:
    assert not layers.cycles()


def test_docs_show_the_table() -> None:
    assert layers.documented() == layers.render(), "run `python tests/layers.py --write` and commit docs/"


def test_docs_show_the_codes_shape_as_it_is() -> None:
    """docs/architecture.md's shape table is generated: a change to the code's shape regenerates it."""
    shape = layers.documented(layers.SHAPE_BEGIN, layers.SHAPE_END)
    assert shape == layers.render_shape(), "run `python tests/layers.py --write` and commit docs/"


def test_the_checker_resolves_every_kind_of_import(tmp_path: Path) -> None:
    package = tmp_path / "engine"
    package.mkdir()
    source = package / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport lightning_smartinf.engine.engine\nimport lightning.pytorch\n"
        "from lightning_smartinf.update import smart\nfrom lightning_smartinf import trace\n"
        "from . import params\nfrom ..storage.store import FileStore\nif TYPE_CHECKING:\n"
        "    from lightning_smartinf.config import X\n"
        "def f():\n    from lightning_smartinf.schedule.vertical import Y\n"
    )
    ours, theirs = layers.imports("engine.m", source)
    assert ours == {"engine.engine", "update.smart", "trace", "engine.params", "storage.store", "config",
                    "schedule.vertical"}  # fmt: skip
    assert "lightning" in theirs


def test_a_module_without_a_layer_or_with_a_forbidden_import_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = tmp_path / "loose.py"
    loose.write_text("x = 1\n")
    engine = tmp_path / "engine.py"
    engine.write_text("import lightning\nfrom lightning_smartinf.lightning import strategy\n")
    known = layers.modules()
    monkeypatch.setattr(layers, "modules", lambda: {**known, "loose": loose, "engine.bad": engine})
    monkeypatch.setattr(layers, "ROOT", tmp_path.parent)
    wrong = "\n".join(layers.violations())
    assert "loose (" in wrong and "belongs to no layer: add it to LAYERS in tests/layers.py" in wrong
    assert "engine.bad (engine) imports lightning.strategy (lightning)" in wrong
    assert "engine.bad (engine) imports lightning, which only lightning, models, commands may import" in wrong


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
    wrong = [w for module, path in layers.modules().items() if layers.layer_of(module) != layers.layer_of("engine")
             for w in _engine_writes(path)]  # fmt: skip
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


def test_the_package_root_registers_both_strategies_without_importing_them() -> None:
    """``import lightning_smartinf`` names the strategies in both registries; the strategies and the engine are
    imported when a Trainer or Fabric asks for one by name."""
    import subprocess
    import sys

    script = """
import sys
import lightning_smartinf
loaded = [m for m in sys.modules if m.startswith(("lightning_smartinf.engine", "lightning_smartinf.lightning.strategy",
                                                  "lightning_smartinf.lightning.fabric"))]
assert not loaded, loaded
import lightning as L
import lightning.pytorch as pl
trainer = pl.Trainer(strategy="smart_infinity_cpu_params", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy).__name__ == "SmartInfinityStrategy" and trainer.strategy.offload.params == "cpu"
fabric = L.Fabric(strategy="smart_infinity", accelerator="cpu", devices=1)
assert type(fabric.strategy).__name__ == "SmartInfinityFabricStrategy"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
