"""Top-k selection, wire format and error feedback against plain PyTorch references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_smartinf.compress.topk import TopKCompressor, max_nnz
from lightning_smartinf.config import CompressionConfig
from lightning_smartinf.core import Layout, StepContext, Subgroup

CTX = StepContext(1, [])


def layout_of(numel: int) -> tuple[Layout, Subgroup]:
    sg = Subgroup(index=0, block=0, param_group=0, offset=0, numel=numel)
    return Layout(blocks=[], subgroups=[sg]), sg


def test_selects_the_largest_magnitudes_of_each_block() -> None:
    cfg = CompressionConfig(kind="topk", keep=0.01, block=1000)
    layout, sg = layout_of(2500)  # two full blocks and a tail of 500
    grad = torch.randn(2500, generator=torch.Generator().manual_seed(0))
    sparse = TopKCompressor(cfg, layout, torch.device("cpu")).compress(sg, grad, CTX)
    expected = []
    for start, stop, k in ((0, 1000, 10), (1000, 2000, 10), (2000, 2500, 5)):
        expected.append(grad[start:stop].abs().topk(k).indices + start)
    assert torch.equal(sparse.indices.long(), torch.cat(expected).sort().values)
    assert sparse.indices.dtype == torch.int32 and sparse.values.dtype == torch.bfloat16
    assert torch.equal(sparse.values, grad[sparse.indices.long()].to(torch.bfloat16))
    assert sparse.indices.numel() == max_nnz(2500, cfg) == 25
    assert sparse.nbytes == 25 * 6


def test_wire_ratio_formula() -> None:
    cfg = CompressionConfig(kind="topk", keep=0.01, block=4096)
    layout, sg = layout_of(4096 * 16)
    ratio = TopKCompressor(cfg, layout, torch.device("cpu")).summary()["wire_ratio"]
    assert ratio == pytest.approx(41 * 16 * 6 / (4096 * 16 * 4))  # round(0.01 * 4096) = 41 per block


def test_summary_reports_keep_and_the_models_wire_ratio() -> None:
    subgroups = [Subgroup(index=i, block=0, param_group=0, offset=0, numel=n) for i, n in enumerate((8192, 5000))]
    layout = Layout(blocks=[], subgroups=subgroups)
    plain = TopKCompressor(CompressionConfig(kind="topk", keep=0.01, block=4096), layout, torch.device("cpu"))
    kept = 41 * 2 + 41 + 9  # two full blocks, then a block and a tail of 904 in the second subgroup
    assert plain.summary()["wire_ratio"] == pytest.approx(kept * 6 / (13192 * 4))
    assert plain.describe().startswith("top-k keep=0.01 per 4096-element block, wire 0.0150 of the dense fp32")
    cfg = CompressionConfig(kind="topk", keep=0.01, block=4096, error_feedback=True, catch_up=True)
    catch_up = TopKCompressor(cfg, layout, torch.device("cpu"))
    assert catch_up.summary()["wire_ratio"] == pytest.approx(kept * 8 / (13192 * 4))
    line = catch_up.describe()
    assert "bf16 sum of squares" in line and "error feedback (cpu/float32 0.1 MiB); catch-up" in line


def test_error_feedback_keeps_exactly_what_was_not_sent() -> None:
    cfg = CompressionConfig(kind="topk", keep=0.05, block=100, error_feedback=True)
    layout, sg = layout_of(300)
    compressor = TopKCompressor(cfg, layout, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    g1, g2 = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    first = compressor.compress(sg, g1, CTX)
    residual = compressor._residuals[0].clone()
    torch.testing.assert_close(first.to_dense() + residual, g1, rtol=0, atol=1e-6)
    second = compressor.compress(sg, g2, CTX)
    torch.testing.assert_close(second.to_dense() + compressor._residuals[0], g2 + residual, rtol=0, atol=1e-6)


def test_catch_up_sends_the_sums_of_prepared_gradients_and_squares_over_each_wait() -> None:
    """Each sent element carries the sum of its unscaled, clipped gradients since it was last sent (through the
    residual) and the sum of their squares; a sent element's sums start again from zero."""
    cfg = CompressionConfig(kind="topk", keep=0.05, block=100, error_feedback=True, catch_up=True)
    layout, sg = layout_of(300)
    compressor = TopKCompressor(cfg, layout, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    sums, squares = torch.zeros(300), torch.zeros(300)
    for step in range(1, 6):
        ctx = StepContext(step, [], inv_scale=0.5, clip_coef=0.8)
        grad = torch.randn(300, generator=gen)
        prepared = grad * 0.5 * 0.8
        sums += prepared
        squares += prepared.square()
        sparse = compressor.compress(sg, grad, ctx)
        sent = sparse.indices.long()
        assert sparse.squares is not None and sparse.squares.dtype == torch.bfloat16
        torch.testing.assert_close(sparse.values.float(), sums[sent], rtol=1e-2, atol=1e-6)  # bf16 on the wire
        torch.testing.assert_close(sparse.squares.float(), squares[sent], rtol=1e-2, atol=1e-6)
        sums[sent] -= sparse.values.float()  # what error feedback keeps
        squares[sent] = 0.0
        torch.testing.assert_close(compressor._residuals[0], sums, rtol=0, atol=1e-5)
        torch.testing.assert_close(compressor._squares[0], squares, rtol=0, atol=1e-5)
    assert sparse.nbytes == 15 * (4 + 2 + 2)
    assert compressor.summary()["wire_ratio"] == pytest.approx(15 * 8 / (300 * 4))


def test_residuals_saved_before_catch_up_existed_still_load() -> None:
    """Checkpoints written before catch-up hold the residuals as a flat {subgroup index: tensor} dict."""
    cfg = CompressionConfig(kind="topk", keep=0.05, block=100, error_feedback=True)
    layout, _ = layout_of(300)
    compressor = TopKCompressor(cfg, layout, torch.device("cpu"))
    saved = torch.randn(300, generator=torch.Generator().manual_seed(3))
    compressor.load_state_dict({0: saved})
    assert torch.equal(compressor._residuals[0], saved)
    with pytest.raises(ValueError, match="another compression.catch_up setting"):
        TopKCompressor(dataclasses.replace(cfg, catch_up=True), layout, torch.device("cpu")).load_state_dict({0: saved})


def test_residual_placement_follows_the_budget() -> None:
    subgroups = [Subgroup(index=i, block=0, param_group=0, offset=0, numel=2**18) for i in range(3)]
    cfg = CompressionConfig(kind="topk", error_feedback=True, residual_budget_mb=2.0)  # room for two fp32 residuals
    compressor = TopKCompressor(cfg, Layout(blocks=[], subgroups=subgroups), torch.device("cpu"))
    assert compressor.residual_bytes == {"cpu/float32": 2 * 2**20, "cpu/bfloat16": 2**19}
    catch_up = dataclasses.replace(cfg, catch_up=True)  # residual and sums of squares: one subgroup fits in fp32
    compressor = TopKCompressor(catch_up, Layout(blocks=[], subgroups=subgroups), torch.device("cpu"))
    assert compressor.residual_bytes == {"cpu/float32": 2 * 2**20, "cpu/bfloat16": 2 * 2**19 * 2}


@pytest.mark.parametrize(("settings", "message"), [
    ({"keep": 0.0}, "compression.keep=0.0 must be in"), ({"keep": 1.5}, "compression.keep=1.5 must be in"),
    ({"value_dtype": "fp8"}, "compression.value_dtype"),
    ({"catch_up": True}, "compression.catch_up=true needs compression.error_feedback=true"),
])  # fmt: skip
def test_bad_settings_name_the_key(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompressionConfig(kind="topk", **settings)  # type: ignore[arg-type]
