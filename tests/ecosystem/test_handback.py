"""After each stage the user's module holds its trained weights (``offload.return_weights``): state dict, forward,
``save_pretrained`` and dtypes as after plain Lightning; or meta tensors that fail loudly when they would not fit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from zoo import VOCAB, CausalLM, token_batches

from lightning_smartinf.config import ScheduleConfig
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

pytest.importorskip("transformers")


def smart(tmp_path: Path, **offload: Any) -> SmartInfinityStrategy:
    return SmartInfinityStrategy(
        offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads", **offload},
        update={"host_adam": "torch"},
    )  # fmt: skip


def trainer(strategy: Any, precision: str = "32-true", steps: int = 3, accumulate: int = 1) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      precision=precision, limit_val_batches=2, accumulate_grad_batches=accumulate)  # fmt: skip


def trained(
    family: str, strategy: Any, change: Callable[[CausalLM], None] | None = None, precision: str = "32-true",
    batch_size: int = 2, accumulate: int = 1,
) -> tuple[CausalLM, pl.Trainer]:  # fmt: skip
    module = CausalLM(family)
    if change is not None:
        change(module)
    run = trainer(strategy, precision, accumulate=accumulate)
    run.fit(module, token_batches(batch_size=batch_size))
    return module, run


TOKENS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def logits(module: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return module(TOKENS)  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_pretrained_round_trip_gives_plain_lightnings_logits(tmp_path: Path, family: str) -> None:
    reference, _ = trained(family, "auto")
    ours, _ = trained(family, smart(tmp_path))
    ours.model.save_pretrained(tmp_path / "hf")
    loaded = type(ours.model).from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=TOKENS).logits, logits(reference), rtol=1e-4, atol=1e-5)
    if family == "gpt2":  # tied weights stay one tensor
        assert ours.model.lm_head.weight is ours.model.transformer.wte.weight


def test_bf16_mixed_keeps_every_parameters_dtype(tmp_path: Path) -> None:
    module = CausalLM("llama")
    module.model.model.norm.to(torch.float64)  # a mixed-dtype module: each tensor keeps its own
    before = {name: p.dtype for name, p in module.named_parameters()}
    trainer(smart(tmp_path), "bf16-mixed").fit(module, token_batches())
    assert {name: p.dtype for name, p in module.named_parameters()} == before


def test_meta_weights_fail_loudly_and_the_next_stage_has_the_trained_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    reference, plain = trained("gpt2", "auto")
    with caplog.at_level(logging.WARNING, logger="lightning_smartinf"):
        ours, run = trained("gpt2", smart(tmp_path, return_weights="meta"))
    assert "smartinf-export" in caplog.text and "return_weights" in caplog.text
    assert all(p.is_meta for p in ours.parameters())
    assert ours.model.lm_head.weight is ours.model.transformer.wte.weight
    out = logits(ours)  # meta in, meta out: any read of a value fails
    assert out.is_meta
    with pytest.raises(RuntimeError, match="meta"):
        float(out.sum())
    with pytest.raises((NotImplementedError, RuntimeError)):  # nor can the weights be copied into a real module
        reference.load_state_dict(ours.state_dict())
    # validate on the same trainer takes the weights back into the engine: plain Lightning's validation loss
    ours_loss = run.validate(ours, token_batches(samples=4), verbose=False)[0]["val_loss"]
    plain_loss = plain.validate(reference, token_batches(samples=4), verbose=False)[0]["val_loss"]
    assert abs(ours_loss - plain_loss) < 1e-5 * abs(plain_loss)
    assert all(p.is_meta for p in ours.parameters())


def test_fit_then_validate_then_use_the_module(tmp_path: Path) -> None:
    reference, plain = trained("llama", "auto")
    ours, run = trained("llama", smart(tmp_path))
    ours_loss = run.validate(ours, token_batches(samples=4), verbose=False)[0]["val_loss"]
    plain_loss = plain.validate(reference, token_batches(samples=4), verbose=False)[0]["val_loss"]
    assert abs(ours_loss - plain_loss) < 1e-5 * abs(plain_loss)
    torch.testing.assert_close(logits(ours), logits(reference), rtol=1e-4, atol=1e-5)


def test_validate_before_fit_keeps_the_original_weights(tmp_path: Path) -> None:
    """An engine built for evaluation has no optimizer: the module gets its own values back, bit for bit even
    though the engine computed in bf16, and a later fit on the same trainer builds the engine it needs."""
    module = CausalLM("llama")
    original = {k: v.clone() for k, v in module.state_dict().items()}
    run = trainer(smart(tmp_path), "bf16-mixed")
    run.validate(module, token_batches(samples=4), verbose=False)
    after = module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in original.items())
    run.fit(module, token_batches())
    assert run.strategy.engine.step_count == 3  # type: ignore[attr-defined]


def freeze_embedding_and_first_layer(module: CausalLM) -> None:
    module.model.model.embed_tokens.requires_grad_(False)
    module.model.model.layers[0].requires_grad_(False)


def share_across_blocks(module: CausalLM) -> None:
    layers = module.model.model.layers
    layers[1].mlp.down_proj.weight = layers[0].mlp.down_proj.weight


@pytest.mark.parametrize("vertical", [False, True], ids=["horizontal", "vertical"])
@pytest.mark.parametrize("change", [freeze_embedding_and_first_layer, share_across_blocks])
def test_frozen_and_shared_parameters_train_as_plain_lightning(
    tmp_path: Path, change: Callable[..., None], vertical: bool
) -> None:  # fmt: skip
    """2 micro-batches a step: accumulated (plain, horizontal) or the vertical schedule's M=2."""
    reference, _ = trained("llama", "auto", change, accumulate=2)
    strategy = smart(tmp_path)
    if vertical:
        strategy.schedule = ScheduleConfig("vertical", micro_batches=2)
    ours, run = trained("llama", strategy, change, batch_size=4 if vertical else 2, accumulate=1 if vertical else 2)
    plain = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)
    layout = run.strategy.engine.layout  # type: ignore[attr-defined]
    owned = {slot.name for block in layout.blocks for slot in block.slots}
    if change is freeze_embedding_and_first_layer:  # no optimizer state, no gradient traffic for frozen weights
        assert not any(name.startswith(("model.model.embed_tokens", "model.model.layers.0.")) for name in owned)
        assert not layout.blocks[1].subgroups
    else:
        assert "model.model.layers.0.mlp.down_proj.weight" in {s.name for s in layout.resident.slots}
