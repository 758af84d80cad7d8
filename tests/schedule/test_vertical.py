"""The vertical schedule against the horizontal one: equal parameters, constant parameter traffic, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fit, make_module, token_loader
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

MICRO_BATCH = 2


def strategy(path: Path, schedule: dict[str, Any], **update: Any) -> SmartInfinityStrategy:
    offload = {"nvme_path": str(path), "subgroup_size": 4096, "io_backend": "threads"}
    if update.get("backend") == "smart":
        offload["grads"] = "cpu"
    return SmartInfinityStrategy(offload=offload, update={"host_adam": "torch", **update}, schedule=schedule)


def run(path: Path, micro_batches: int, schedule: dict[str, Any], clip: float | None, precision: Any = "32-true",
        **update: Any) -> Any:  # fmt: skip
    """5 steps with a global batch of micro_batches x 2 sequences, vertical or horizontal (accumulating)."""
    schedule = schedule or {"kind": "horizontal"}
    vertical = schedule.get("kind") == "vertical"
    how = {"plugins": [precision]} if isinstance(precision, MixedPrecision) else {"precision": precision}
    trainer = fit(
        make_module("adamw", lr=1e-3), strategy(path, schedule, **update), max_steps=5, **how,
        gradient_clip_val=clip, accumulate_grad_batches=1 if vertical else micro_batches,
        loader=token_loader(samples=64, batch_size=MICRO_BATCH * micro_batches if vertical else MICRO_BATCH),
    )  # fmt: skip
    return trainer


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(a[k] - b[k]).reshape(-1) for k in b]).norm()
    return float(diff / torch.cat([b[k].reshape(-1) for k in b]).norm())


def param_reads(trainer: Any) -> int:
    return trainer.strategy.engine.counters.total(link="host", kind="param", direction="read")


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
@pytest.mark.parametrize("overlap", [0.0, 0.5])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_vertical_equals_horizontal(tmp_path: Path, micro_batches: int, overlap: float, clip: float | None) -> None:
    horizontal = run(tmp_path / "h", micro_batches, {}, clip)
    vertical = run(tmp_path / "v", micro_batches, {"kind": "vertical", "micro_batches": micro_batches,
                                                   "overlap": overlap}, clip)  # fmt: skip
    assert rel(vertical.strategy.consolidated_state_dict(), horizontal.strategy.consolidated_state_dict()) < 1e-5


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_vertical_tracks_horizontal_in_mixed_precision(tmp_path: Path, precision: str) -> None:
    """16-bit parameters and activations, fp32 masters; fp16 with the engine's loss scaling (clipping on too)."""
    plugin = MixedPrecision("16-mixed", "cpu") if precision == "16-mixed" else precision  # CPU would turn it to bf16
    horizontal = run(tmp_path / "h", 2, {}, 0.5, plugin)
    vertical = run(tmp_path / "v", 2, {"kind": "vertical", "micro_batches": 2, "overlap": 0.5}, 0.5, plugin)
    if precision == "16-mixed":
        assert vertical.strategy.engine.scaler is not None
    assert vertical.strategy.engine.step_count == horizontal.strategy.engine.step_count == 5
    start = {k: v.float() for k, v in make_module("adamw", lr=1e-3).state_dict().items()}
    ours, reference = vertical.strategy.consolidated_state_dict(), horizontal.strategy.consolidated_state_dict()
    moved = rel(reference, start)
    # 16-bit gradients summed in another order differ in their last bits: far below what the 5 steps moved
    assert rel(ours, reference) < 0.05 * moved


def test_vertical_with_smart_update(tmp_path: Path) -> None:
    horizontal = run(tmp_path / "h", 2, {}, 0.5, backend="smart", devices=2)
    vertical = run(tmp_path / "v", 2, {"kind": "vertical", "micro_batches": 2, "overlap": 1.0}, 0.5,
                   backend="smart", devices=2)  # fmt: skip
    assert rel(vertical.strategy.consolidated_state_dict(), horizontal.strategy.consolidated_state_dict()) < 1e-5


