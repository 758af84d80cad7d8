"""``accumulate_grad_batches`` under the default schedule: each window of batches runs as one vertical pass, equal
to plain Lightning's accumulation (fp32), with every block read once per window."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fit, make_module, token_loader

from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.schedule.vertical import VerticalSchedule
from lightning_smartinf.schedule.window import concat_batches, tokens_of


def strategy(path: Path, schedule: dict[str, Any] | None = None) -> SmartInfinityStrategy:
    offload = {"nvme_path": str(path), "subgroup_size": 4096, "io_backend": "threads"}
    return SmartInfinityStrategy(offload=offload, update={"host_adam": "torch"}, schedule=schedule)


def max_difference(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    return max(float((ours[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())


def param_reads(trainer: Any) -> int:
    return int(trainer.strategy.engine.counters.total(link="host", kind="param", direction="read"))


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulated_batches_run_as_one_vertical_pass(tmp_path: Path, accumulate: int) -> None:
    """The default schedule, batches of 2 accumulated the Lightning way, clipping on: the weights equal plain
    Lightning's, and the parameters are read as often per step as without accumulation."""
    kwargs: dict[str, Any] = {"max_steps": 4, "gradient_clip_val": 0.5, "accumulate_grad_batches": accumulate}
    reference = make_module("adamw", lr=1e-3)
    fit(reference, "auto", loader=token_loader(samples=64, batch_size=2), **kwargs)
    ours = fit(make_module("adamw", lr=1e-3), strategy(tmp_path / "a"), loader=token_loader(samples=64, batch_size=2),
               **kwargs)  # fmt: skip
    assert isinstance(ours.strategy.vertical, VerticalSchedule) and ours.strategy.engine.step_count == 4
    assert max_difference(ours.strategy.consolidated_state_dict(), reference) < 1e-5
    single = fit(make_module("adamw", lr=1e-3), strategy(tmp_path / "b"), max_steps=4,
                 loader=token_loader(samples=64, batch_size=2 * accumulate))  # fmt: skip
    assert param_reads(ours) == param_reads(single)


def test_a_short_last_window_is_divided_as_lightning_divides_it(tmp_path: Path) -> None:
    """5 batches an epoch in windows of 2: the epoch's last step accumulates one batch, its loss still divided by 2."""
    kwargs: dict[str, Any] = {"max_epochs": 2, "max_steps": -1, "accumulate_grad_batches": 2}
    reference = make_module("adamw", lr=1e-3)
    fit(reference, "auto", loader=token_loader(samples=10, batch_size=2), **kwargs)
    ours = fit(make_module("adamw", lr=1e-3), strategy(tmp_path), loader=token_loader(samples=10, batch_size=2),
               **kwargs)  # fmt: skip
    assert ours.strategy.engine.step_count == 6
    assert max_difference(ours.strategy.consolidated_state_dict(), reference) < 1e-5


def test_micro_batches_and_accumulation_combine(tmp_path: Path) -> None:
    """schedule=vertical with micro_batches=2 over batches of 4, accumulated over 2: one pass of 4 micro-batches."""
    kwargs: dict[str, Any] = {"max_steps": 3, "accumulate_grad_batches": 2}
    reference = make_module("adamw", lr=1e-3)
    fit(reference, "auto", loader=token_loader(samples=48, batch_size=4), **kwargs)
    schedule = {"kind": "vertical", "micro_batches": 2, "overlap": 0.5}
    ours = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, schedule),
               loader=token_loader(samples=48, batch_size=4), **kwargs)  # fmt: skip
    assert max_difference(ours.strategy.consolidated_state_dict(), reference) < 1e-5


def test_the_default_plan_is_logged_with_its_reasons(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_smartinf.lightning.strategy"):
        fit(make_module(), strategy(tmp_path), max_steps=1, accumulate_grad_batches=2)
    text = caplog.text
    assert "schedule=auto: micro_batches=2" in text and "overlap=1.00" in text and "kept graphs" in text


def test_windows_join_batches_of_the_same_structure() -> None:
    a = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "mask": torch.ones(2, 5)}
    joined = concat_batches([a, a, a])
    assert joined["input_ids"].shape == (6, 5) and tokens_of(joined) == (6, 30)
    with pytest.raises(TypeError, match="same structure"):
        concat_batches([a, {"input_ids": a["input_ids"]}])
