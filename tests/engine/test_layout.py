"""Layout: every parameter placed once, subgroups aligned and within size, and clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from lightning_smartinf.engine.layout import ELEMENT_ALIGN, build_layout
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