def test_parameter_reads_do_not_grow_with_micro_batches(tmp_path: Path) -> None:
    vertical = {m: param_reads(run(tmp_path / f"v{m}", m, {"kind": "vertical", "micro_batches": m}, None))
                for m in (1, 2, 4)}  # fmt: skip
    horizontal = {m: param_reads(run(tmp_path / f"h{m}", m, {}, None)) for m in (1, 2, 4)}
    assert vertical[1] == vertical[2] == vertical[4] == horizontal[1]
    assert horizontal[2] == 2 * horizontal[1] and horizontal[4] == 4 * horizontal[1]


def test_checkpoint_tiers_are_counted(tmp_path: Path) -> None:
    schedule = {"kind": "vertical", "micro_batches": 4, "checkpoint_host": 0.25, "checkpoint_nvme": 0.25}
    trainer = run(tmp_path, 4, schedule, None)
    counters = trainer.strategy.engine.counters
    layers, hidden = 2, 2 * 16 * 32 * 4  # micro-batch of 2 x 16 tokens x width 32, fp32
    # one micro-batch per tier, at every boundary (embedding output and after each block but the last): 5 steps
    per_tier = 5 * layers * hidden + 5 * hidden
    assert counters.total(link="device_host", kind="checkpoint", direction="write") == per_tier
    assert counters.total(link="host", kind="checkpoint", direction="write") == per_tier
    assert counters.total(link="host", kind="checkpoint", direction="read") >= per_tier


def test_module_without_the_protocol_trains_parked(tmp_path: Path) -> None:
    """No vertical_pre/vertical_loss: the module's own training_step runs per micro-batch, parked at its block."""
    import lightning.pytorch as pl

    from lightning_smartinf.schedule.parked import ParkedVertical

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.blocks[0](batch.float()).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = fit(Plain(), strategy(tmp_path, {"kind": "vertical", "micro_batches": 2}), max_steps=2,
                  loader=torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))  # fmt: skip
    assert isinstance(trainer.strategy.vertical, ParkedVertical) and trainer.strategy.engine.step_count == 2


def test_batch_must_split_into_micro_batches(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not split into schedule.micro_batches=3"):
        fit(make_module(), strategy(tmp_path, {"kind": "vertical", "micro_batches": 3}), max_steps=1)


def test_all_four_components_combine_in_mixed_precision(tmp_path: Path) -> None:
    """Storage offload + SmartUpdate + SmartComp + vertical schedule with overlap, bf16-mixed: it trains."""
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": str(tmp_path), "subgroup_size": 4096, "io_backend": "threads", "grads": "cpu"},
        update={"backend": "smart", "devices": 2},
        compression={"kind": "topk", "keep": 0.05},
        schedule={"kind": "vertical", "micro_batches": 2, "overlap": 1.0},
    )
    trainer = fit(make_module(), strategy, max_steps=5, precision="bf16-mixed", loader=token_loader(batch_size=4))
    engine = trainer.strategy.engine
    assert engine.step_count == 5 and engine.counters.total(link="host", kind="grad_index") > 0
    assert torch.isfinite(trainer.logged_metrics["train_loss"])


@pytest.mark.parametrize(("overlap", "update"), [
    (0.0, {}), (1.0, {}), (0.5, {"backend": "smart", "devices": 2}),
])  # fmt: skip
def test_eager_updates_during_backward_equal_horizontal(tmp_path: Path, overlap: float, update: dict) -> None:
    horizontal = run(tmp_path / "h", 4, {}, None, **update)
    schedule = {"kind": "vertical", "micro_batches": 4, "overlap": overlap, "eager_update": True}
    vertical = run(tmp_path / "v", 4, schedule, None, **update)
    assert rel(vertical.strategy.consolidated_state_dict(), horizontal.strategy.consolidated_state_dict()) < 1e-5


