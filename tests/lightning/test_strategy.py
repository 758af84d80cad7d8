"""smart_infinity against plain Lightning training: equality in fp32, tracking in mixed precision."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, make_module, relative_error, token_loader
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_smartinf
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy


def test_registered_by_name_and_import_is_idempotent() -> None:
    import importlib

    importlib.reload(lightning_smartinf)
    from lightning.pytorch.strategies import StrategyRegistry

    assert "smart_infinity" in StrategyRegistry
    trainer = pl.Trainer(strategy="smart_infinity", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, SmartInfinityStrategy)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd", "adagrad"])
def test_fp32_equals_plain_training(smart, optimizer: str) -> None:
    reference = make_module(optimizer)
    fit(reference, precision="32-true")
    module = make_module(optimizer)
    trainer = fit(module, smart(), precision="32-true")
    assert trainer.strategy.engine.step_count == 10
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5


@pytest.mark.parametrize("placement", [{"params": "nvme", "grads": "nvme"}, {"params": "cpu", "grads": "cpu"}])
def test_fp32_equal_with_clipping_and_accumulation(smart, placement: dict[str, str]) -> None:
    kwargs = {"precision": "32-true", "gradient_clip_val": 0.05, "accumulate_grad_batches": 4}
    reference = make_module("adamw")
    fit(reference, **kwargs)
    module = make_module("adamw")
    trainer = fit(module, smart(**placement), **kwargs)
    assert trainer.strategy.engine.step_count == 10
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5


def test_lr_scheduler_is_followed(smart) -> None:
    reference = make_module("adamw", warmup_steps=5)
    fit(reference, precision="32-true")
    module = make_module("adamw", warmup_steps=5)
    trainer = fit(module, smart(), precision="32-true")
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5


def test_deepspeed_ops_path_equals_plain_training(smart) -> None:
    """DeepSpeed's aio op for storage and its CPU Adam op for the update.

    DeepSpeed's vectorised Adam rounds differently from torch's (about an ulp per step), which a large learning
    rate amplifies through elements whose gradient is pure noise (attention key biases); at lr=1e-3 the result
    is within 1e-5 of torch. ``update.host_adam=torch`` is torch's arithmetic exactly.
    """
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true", gradient_clip_val=0.5)
    module = make_module("adamw", lr=1e-3)
    trainer = fit(module, smart(io_backend="aio", update={"host_adam": "deepspeed"}), precision="32-true",
                  gradient_clip_val=0.5)  # fmt: skip
    assert "deepspeed-aio" in trainer.strategy.engine.backend.name
    assert "deepspeed cpu_adam" in trainer.strategy.engine.updater.name
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-5


class LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def precision_args(precision: str) -> dict[str, object]:
    """Lightning turns precision='16-mixed' into bf16 on CPU; an explicit plugin keeps fp16 with GradScaler."""
    if precision == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    return {"precision": precision}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_tracks_plain_training(smart, precision: str) -> None:
    plain, ours = LossLog(), LossLog()
    fit(make_module("adamw", lr=3e-3), max_steps=20, callbacks=[plain], **precision_args(precision))
    fit(make_module("adamw", lr=3e-3), smart(), max_steps=20, callbacks=[ours], **precision_args(precision))
    assert len(ours.losses) == len(plain.losses) == 20
    for a, b in zip(ours.losses, plain.losses, strict=True):
        assert abs(a - b) / abs(b) < 1e-2


class OverflowAt(make_module("adamw").__class__):  # type: ignore[misc]
    """Multiplies the loss of one batch by inf, as a genuine fp16 overflow would poison the gradients."""

    overflow_batch = 2

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == self.overflow_batch else loss


def test_fp16_overflow_skips_the_step_like_grad_scaler(smart) -> None:
    torch.manual_seed(0)
    plain_module = OverflowAt(make_module().cfg)
    plain = fit(plain_module, max_steps=4, **precision_args("16-mixed"))
    torch.manual_seed(0)
    module = OverflowAt(make_module().cfg)
    trainer = fit(module, smart(), max_steps=4, **precision_args("16-mixed"))
    engine = trainer.strategy.engine
    scaler = plain.precision_plugin.scaler
    assert engine.scaler.scale == float(scaler.get_scale()) == 2.0**15
    assert engine.step_count == 3  # 4 batches, one skipped
    assert trainer.global_step == plain.global_step


def test_unsupported_optimizer_is_a_clear_error(smart) -> None:
    class RMSModule(make_module().__class__):  # type: ignore[misc]
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.RMSprop(self.parameters())

    torch.manual_seed(0)
    with pytest.raises(TypeError, match="supports torch.optim.Adam, AdamW, SGD"):
        fit(RMSModule(make_module().cfg), smart(), max_steps=1)


def test_validate_test_predict_after_fit(smart) -> None:
    module = make_module()
    trainer = fit(module, smart(), max_steps=3, limit_val_batches=2)
    assert trainer.validate(module, token_loader(16), verbose=False)[0]["val_loss"] > 0
    assert trainer.test(module, token_loader(16), verbose=False)[0]["test_loss"] > 0
    predictions = trainer.predict(module, token_loader(8))
    assert predictions[0].shape == (4, 16)


def test_checkpoint_resume_continues_exactly(smart, tmp_path) -> None:
    """Save after 3 steps, resume from a differently initialised module, match 6 uninterrupted steps bit for bit.

    Every batch is the same 4 sequences: Lightning replays a plain DataLoader from its first batch on resume, and
    this test is about the offloaded state (masters, Adam moments, step count), not the data order.
    """
    batch = next(iter(token_loader()))
    loader = torch.utils.data.DataLoader(batch.repeat(3, 1), batch_size=4)
    straight = make_module()
    fit(straight, smart(nvme_path=str(tmp_path / "a")), max_steps=6, precision="32-true", loader=loader)
    expected = straight.trainer.strategy.consolidated_state_dict()

    first = make_module()
    trainer = fit(first, smart(nvme_path=str(tmp_path / "b")), max_steps=3, precision="32-true", loader=loader)
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = make_module(seed=1)  # different init: everything must come from the checkpoint
    trainer = pl.Trainer(strategy=smart(nvme_path=str(tmp_path / "c")), accelerator="cpu", max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         precision="32-true")  # fmt: skip
    trainer.fit(resumed, loader, ckpt_path=tmp_path / "ckpt")
    got = trainer.strategy.consolidated_state_dict()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_monitor_logs_throughput_and_traffic(smart) -> None:
    module = make_module()
    trainer = fit(module, smart(), max_steps=3)
    metrics = trainer.logged_metrics
    assert metrics["tok_s"] > 0 and metrics["host_GB"] > 0
    assert set(trainer.strategy.traffic()) == {"host/read", "host/write"}
