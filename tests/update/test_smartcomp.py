"""SmartComp end to end: compressed gradients through SmartUpdate, host-link bytes, and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import fit, make_module, relative_error, token_loader

from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

SMART = {"backend": "smart", "devices": 2}


def strategy(path: Path, compression: dict[str, object], **offload: object) -> SmartInfinityStrategy:
    settings = {"nvme_path": str(path), "subgroup_size": 4096, "io_backend": "threads", "grads": "cpu", **offload}
    return SmartInfinityStrategy(offload=settings, update=SMART, compression=compression)


def test_keep_everything_is_dense_training_up_to_16bit_values(tmp_path: Path) -> None:
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true")
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "keep": 1.0}),
                  precision="32-true")  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-4  # bf16 rounding of values


def test_warmup_steps_are_dense_and_exact(tmp_path: Path) -> None:
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true")
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "warmup_steps": 10}),
                  precision="32-true")  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-6


CATCH_UP = {"kind": "topk", "error_feedback": True, "catch_up": True}


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_catch_up_keeping_everything_is_dense_training(tmp_path: Path, optimizer: str) -> None:
    """Every element sent every step waits one step: the catch-up update is Adam's own, up to the 16-bit sums."""
    reference = make_module(optimizer, lr=1e-3, weight_decay=0.1)
    fit(reference, precision="32-true", gradient_clip_val=0.5)
    trainer = fit(make_module(optimizer, lr=1e-3, weight_decay=0.1), strategy(tmp_path, {**CATCH_UP, "keep": 1.0}),
                  precision="32-true", gradient_clip_val=0.5)  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-4


def test_catch_up_with_fp16_loss_scaling(tmp_path: Path) -> None:
    """fp16-mixed: gradients are unscaled before they join the sums, and overflowing steps never reach them; with
    keep=1 training follows uncompressed SmartUpdate under the same loss scaler."""
    from lightning.pytorch.plugins import MixedPrecision

    def run(path: Path, compression: dict[str, object]) -> dict[str, torch.Tensor]:
        trainer = fit(make_module(lr=1e-3), strategy(path, compression), plugins=[MixedPrecision("16-mixed", "cpu")],
                      gradient_clip_val=0.5)  # fmt: skip
        assert trainer.strategy.engine.scaler is not None
        return trainer.strategy.consolidated_state_dict()

    dense, caught_up = run(tmp_path / "dense", {"kind": "none"}), run(tmp_path / "topk", {**CATCH_UP, "keep": 1.0})
    diff = torch.cat([(caught_up[k] - dense[k]).reshape(-1) for k in dense])
    assert float(diff.norm() / torch.cat([v.reshape(-1) for v in dense.values()]).norm()) < 1e-3


def test_catch_up_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The residuals, the sums of squares and each element's last step survive a checkpoint: a resumed run ends
    with the same parameters as one that never stopped."""
    import lightning.pytorch as pl

    compression = {**CATCH_UP, "keep": 0.05, "block": 256}
    batch = next(iter(token_loader()))
    loader = torch.utils.data.DataLoader(batch.repeat(3, 1), batch_size=4)  # every batch alike: order is moot
    straight = fit(make_module(lr=1e-3), strategy(tmp_path / "a", compression), precision="32-true", max_steps=6,
                   loader=loader)  # fmt: skip
    expected = straight.strategy.consolidated_state_dict()
    first = fit(make_module(lr=1e-3), strategy(tmp_path / "b", compression), precision="32-true", max_steps=3,
                loader=loader)  # fmt: skip
    first.save_checkpoint(tmp_path / "ckpt")
    trainer = pl.Trainer(strategy=strategy(tmp_path / "c", compression), accelerator="cpu", max_steps=6,
                         precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         limit_val_batches=0)  # fmt: skip
    trainer.fit(make_module(seed=1, lr=1e-3), loader, ckpt_path=tmp_path / "ckpt")
    got = trainer.strategy.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_error_feedback_without_catch_up_under_adam_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fit(make_module(lr=1e-3), strategy(tmp_path, {"kind": "topk", "error_feedback": True}), precision="32-true",
        max_steps=1)  # fmt: skip
    assert "add compression.catch_up=true" in caplog.text


def test_catch_up_needs_adam(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression.catch_up=true runs Adam's update.*the optimizer is sgd"):
        fit(make_module("sgd", lr=1e-3), strategy(tmp_path, CATCH_UP), precision="32-true", max_steps=1)


def test_host_link_bytes_with_keep_one_percent(tmp_path: Path) -> None:
    """4 B/param of updated fp32 params back, plus keep x (4 B index + 2 B value) out: 4.06 B at keep=0.01."""
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "keep": 0.01,
                  "block": 4096, "error_feedback": True}), precision="32-true", max_steps=5)  # fmt: skip
    engine = trainer.strategy.engine
    host = engine.counters
    steps, params = engine.step_count, engine.layout.num_params
    update_bytes = sum(host.total(link="host", kind=k) for k in ("grad_index", "grad_value", "updated_param"))
    per_param = update_bytes / params / steps
    assert per_param <= 4.1
    assert host.total(link="host", kind="grad") == 0  # no dense gradient crossed the host link
    assert per_param == pytest.approx(4 + 6 * sum(_nnz(engine, sg.numel) for sg in engine.layout.subgroups) / params)


def test_catch_up_host_link_bytes(tmp_path: Path) -> None:
    """Catch-up adds a 16-bit sum of squares per kept element: 4 + keep x 8 B = 4.08 B/param at keep=0.01."""
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {**CATCH_UP, "keep": 0.01}),
                  precision="32-true", max_steps=5)  # fmt: skip
    engine = trainer.strategy.engine
    host, steps, params = engine.counters, engine.step_count, engine.layout.num_params
    kinds = ("grad_index", "grad_value", "grad_square", "updated_param")
    per_param = sum(host.total(link="host", kind=k) for k in kinds) / params / steps
    assert per_param <= 4.1
    assert per_param == pytest.approx(4 + 8 * sum(_nnz(engine, sg.numel) for sg in engine.layout.subgroups) / params)
    assert host.total(link="host", kind="last_step") == 0  # the catch-up state stays on the devices
    assert host.total(link="device0", kind="last_step") > 0


def _nnz(engine: object, numel: int) -> int:
    from lightning_smartinf.compress.topk import max_nnz

    return max_nnz(numel, engine.compression)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("update", "offload", "message"), [
    ({"backend": "host"}, {"grads": "cpu"}, "needs update.backend=smart"),
    (SMART, {"grads": "nvme"}, "set offload.grads=cpu"),
    ({**SMART, "wire": "16bit"}, {"grads": "cpu"}, "use update.wire=fp32"),
])  # fmt: skip
def test_unsupported_combinations_name_the_keys(update: dict, offload: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SmartInfinityStrategy(offload=offload, update=update, compression={"kind": "topk"})
