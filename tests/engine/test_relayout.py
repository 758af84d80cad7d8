"""Re-cutting saved state onto another layout: every element of every state kind (and of the top-k residuals) lands
where this layout keeps it, for another rank count and another subgroup size, and a gap or another model is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import TINY

from lightning_smartinf.checkpoint.manifest import CheckpointError
from lightning_smartinf.core import Layout
from lightning_smartinf.engine.layout import build_layout
from lightning_smartinf.engine.relayout import SavedLayout, mappable
from lightning_smartinf.engine.snapshot import blocks_record
from lightning_smartinf.models.gpt import GPT
from lightning_smartinf.schedule.horizontal import find_blocks
from lightning_smartinf.update import quant8

KINDS = ("master", "exp_avg", "exp_avg_sq")


def layouts(world: int, subgroup_size: int) -> list[Layout]:
    """The layout of every rank of ``world``, with two param groups (so regions and padding sit between them)."""
    torch.manual_seed(0)
    model = GPT(TINY)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [build_layout(model, find_blocks(model), [decay, rest], subgroup_size, rank, world) for rank in range(world)]


def tag(kind: int, block: int, start: int, numel: int) -> np.ndarray:
    """Each element's own identity: which kind, which block, which offset."""
    return (kind * 10_000_000 + block * 100_000 + np.arange(start, start + numel)).astype(np.int32)


def save(root: Path, saved: list[Layout], stripes: int) -> list[tuple[Path, dict[str, Any]]]:
    """Write every saved rank's state files as a checkpoint lays them out (``state{stripe}/{kind}/{key}``, padded)."""
    parts = []
    for rank, layout in enumerate(saved):
        part = root / f"rank{rank}"
        for sg in layout.subgroups:
            for k, kind in enumerate(KINDS):
                target = part / f"state{sg.index % stripes}" / kind / sg.key
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tag(k, sg.block, sg.offset, sg.numel).tobytes()
                target.write_bytes(data + b"\0" * (-len(data) % 4096))
        parts.append((part, blocks_record(layout)))
    return parts


@pytest.mark.parametrize(("saved_world", "world", "size"), [(2, 1, 4096), (1, 2, 4096), (2, 3, 2048), (3, 2, 8192)])
def test_every_element_of_every_kind_lands_in_its_place(saved_world: int, world: int, size: int,
                                                         tmp_path: Path) -> None:  # fmt: skip
    saved = SavedLayout(save(tmp_path, layouts(saved_world, 4096), stripes=2))
    covered = 0
    for layout in layouts(world, size):
        for sg in layout.subgroups:
            for k, kind in enumerate(KINDS):
                data = saved.assemble(sg, kind)
                assert data is not None and data.numel() % 4096 == 0
                got = data[: sg.numel * 4].numpy().view(np.int32)
                assert np.array_equal(got, tag(k, sg.block, sg.offset, sg.numel)), (sg, kind)
            covered += sg.numel
    assert covered == sum(sg.numel for layout in layouts(saved_world, 4096) for sg in layout.subgroups)


def test_residuals_follow_the_same_map(tmp_path: Path) -> None:
    saved_layouts = layouts(2, 4096)
    saved = SavedLayout(save(tmp_path, saved_layouts, stripes=1))
    tables = [{"residual": {sg.index: torch.from_numpy(tag(0, sg.block, sg.offset, sg.numel)).float()
                            for sg in layout.subgroups}} for layout in saved_layouts]  # fmt: skip
    for sg in layouts(1, 8192)[0].subgroups:
        got = saved.residuals("residual", sg, torch.zeros(1, dtype=torch.bfloat16), tables)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, torch.from_numpy(tag(0, sg.block, sg.offset, sg.numel)).to(torch.bfloat16))


def test_a_kind_saved_by_no_rank_is_none_and_a_missing_piece_is_named(tmp_path: Path) -> None:
    saved_layouts = layouts(2, 4096)
    parts = save(tmp_path, saved_layouts, stripes=1)
    saved = SavedLayout(parts)
    sg = layouts(1, 1 << 20)[0].streamed[0].subgroups[0]  # one subgroup spanning both saved ranks' chunks
    assert saved.assemble(sg, "momentum_buffer") is None
    victim = next((tmp_path / "rank1").rglob("exp_avg/*"))
    victim.unlink()
    partial = SavedLayout(parts)
    with pytest.raises(CheckpointError, match="no exp_avg file for saved subgroup"):
        for layout_sg in layouts(1, 1 << 20)[0].subgroups:
            partial.assemble(layout_sg, "exp_avg")
    gap = SavedLayout([parts[0]])  # rank 1's slices are not there
    with pytest.raises(CheckpointError, match=r"holds no state for elements \[\d+, \d+\) of block"):
        gap.assemble(sg, "master")


def test_a_layout_of_another_model_is_not_mappable() -> None:
    mine = blocks_record(layouts(1, 4096)[0])
    assert mappable(blocks_record(layouts(2, 2048)[0]), mine) == []
    other = blocks_record(layouts(1, 4096)[0])
    other["blocks"][1]["params"][0][1] += 2048
    assert mappable(other, mine) == [f"block {other['blocks'][1]['name']!r} lays out its parameters otherwise "
                                     "(another parameter order or param groups)"]  # fmt: skip


@pytest.mark.parametrize(("saved_world", "world", "size"), [(2, 1, 8192), (1, 3, 2048)])
def test_8bit_state_is_recut_code_by_code_and_block_by_block(saved_world: int, world: int, size: int,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """Each element's code and each 2048-element block's absmax (update/quant8.py) land where this layout keeps
    them: quantization blocks start on the subgroups' 2048-element boundaries, so none is split."""

    def quantized(block: int, start: int, numel: int) -> bytes:
        raw = torch.zeros(quant8.payload(numel, quant8.INT8), dtype=torch.uint8)
        codes, scales = quant8.split(raw, numel)
        codes.copy_(torch.from_numpy((tag(0, block, start, numel) % 251).astype(np.uint8)))
        scales.copy_(torch.arange(start // 2048, start // 2048 + scales.numel(), dtype=torch.float32) + block * 1000)
        return raw.numpy().tobytes()

    for rank, layout in enumerate(layouts(saved_world, 4096)):
        for sg in layout.subgroups:
            target = tmp_path / f"rank{rank}" / "state0" / "exp_avg" / sg.key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(quantized(sg.block, sg.offset, sg.numel))
    saved = SavedLayout([(tmp_path / f"rank{r}", blocks_record(layout)) for r, layout in
                         enumerate(layouts(saved_world, 4096))])  # fmt: skip
    for layout in layouts(world, size):
        for sg in layout.subgroups:
            got = saved.assemble_quantized(sg, "exp_avg")
            assert got is not None
            want = quantized(sg.block, sg.offset, sg.numel)
            assert got[: len(want)].numpy().tobytes() == want, sg
