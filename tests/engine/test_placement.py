"""offload.host_memory_budget: gradients and a share of the optimizer state in host memory, exact against plain
training and against the all-on-storage engine, resumable under any other budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, make_module, relative_error, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.checkpoint import latest_checkpoint
from lightning_smartinf.core import Subgroup
from lightning_smartinf.engine import sizing
from lightning_smartinf.engine.placement import place
from lightning_smartinf.engine.snapshot import engine_nbytes
from lightning_smartinf.errors import ConfigError


def strategy(root: Path, budget: str) -> SmartInfinityStrategy:
    return SmartInfinityStrategy(offload={"nvme_path": str(root), "subgroup_size": 4096, "io_backend": "threads",
                                          "host_memory_budget": budget}, update={"host_adam": "torch"})  # fmt: skip


def sixteen(sg: Subgroup) -> float:
    """The state bytes of an element, for these checks: 16 in every subgroup."""
    return 16


def test_the_budget_takes_parameters_then_gradients_then_subgroups_in_forward_order(smart, tmp_path: Path) -> None:
    trainer = fit(make_module(), smart(), max_steps=1)
    layout = trainer.strategy.engine.layout
    grads = 4 * layout.local_numel
    first = layout.subgroups[0]
    placed = place(grads + 16 * first.numel, layout, sixteen, grads=True, state=True)
    assert placed.grads and placed.state == {first.key} and placed.nbytes == grads + 16 * first.numel
    assert place(grads - 1, layout, sixteen, True, True).grads is False
    # SmartUpdate: the devices' state; offload.grads=cpu: in RAM already
    assert place(10**12, layout, sixteen, grads=True, state=False).state == frozenset()
    assert place(10**12, layout, sixteen, grads=False, state=True).grads is False
    # the 16-bit parameters of the streamed blocks come before everything (the resident block's are in RAM already)
    streamed = [sg for sg in layout.subgroups if not layout.blocks[sg.block].resident]
    every = 2 * sum(sg.numel for sg in streamed)
    placed = place(every + grads, layout, sixteen, grads=True, state=True, params_itemsize=2)
    assert placed.params == {sg.key for sg in streamed} and placed.grads and not placed.state
    placed = place(2 * streamed[0].numel, layout, sixteen, grads=True, state=True, params_itemsize=2)
    assert placed.params == {streamed[0].key} and not placed.grads
    with pytest.raises(ConfigError, match="offload.host_memory_budget='lots' is not a size"):
        strategy(tmp_path, "lots")


@pytest.mark.parametrize("budget", ["210KB", "10MB"])
def test_state_in_host_memory_trains_as_plain_lightning(tmp_path: Path, budget: str) -> None:
    reference = make_module("adamw")
    fit(reference, precision="32-true", gradient_clip_val=0.5)
    trainer = fit(make_module("adamw"), strategy(tmp_path, budget), precision="32-true", gradient_clip_val=0.5)
    engine = trainer.strategy.engine
    streamed = [sg.key for sg in engine.layout.subgroups if not engine.layout.blocks[sg.block].resident]
    assert engine.placement.params == set(streamed) and engine.placement.state  # the parameters first
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5
    read = engine.counters.total(link="host", kind="master", direction="read")
    everything = len(engine.layout.subgroups) == len(engine.placement.state)
    assert (read == 0) == everything  # what is in RAM crosses no storage link
    assert engine.counters.total(link="host", kind="param") == 0
    assert (engine.counters.total(link="host", kind="grad") == 0) == engine.placement.grads


def test_state_and_gradients_in_ram_are_updated_where_they_are_stored(tmp_path: Path) -> None:
    """In RAM there is nothing to stream: the step updates the stored tensors in place and the gradients accumulate
    where they are stored, so neither takes a pooled buffer (a copy in and out on the cores the compute needs)."""
    taken: list[int] = []
    counting = [False]

    class CountPools(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            engine = trainer.strategy.engine  # type: ignore[attr-defined]
            for pool in (engine.updater.pool, engine.updater.state_pool, engine.grads.pool):
                take = pool.acquire
                pool.acquire = lambda n, take=take: (taken.append(n) if counting[0] else None) or take(n)
            counting[0] = True

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            counting[0] = False  # the weights' handback after fit reads the masters through the pool, as it must

    trainer = fit(make_module("adamw"), strategy(tmp_path, "10MB"), max_steps=3, callbacks=[CountPools()])
    engine = trainer.strategy.engine
    assert engine.placement.grads and len(engine.placement.state) == len(engine.layout.subgroups)
    assert engine.step_count == 3 and taken == []


def train(root: Path, steps: int, budget: str, resume: Path | None = None) -> dict[str, torch.Tensor]:
    s = strategy(root / "state", budget)
    trainer = pl.Trainer(strategy=s, accelerator="cpu", devices=1, max_steps=steps, precision="32-true",
                         logger=False, callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2,
                                                                  save_top_k=-1)],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(make_module(), token_loader(samples=16), ckpt_path=resume)
    state: dict[str, Any] = s.consolidated_state_dict()
    s.close()
    return state


def test_a_checkpoint_of_state_in_ram_resumes_exactly_under_any_budget(tmp_path: Path) -> None:
    expected = train(tmp_path / "straight", 6, "0")
    train(tmp_path / "split", 4, "210KB")
    resume = latest_checkpoint(tmp_path / "split" / "ckpts")
    assert resume is not None
    for budget in ("210KB", "0", "10MB"):
        got = train(tmp_path / f"resumed-{budget}", 6, budget, resume=resume)
        assert all(torch.equal(got[k], expected[k]) for k in expected), budget


def test_auto_takes_half_the_available_memory_less_the_engines_own_shared_by_the_ranks_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 64 * 2**20)
    trainer = fit(make_module(), strategy(tmp_path, "auto"), max_steps=1)
    engine = trainer.strategy.engine
    reserved = sizing.reserved_bytes(engine.parts, engine.device)
    assert reserved >= engine.host_memory_bytes > 0
    assert engine.ranks_per_host == 1 and engine.placement.budget == 32 * 2**20 - reserved
    # as for a second process on this host (trainer.devices=2)
    assert sizing.place_in_host_memory(engine.parts, "auto", 2, engine.device, True, True, False,
                                             True).budget == 16 * 2**20 - reserved  # fmt: skip


def test_the_default_budget_places_nothing_where_the_engine_needs_half_the_memory_for_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tight host (a small cgroup) keeps the default run all on storage rather than crowd out its own pools."""
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 2**20)
    s = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads"},
                              update={"host_adam": "torch"})  # fmt: skip
    assert s.offload.host_memory_budget == "auto"
    engine = fit(make_module(), s, max_steps=1).strategy.engine
    assert engine.placement.budget == 0 and not engine.placement.grads and not engine.placement.state
    assert engine.counters.total(link="host", kind="master", direction="read") > 0


def test_a_checkpoint_sized_before_the_first_step_counts_the_masters_in_ram(tmp_path: Path) -> None:
    """Before the first step the state in RAM is masters only (the moments appear with the step)."""
    sizes: list[int] = []

    class Size(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            sizes.append(engine_nbytes(trainer.strategy.engine))  # type: ignore[attr-defined]

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trainer.strategy.engine.wait_step()  # type: ignore[attr-defined]  # the last step may run behind
            sizes.append(engine_nbytes(trainer.strategy.engine))  # type: ignore[attr-defined]

    trainer = fit(make_module(), strategy(tmp_path, "10MB"), max_steps=1, callbacks=[Size()])
    engine = trainer.strategy.engine
    assert len(engine.placement.state) == len(engine.layout.subgroups)  # everything in RAM
    assert sizes[1] == 3 * sizes[0] > 0  # master, then master and both moments
