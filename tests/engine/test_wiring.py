"""The engine's wiring: build makes the parts by name, and the engine names each part once, where grep finds it."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from lightning_smartinf.engine import build, engine
from lightning_smartinf.engine.build import EngineParts


def test_the_engine_names_every_part_once_by_assignment() -> None:
    init = next(n for n in ast.walk(ast.parse(inspect.getsource(engine.OffloadEngine)))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")  # fmt: skip
    assigned = [t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(n.value, ast.Attribute) and t.attr == n.value.attr
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "parts"]  # fmt: skip
    fields = [f.name for f in dataclasses.fields(EngineParts)]
    assert sorted(assigned) == sorted(fields)  # each part once, none missed
    assert "vars(" not in inspect.getsource(engine.OffloadEngine.__init__)


def test_build_makes_the_parts_by_keyword() -> None:
    calls = [n for n in ast.walk(ast.parse(inspect.getsource(build.build)))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "EngineParts"]  # fmt: skip
    assert calls and all(not call.args for call in calls)
