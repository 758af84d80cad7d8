"""Hugging Face and litgpt models in a user's LightningModule: smart_infinity equals plain Lightning, fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from zoo import MODELS, VOCAB, CausalLM, token_batches

from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

LIBRARY = {"llama": "transformers", "gpt2": "transformers", "mixtral": "transformers", "litgpt": "litgpt"}


def fit(family: str, strategy: Any, batch_size: int, accumulate: int, clip: float | None,
        lr: float) -> tuple[CausalLM, Any]:  # fmt: skip
    module = CausalLM(family, lr=lr)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="32-true", limit_val_batches=0,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip,
    )  # fmt: skip
    trainer.fit(module, token_batches(batch_size=batch_size))
    return module, trainer


def relative(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    ref = dict(reference.named_parameters())
    diff = torch.cat([(ours[n] - p.detach()).reshape(-1) for n, p in ref.items()])
    return float(diff.norm() / torch.cat([p.detach().reshape(-1) for p in ref.values()]).norm())


@pytest.mark.parametrize("schedule", ["default", "horizontal", "vertical", "spill", "smart"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_library_model_equals_plain_lightning(tmp_path: Path, family: str, schedule: str) -> None:
    """AdamW, 6 steps of 2 micro-batches: accumulated the Lightning way under the default schedule (``auto``: each
    window of 2 batches as one vertical pass, graphs kept) and horizontally; the vertical schedule's M=2 on the same
    micro-batches; ``spill``: the same with every block's graph kept on storage (schedule/spill.py), none
    recomputed; ``smart``: the default schedule with SmartUpdate's OpenCL kernels on 2 PoCL devices. Clipping 0.5
    except GPT-2 (its key bias's true gradient is zero, so clipped runs compare rounding noise)."""
    pytest.importorskip(LIBRARY[family])
    clip = None if family == "gpt2" else 0.5
    # the OpenCL kernel rounds unlike torch's Adam, by an ulp a step, and lr=1e-2 amplifies that through GPT-2's
    # noise-only key bias (1.2e-5); at 1e-3 it stays within the bound, as for DeepSpeed's CPU Adam (test_strategy.py)
    lr = 1e-3 if family == "gpt2" and schedule == "smart" else 1e-2
    reference, _ = fit(family, "auto", 2, 2, clip, lr)
    vertical = schedule in ("vertical", "spill")
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads",
                 # horizontally all on storage, to count the reads per micro-batch; the others with the default
                 # budget, which puts the 16-bit parameters in RAM first
                 "host_memory_budget": "0" if schedule == "horizontal" else "auto"},
        update={"backend": "smart", "devices": 2} if schedule == "smart" else {"host_adam": "torch"},
        schedule={"kind": "vertical", "micro_batches": 2, "spill_activations": float(schedule == "spill")}
        if vertical else {"kind": "horizontal"}
        if schedule == "horizontal" else None,
    )  # fmt: skip
    module, trainer = fit(family, strategy, 4 if vertical else 2, 1 if vertical else 2, clip, lr)
    engine = trainer.strategy.engine
    assert len(engine.layout.streamed) == 2 and engine.step_count == 6
    assert relative(trainer.strategy.consolidated_state_dict(), reference) < 1e-5
    # the trained weights are back in the user's module: its state dict and its forward are plain Lightning's
    assert relative(module.state_dict(), reference) < 1e-5
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(module(tokens), reference(tokens), rtol=1e-4, atol=1e-5)
    # each block's parameters on storage are read once per micro-batch (horizontal) or once per iteration (vertical),
    # twice each; those the budget placed in RAM cross no storage link
    reads = engine.counters.total(link="host", kind="param", direction="read")
    placed = engine.placement.params
    streamed = sum(sg.numel for b in engine.layout.streamed for sg in b.subgroups if sg.key not in placed) * 4
    assert reads == 2 * streamed * 6 * (2 if schedule == "horizontal" else 1)
    assert (streamed == 0) == (schedule != "horizontal")
    if schedule == "default":  # the default budget leaves room for every block's graph: nothing recomputed
        assert trainer.strategy.vertical.kept_rounds == 2
    if schedule == "spill":  # every graph to storage and back
        assert trainer.strategy.vertical.spilled_rounds == 2 and trainer.strategy.vertical.kept_rounds == 0
        written = engine.counters.total(link="host", kind="graphs", direction="write")
        assert written == engine.graphs.written > 0 and not engine.graphs._graphs


def test_a_model_without_blocks_is_refused_naming_offload_blocks(tmp_path: Path) -> None:
    class Flat(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.body(batch.float()).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state"), "io_backend": "threads"})
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ValueError, match="no repeated blocks to stream in Flat.*offload_blocks"):
        trainer.fit(Flat(), torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