def test_eager_updates_refuse_clipping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot honour gradient_clip_val"):
        run(tmp_path, 2, {"kind": "vertical", "micro_batches": 2, "eager_update": True}, 0.5)


@pytest.mark.parametrize("protocol", [True, False])
def test_vertical_replays_dropout(tmp_path: Path, protocol: bool) -> None:
    """Dropout 0.2: the recompute in backward replays each (block, micro-batch)'s RNG state from its forward, so
    vertical with one micro-batch equals horizontal; ``protocol=False`` hides vertical_pre/vertical_loss, so the
    module's own training_step runs parked at every block."""
    from dataclasses import replace

    from helpers import TINY

    from lightning_smartinf.models.gpt import GPTModule

    class Plain(GPTModule):
        vertical_pre = None  # type: ignore[assignment]
        vertical_loss = None  # type: ignore[assignment]

    results = []
    for kind in ("horizontal", "vertical"):
        torch.manual_seed(0)
        module = (GPTModule if protocol else Plain)(replace(TINY, dropout=0.2), lr=1e-3)
        trainer = fit(module, strategy(tmp_path / kind, {"kind": kind, "micro_batches": 1}), max_steps=4,
                      precision="32-true", loader=token_loader(samples=32, batch_size=MICRO_BATCH))  # fmt: skip
        results.append(trainer.strategy.consolidated_state_dict())
    assert rel(results[1], results[0]) < 1e-5


@pytest.mark.parametrize("keep", [0.5, 1.0])
def test_kept_graphs_equal_recomputing_bit_for_bit(tmp_path: Path, keep: float) -> None:
    """schedule.keep_activations: backward through the kept forward graph (parameters re-read through references,
    schedule/kept.py) gives exactly what recomputing the block gives, in fp32, with overlap and clipping on."""
    settings = {"kind": "vertical", "micro_batches": 2, "overlap": 0.5}
    recomputed = run(tmp_path / "r", 2, settings, 0.5)
    kept = run(tmp_path / "k", 2, {**settings, "keep_activations": keep}, 0.5)
    expected, got = recomputed.strategy.consolidated_state_dict(), kept.strategy.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_graphs_kept_on_storage_equal_recomputing_bit_for_bit(tmp_path: Path, keep: float) -> None:
    """schedule.spill_activations: the graphs the memory does not keep go to storage (schedule/spill.py) and come
    back for backward byte for byte: the same weights as recomputing, in fp32 with overlap and clipping on."""
    settings = {"kind": "vertical", "micro_batches": 2, "overlap": 0.5}
    recomputed = run(tmp_path / "r", 2, settings, 0.5)
    spilled = run(tmp_path / "s", 2, {**settings, "keep_activations": keep, "spill_activations": 1.0 - keep}, 0.5)
    expected, got = recomputed.strategy.consolidated_state_dict(), spilled.strategy.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    engine = spilled.strategy.engine
    blocks = len(engine.layout.streamed)
    assert engine.graphs.written > 0 and not engine.graphs._graphs  # every graph read back and dropped
    written = engine.counters.total(link="host", kind="graphs", direction="write")
    assert written == engine.graphs.written
    assert engine.counters.total(link="host", kind="graphs", direction="read") <= written
    assert len(spilled.strategy.vertical.spilled) == round((1.0 - keep) * blocks)


def test_kept_graphs_in_bf16_track_recomputing(tmp_path: Path) -> None:
    settings = {"kind": "vertical", "micro_batches": 2}
    recomputed = run(tmp_path / "r", 2, settings, None, "bf16-mixed")
    kept = run(tmp_path / "k", 2, {**settings, "keep_activations": 1.0}, None, "bf16-mixed")
    expected, got = recomputed.strategy.consolidated_state_dict(), kept.strategy.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
