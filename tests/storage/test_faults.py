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
from lightning_smartinf.engine.engine import OffloadEngine
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


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(data)


def test_a_state_file_damaged_before_a_save_is_not_saved(smart, tmp_path: Path) -> None:
    """A disk that kept wrong bytes under a file no step has read since: the checkpoint's copy checks the bytes
    against the run's write sum, so the damage cannot enter a checkpoint under a valid SHA-256."""
    strategy = smart()
    try:
        trainer = fit(make_module(), strategy, max_steps=2)
        _flip(next((tmp_path / "state" / "master").iterdir()))
        with pytest.raises(CorruptReadError, match=r"copying .*/master/sg\d+: its first \d+ bytes differ"):
            trainer.save_checkpoint(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()
    finally:
        strategy.close()


def test_a_restored_state_file_is_checked_when_read(smart, monkeypatch, tmp_path: Path) -> None:
    """A resume writes the live state files from the checkpoint outside the stores; their reads are checked against
    the bytes it wrote, so a torn restore is an error, not a model trained on wrong state."""
    strategy = smart()
    trainer = fit(make_module(), strategy, max_steps=2)
    trainer.save_checkpoint(tmp_path / "ckpt")
    strategy.close()
    real = OffloadEngine.replaced

    def torn(engine: OffloadEngine, files: dict[Path, Any]) -> None:
        real(engine, files)
        _flip(sorted(p for p in files if p.parent.name == "master")[0])

    monkeypatch.setattr(OffloadEngine, "replaced", torn)
    with pytest.raises(CorruptReadError, match=r"master sg000000 from .*/master/sg000000: the bytes read differ"):
        fit(make_module(), smart(), max_steps=4, ckpt_path=str(tmp_path / "ckpt"))
