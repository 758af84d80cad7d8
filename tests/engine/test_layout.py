"""Layout: every parameter placed once, subgroups aligned and within size, and clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY

from lightning_smartinf.core import ELEMENT_ALIGN
from lightning_smartinf.engine.layout import build_layout, eight_bit_params
from lightning_smartinf.models.gpt import GPT
from lightning_smartinf.schedule.horizontal import find_blocks


def test_blocks_subgroups_cover_every_parameter_aligned() -> None:
    model = GPT(TINY)
    layout = build_layout(model, find_blocks(model), [list(model.parameters())], subgroup_size=4096)
    assert len(layout.streamed) == TINY.n_layer
    assert layout.num_params == sum(p.numel() for p in model.parameters())
    for block in layout.blocks:
        covered = sum(sg.numel for sg in block.subgroups)
        assert covered >= block.params
        for sg in block.subgroups:
            assert sg.offset % ELEMENT_ALIGN == 0 and sg.numel <= 4096


def test_param_groups_split_subgroups() -> None:
    model = GPT(TINY)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    layout = build_layout(model, find_blocks(model), [decay, no_decay], subgroup_size=1 << 20)
    assert {sg.param_group for sg in layout.subgroups} == {0, 1}
    assert all(len(b.subgroups) == 2 for b in layout.streamed)


def test_8bit_state_leaves_small_tensors_and_embeddings_fp32_in_subgroups_of_their_own() -> None:
    """As bitsandbytes: tensors under ``offload.min_8bit_size`` elements and embedding weights keep fp32 state; each
    group's region splits in two, so every subgroup has one precision and no quantization block spans both."""
    model = GPT(TINY)
    eight = eight_bit_params(model, 4096, embeddings_fp32=True)
    names = {id(p): n for n, p in model.named_parameters()}
    kept = sorted(names[i] for i in {id(p) for p in model.parameters()} - eight)
    assert "wte.weight" in kept and all(p.numel() >= 4096 for p in model.parameters() if id(p) in eight)
    assert any(p.numel() < 4096 for p in model.parameters()) and eight
    layout = build_layout(model, find_blocks(model), [list(model.parameters())], 4096, eight_bit=eight)
    assert sorted(layout.fp32_state or []) == kept
    for block in layout.blocks:
        for slot in block.slots:
            covering = [sg for sg in block.subgroups if sg.offset < slot.offset + slot.numel
                        and slot.offset < sg.offset + sg.numel]  # fmt: skip
            assert {sg.precision for sg in covering} == {"8bit" if id(slot.param) in eight else "fp32"}, slot.name
    everything = eight_bit_params(model, 0, embeddings_fp32=False)
    assert everything == {id(p) for p in model.parameters()}
    plain = build_layout(model, find_blocks(model), [list(model.parameters())], 4096)
    assert plain.fp32_state is None and {sg.precision for sg in plain.subgroups} == {"fp32"}


def test_parameter_missing_from_optimizer_is_named() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="not in the optimizer"):
        build_layout(model, find_blocks(model), [[model.wte.weight]], subgroup_size=4096)


def test_custom_block_protocol() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def offload_blocks(self) -> list[tuple[str, torch.nn.Module]]:
            return [("a", self.a), ("b", self.b)]

    assert [name for name, _ in find_blocks(Net())] == ["a", "b"]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_partition_every_block_into_aligned_chunks(world: int) -> None:
    model = GPT(TINY)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    single = build_layout(model, find_blocks(model), [decay, no_decay], subgroup_size=2048)
    ranks = [build_layout(model, find_blocks(model), [decay, no_decay], 2048, r, world) for r in range(world)]
    for index, block in enumerate(single.blocks):
        covered = sorted(
            (sg.offset, sg.offset + sg.numel, sg.param_group)
            for layout in ranks
            for sg in layout.blocks[index].subgroups
        )
        expected = sorted((sg.offset, sg.offset + sg.numel, sg.param_group) for sg in block.subgroups)
        assert _elements(covered) == _elements(expected)  # the ranks' subgroups together cover what one rank's do
        for layout in ranks:
            lo, hi = layout.chunk(layout.blocks[index])
            assert lo % ELEMENT_ALIGN == 0 and (hi - lo) * world == layout.blocks[index].numel
            assert all(lo <= sg.offset and sg.offset + sg.numel <= hi for sg in layout.blocks[index].subgroups)


def _elements(ranges: list[tuple[int, int, int]]) -> set[tuple[int, int]]:
    return {(i, group) for lo, hi, group in ranges for i in range(lo, hi)}
