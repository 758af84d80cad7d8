"""smartinf-chaos's arithmetic: the rank counts of --world-sizes keep the global batch, and how chains compare."""

from __future__ import annotations

import pytest
import torch
from smartinf_tools.chaos import chain_difference, rank_plan, replay_legs


def test_each_rank_count_accumulates_to_the_same_global_batch() -> None:
    assert rank_plan([2, 1]) == [(2, 1), (1, 2)]
    assert rank_plan([4, 1, 2]) == [(4, 1), (1, 4), (2, 2)]
    with pytest.raises(SystemExit, match="each must divide the largest"):
        rank_plan([2, 3])


def test_a_chain_differs_by_its_largest_relative_difference() -> None:
    expected = {"w": torch.tensor([1.0, -2.0]), "b": torch.zeros(2), "n": torch.tensor([3])}
    assert chain_difference(expected, {k: v.clone() for k, v in expected.items()}) == 0.0
    moved = {**expected, "w": torch.tensor([1.0, -2.0002])}
    assert chain_difference(expected, moved) == pytest.approx(1e-4, rel=1e-3)
    assert chain_difference(expected, {**expected, "b": torch.tensor([0.0, 1e-9])}) == float("inf")
    assert chain_difference(expected, {"w": expected["w"]}) == float("inf")


def test_a_chain_replays_as_the_legs_that_moved_it_on() -> None:
    # fresh on 2 ranks, killed at step 6; on 1 rank killed before any save; on 2 to step 10; on 1 to the end
    assert replay_legs([(0, -1), (1, 6), (0, 6), (1, 10)], 20) == [(0, 6), (0, 10), (1, 20)]
    # killed before the first save: the next run starts afresh, and the first leg moved nothing
    assert replay_legs([(0, -1), (1, -1)], 8) == [(1, 8)]
