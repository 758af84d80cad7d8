"""The roofline planner: its model's shape, its choices, and schedule=auto end to end."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import fit, make_module, token_loader

from lightning_smartinf.engine.planning import workload_of
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.schedule.kept import activation_bytes
from lightning_smartinf.schedule.planner import kept_share, plan
from lightning_smartinf.schedule.timing import Machine, Workload, predict

GB = 1e9


def workload(params: float = 350e6, batch: int = 8) -> Workload:
    p = int(params)
    return Workload(p, 2 * p, 12 * p, 14 * p, batch * 128, batch, checkpoint_bytes_per_sample=25 * 128 * 1024 * 2)


def machine(flops: float = 1e12, disk: float = 1.5 * GB, memory: int = 8 * 2**30) -> Machine:
    return Machine(flops, disk, disk, 1e9, memory, memory)


def test_parameter_streaming_grows_with_micro_batches_only_horizontally() -> None:
    w, m = workload(), machine()
    vertical = [predict(w, m, True, k, 0.0)["params_io"] for k in (1, 2, 4, 8)]
    horizontal = [predict(w, m, False, k, 0.0)["params_io"] for k in (1, 2, 4, 8)]
    assert len(set(vertical)) == 1
    assert horizontal == [vertical[0] * k for k in (1, 2, 4, 8)]


def test_overlap_hides_at_most_one_forward() -> None:
    w, m = workload(), machine()
    parts = predict(w, m, True, 4, 1.0)
    assert parts["step_hidden"] == min(parts["step"], parts["compute"] / 4)


def test_plan_splits_the_batch_and_spills_checkpoints_when_memory_is_short() -> None:
    w = workload()
    roomy = plan(w, machine())
    assert w.batch_size % roomy.micro_batches == 0 and roomy.checkpoint_host == roomy.checkpoint_nvme == 0.0
    tight = machine(memory=w.checkpoint_bytes_per_sample * 2)  # two samples' checkpoints per tier
    tight.graph_storage = w.checkpoint_bytes_per_sample * 4
    chosen = plan(w, tight)
    assert chosen.checkpoint_host + chosen.checkpoint_nvme > 0.0


def test_a_plan_whose_checkpoints_fit_nowhere_is_an_error_naming_the_numbers() -> None:
    w, full = workload(), machine(memory=workload().checkpoint_bytes_per_sample)  # one sample per tier, no disk
    with pytest.raises(ConfigError, match=r"6,553,600 B per sample x 8 samples = 52,428,800 B per batch, against a "
                       r"device budget of 6,553,600 B, host memory of 6,553,600 B and 0 B of disk room"):  # fmt: skip
        plan(w, full)


def test_kept_graphs_fill_the_activation_memory_and_shrink_the_compute() -> None:
    w = workload()
    w.blocks, w.kept_block_bytes = 24, 100 * 2**20
    assert kept_share(w, machine()) == 0.0  # no activation memory: recompute every block, as before
    roomy, half = machine(), machine()
    roomy.activation_memory, half.activation_memory = 24 * w.kept_block_bytes, 12 * w.kept_block_bytes + 1
    assert kept_share(w, roomy) == 1.0 and kept_share(w, half) == 0.5
    assert plan(w, half).keep_activations == 0.5
    recompute, kept = predict(w, roomy, True, 1, 0.0), predict(w, roomy, True, 1, 0.0, keep=1.0)
    assert kept["compute"] == recompute["compute"] * 6 / 8


def test_resident_layers_count_at_their_measured_time_not_the_block_rate() -> None:
    """A vocabulary-wide head runs at its own rate: its forward is timed, and counted three times (forward and a
    backward of twice its cost, never recomputed), in place of its parameters at the block rate."""
    w, m = workload(), machine()
    everything = predict(w, m, True, 1, 0.0)["compute"]
    w.resident_params, w.resident_forward_s = 50_000_000, 0.25
    split = predict(w, m, True, 1, 0.0)["compute"]
    assert split == pytest.approx(everything * (350 - 50) / 350 + 0.75)


def test_activation_bytes_counts_what_the_graph_saves_but_not_the_parameters() -> None:
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    # the input (saved by the first Linear), the GELU's input and its output (saved by the second Linear), fp32
    assert activation_bytes(block, x, list(block.parameters())) == 4 * (4 * 8 + 4 * 16 + 4 * 16)


@pytest.mark.parametrize("budget", ["0", "1GB"])
def test_schedule_auto_keeps_graphs_within_the_host_memory_budget(budget: str, tmp_path: Path) -> None:
    offload = {"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads",
               "host_memory_budget": budget}  # fmt: skip
    strategy = SmartInfinityStrategy(offload=offload, update={"host_adam": "torch"}, schedule={"kind": "auto"})
    trainer = fit(make_module(), strategy, max_steps=2, loader=token_loader(batch_size=4))
    chosen = trainer.strategy.plan
    assert chosen is not None and chosen.keep_activations == (0.0 if budget == "0" else 1.0)
    assert trainer.strategy.vertical.keep == (set() if budget == "0" else {0, 1})
    # the step's disk bytes leave out the gradients and state the budget put in RAM (here: all of them)
    engine = trainer.strategy.engine
    work = workload_of(engine, torch.zeros(4, 17, dtype=torch.long), 0)
    local = engine.layout.local_numel
    assert work.step_read_bytes == (4 * 4 * local if budget == "0" else 0)  # gradient, master, exp_avg, exp_avg_sq


def test_schedule_auto_trains_and_logs_its_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lightning_smartinf")
    offload = {"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads"}
    strategy = SmartInfinityStrategy(offload=offload, update={"host_adam": "torch"}, schedule={"kind": "auto"})
    trainer = fit(make_module(), strategy, max_steps=2, loader=token_loader(batch_size=4))
    assert trainer.strategy.plan is not None and trainer.strategy.engine.step_count == 2
    assert 4 % trainer.strategy.plan.micro_batches == 0
    # compute is planned at the rate the model's own block reached, which the log states next to the matmul probe's
    number = r"([0-9.]+(?:e[-+][0-9]+)?)"  # three significant figures: a tiny test block can run at 0.00412
    rates = re.search(rf"blocks run at {number} TFLOP/s here \(a 2048\^3 matmul: {number}\)", caplog.text)
    assert rates is not None and float(rates.group(1)) > 0
    resident = re.search(rf"resident layers and loss takes {number} s per batch", caplog.text)
    assert resident is not None and float(resident.group(1)) > 0
    assert trainer.strategy.plan.breakdown["compute"] > 0
