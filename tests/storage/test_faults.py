"""Injected storage faults never become wrong values in the model: each is retried (a transient one) or surfaces as
an error naming the file (a broken one), on the real I/O path (real files, a real backend under the fault layer)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FaultPlan, FaultyBackend
from helpers import fit, make_module

from lightning_smartinf.engine import build as build_module
from lightning_smartinf.errors import StorageError
from lightning_smartinf.storage.store import CorruptReadError


def train(smart: Any, monkeypatch: pytest.MonkeyPatch, plan: FaultPlan | None, **offload: Any) -> dict[str, Any]:
    """Six steps of the tiny GPT with every state file behind ``plan``'s faults; the masters after."""
    real = build_module.backend_for
    if plan is not None:
        monkeypatch.setattr(build_module, "backend_for", lambda d, s=None: FaultyBackend(real(d, s), plan))
    strategy = smart(**offload)
    try:
        fit(make_module(), strategy, max_steps=6)
        return strategy.consolidated_state_dict()
    finally:
        strategy.close()
        monkeypatch.setattr(build_module, "backend_for", real)


@pytest.mark.parametrize("kinds", [("read_eio",), ("bad_read",), ("write_eio",), ("read_eio", "bad_read", "write_eio")])
def test_transient_faults_are_retried_and_training_is_bit_exact(smart, monkeypatch, caplog, kinds) -> None:
    clean = train(smart, monkeypatch, None)
    plan = FaultPlan(kinds, rate=0.05, limit=4, seed=1)
    with caplog.at_level(logging.WARNING, "lightning_smartinf.storage.store"):
        faulted = train(smart, monkeypatch, plan)
    assert len(plan.injected) == 4 and len({(i.kind, i.path) for i in plan.injected}) == 4, plan.injected
    retried = [r for r in caplog.records if "retrying once" in r.getMessage()]
    assert len(retried) == len(plan.injected)  # every fault was noticed, and said so
    assert all(torch.equal(faulted[k], v) for k, v in clean.items())


def test_a_file_that_keeps_returning_wrong_bytes_is_an_error_naming_it(smart, monkeypatch) -> None:
    plan = FaultPlan(("bad_read",), rate=1.0, limit=1, sticky=True, where=lambda p: p.parent.name == "master")
    with pytest.raises(CorruptReadError, match=r"master sg\d+ from .*/master/sg\d+: the bytes read differ"):
        train(smart, monkeypatch, plan)


def test_a_torn_write_is_an_error_naming_the_file(smart, monkeypatch) -> None:
    plan = FaultPlan(("torn_write",), rate=1.0, limit=1, where=lambda p: p.parent.name == "exp_avg")
    with pytest.raises(StorageError, match=r"/exp_avg/sg\d+"):
        train(smart, monkeypatch, plan)


def test_a_disk_that_keeps_failing_is_an_error_naming_the_file(smart, monkeypatch) -> None:
    plan = FaultPlan(("write_eio",), rate=1.0, limit=1, sticky=True, where=lambda p: p.parent.name == "param")
    with pytest.raises(StorageError, match=r"writing \d+ bytes to .*/param/sg\d+ failed: injected I/O error \(EIO\)"):
        train(smart, monkeypatch, plan)


def test_without_verification_a_bad_read_goes_unnoticed(smart, monkeypatch) -> None:
    """What ``offload.verify_io`` is for: the same flipped bit, unchecked, trains into the model."""
    clean = train(smart, monkeypatch, None)
    plan = FaultPlan(("bad_read",), rate=1.0, limit=1, where=lambda p: p.parent.name == "master")
    faulted = train(smart, monkeypatch, plan, verify_io=False)
    assert len(plan.injected) == 1
    assert not all(torch.equal(faulted[k], v) for k, v in clean.items())


def test_faults_tests_use_real_files(tmp_path: Path, smart) -> None:
    """The fault layer wraps the engine's own backend: the state files exist where the strategy put them."""
    strategy = smart()
    fit(make_module(), strategy, max_steps=1)
    strategy.close()
    assert any((tmp_path / "state").rglob("sg000000"))
