"""The engine's wiring: placement decided before the stores are built, the parts made by name, and the engine naming
each part once, where grep finds it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from helpers import fit, make_module

from lightning_smartinf.engine import build, engine, sizing
from lightning_smartinf.engine.build import EngineParts
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.storage.aligned import align_up
from lightning_smartinf.update import quant8


def test_the_engine_names_every_part_once_by_assignment() -> None:
    init = next(n for n in ast.walk(ast.parse(inspect.getsource(engine.OffloadEngine)))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")  # fmt: skip
    assigned = [t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(n.value, ast.Attribute) and t.attr == n.value.attr
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "parts"]  # fmt: skip
    fields = [f.name for f in dataclasses.fields(EngineParts)]
    assert sorted(assigned) == sorted(fields)  # each part once, none missed
    assert "vars(" not in inspect.getsource(engine.OffloadEngine.__init__)


def test_the_stores_a_placement_splits_are_built_with_their_ram_names() -> None:
    assert ".host_keys =" not in inspect.getsource(build)  # never patched after the parts are made


def test_build_makes_the_parts_by_keyword() -> None:
    calls = [n for n in ast.walk(ast.parse(inspect.getsource(build.build)))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "EngineParts"]  # fmt: skip
    assert calls and all(not call.args for call in calls)


EIGHT_BIT = {"state_precision": "8bit"}


@pytest.mark.parametrize(("update", "compression", "state"), [
    ({"host_adam": "torch"}, {}, {}),
    ({"host_adam": "torch"}, {}, EIGHT_BIT),
    ({"host_adam": "torch"}, {}, {**EIGHT_BIT, "min_8bit_size": 0, "fp32_embedding_state": False}),
    ({"backend": "smart", "devices": 2}, {"kind": "topk", "keep": 0.01}, {}),
    ({"backend": "smart", "devices": 2}, {}, EIGHT_BIT),
])  # fmt: skip
def test_the_pools_counted_before_the_placement_are_the_pools_made(update: dict, compression: dict, state: dict,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """``host_memory_budget=auto`` sizes the budget before any part exists, from the shapes of the pools each part
    will make: those are the bytes the parts hold once made. With 8-bit state the state's buffers are sized for the
    largest state tensor: the quantized one where every parameter's state is 8-bit."""
    offload = {"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads", "grads": "cpu", **state}
    strategy = SmartInfinityStrategy(offload=offload, update=update, compression=compression)
    trainer = fit(make_module(), strategy, max_steps=1)
    made = trainer.strategy.engine
    planned = sizing.planned_pool_bytes(made.layout, made.frozen_layout, made.itemsize, made.frozen_itemsize,
                                       made.rule, strategy.offload, strategy.update, strategy.compression,
                                       made.param_dtype)  # fmt: skip
    assert planned == made.parts.pool_bytes > 0
    if update.get("backend") != "smart":
        largest = max(sg.numel for sg in made.layout.subgroups)
        quantized = state.get("min_8bit_size") == 0
        want = quant8.payload(largest, quant8.INT8) if quantized else 4 * largest
        assert made.updater.state_pool.nbytes == align_up(want)
