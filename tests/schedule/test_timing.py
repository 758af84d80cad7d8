"""The one time model: ``schedule=auto`` and ``smartinf-plan`` plan and predict with it, and agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import fit, token_loader

from lightning_smartinf.bench.model import Hardware, machine_of, predict, workload_of
from lightning_smartinf.cli.bench import recipe_model
from lightning_smartinf.cli.plan import auto_plan, job_of
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.models.gpt import GPTConfig, GPTModule
from lightning_smartinf.schedule.timing import Machine, Workload
from lightning_smartinf.schedule.timing import predict as predict_time

SEQ, BATCH, ACCUMULATE = 32, 2, 2


def test_smartinf_plan_and_schedule_auto_give_the_same_plan_for_the_same_workload_and_machine(tmp_path: Path) -> None:
    """The default recipe on storage (budget 0, gradients in RAM as smartinf-plan's (c) settings put them), two
    batches accumulated per step: the engine's plan, the plan smartinf-plan makes from the engine's own workload and
    machine, and the bytes smartinf-plan counts from the recipe's shapes."""
    model = {**recipe_model("gpt_tiny", SEQ), "block_size": SEQ}
    offload = {"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads", "host_memory_budget": "0",
               "grads": "cpu"}  # fmt: skip
    strategy = SmartInfinityStrategy(offload=offload, update={"host_adam": "torch"}, schedule={"kind": "auto"})
    fields = {k: model[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")}
    trainer = fit(GPTModule(GPTConfig(**fields)), strategy, max_steps=1, loader=token_loader(seq_len=SEQ,
                  batch_size=BATCH), accumulate_grad_batches=ACCUMULATE, precision="bf16-mixed")  # fmt: skip
    engine_plan = trainer.strategy.plan
    assert engine_plan is not None and engine_plan.workload is not None and engine_plan.machine is not None

    cli_plan = auto_plan(engine_plan.workload, engine_plan.machine, ACCUMULATE)
    assert cli_plan.describe() == engine_plan.describe()
    assert cli_plan.predicted_s == engine_plan.predicted_s and cli_plan.breakdown == engine_plan.breakdown

    # smartinf-plan's own count of the recipe's bytes (system (c)) is the engine's, to the engine's padding of each
    # block to a whole number of 2048-element runs (core.ELEMENT_ALIGN)
    job = job_of(model, SEQ, BATCH, ACCUMULATE)
    counted, engine = workload_of("c", job), engine_plan.workload
    for name in ("params", "step_read_bytes", "step_write_bytes", "tokens_per_batch"):
        assert getattr(counted, name) == getattr(engine, name), name
    assert counted.streamed_param_bytes == pytest.approx(engine.streamed_param_bytes, rel=0.005)


def test_the_row_smartinf_plan_prints_for_c_is_what_schedule_auto_predicts() -> None:
    hw = Hardware(tflops=50.0, ssd_read=3.0, ssd_write=2.0, host_update=1.0)
    job = job_of(recipe_model("gpt_1_3b", 1024), 1024, 1, 8)
    row = predict("c", job, hw)
    chosen = auto_plan(workload_of("c", job), machine_of(hw), 8)
    assert chosen.micro_batches == 8 and chosen.predicted_s == pytest.approx(row.seconds, rel=1e-12)


def test_the_overlap_hides_at_most_the_next_forward_and_nothing_where_compute_shares_the_cores() -> None:
    work = Workload(100_000_000, 200_000_000, 1_200_000_000, 1_400_000_000, 4096, 4, 0)
    machine = Machine(1e12, 1e9, 1e9, 1e9, 0, 0)
    parts = predict_time(work, machine, True, 1, 1.0)
    forward = 2 * work.params * work.tokens_per_batch / machine.flops
    assert parts["step_hidden"] == pytest.approx(min(parts["step"], forward))
    machine.compute_io_overlap = False
    shared = predict_time(work, machine, True, 1, 1.0)
    assert shared["step_hidden"] == 0.0
    assert shared["total"] == pytest.approx(shared["compute"] + shared["params_io"] + shared["step"])


def test_a_frozen_base_counts_in_the_compute_but_not_in_the_step() -> None:
    adapters = Workload(1_000_000, 2_000_000_000, 12_000_000, 14_000_000, 4096, 4, 0)
    with_base = Workload(1_000_000, 2_000_000_000, 12_000_000, 14_000_000, 4096, 4, 0, frozen_params=999_000_000)
    machine = Machine(1e12, 1e9, 1e9, 1e9, 0, 0)
    alone, based = predict_time(adapters, machine, True, 1, 1.0), predict_time(with_base, machine, True, 1, 1.0)
    assert based["compute"] == pytest.approx(1000 * alone["compute"]) and based["step"] == alone["step"]


def test_schedule_auto_with_smart_update_plans_the_devices_step(tmp_path: Path) -> None:
    """SmartUpdate's step in the model: gradients out and fp32 parameters back over the link, gradient and state
    read and state written by the devices, whose directories (PoCL's, here) share the host's disk."""
    offload = {"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads", "grads": "cpu"}
    strategy = SmartInfinityStrategy(offload=offload, update={"backend": "smart", "devices": 2},
                                     schedule={"kind": "auto"})  # fmt: skip
    trainer = fit(GPTModule(GPTConfig(n_layer=2, block_size=SEQ)), strategy, max_steps=1,
                  loader=token_loader(seq_len=SEQ, batch_size=BATCH))  # fmt: skip
    chosen = trainer.strategy.plan
    assert chosen is not None and chosen.workload is not None and chosen.machine is not None
    local = trainer.strategy.engine.layout.local_numel
    work, machine = chosen.workload, chosen.machine
    assert work.near_storage and work.link_bytes == 8 * local and work.step_read_bytes == 0
    assert work.device_read_bytes == 16 * local and work.device_write_bytes == 12 * local
    assert machine.devices == 2 and machine.shared_disk
    assert {"host_link", "device_internal", "device_update", "params_write"} <= set(chosen.breakdown)
