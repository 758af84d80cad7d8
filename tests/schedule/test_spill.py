"""Kept graphs on storage (schedule/spill.py): a block's saved activations go to disk and come back byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_smartinf.schedule.kept import parameter_references
from lightning_smartinf.schedule.spill import GraphSpill
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import ThreadPoolIO
from lightning_smartinf.storage.store import CorruptReadError, FileStore


class Block(torch.nn.Module):
    """Saves views of one storage (q, k, v of one projection), a GELU input and a LayerNorm's statistics."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return x + self.out(torch.nn.functional.gelu(attention))


def spill_of(path: Path, in_flight: int = 256 * 2**20) -> GraphSpill:
    store = FileStore(path, ThreadPoolIO(2, direct=False), TrafficCounters(), "host", verify=True)
    return GraphSpill(store, store.allocator, in_flight)


def grads(block: Block, x0: torch.Tensor, spill: GraphSpill | None, micros: int = 3) -> list[torch.Tensor]:
    """Forward of ``micros`` micro-batches with their graphs kept (on storage with ``spill``), then backward."""
    block.zero_grad()
    graphs = []
    for m in range(micros):
        x = x0[m].clone().requires_grad_(True)
        pack = spill.packer((0, m), [x]) if spill is not None else None
        with parameter_references(list(block.parameters()), spill=pack):
            graphs.append((x, block(x)))
        if spill is not None:
            spill.flush((0, m))
    if spill is not None:
        spill.prefetch([(0, m) for m in range(micros)])
    for m, (_, out) in enumerate(graphs):
        out.backward(torch.ones_like(out))
        if spill is not None:
            spill.release((0, m))
    return [p.grad.clone() for p in block.parameters()] + [x.grad for x, _ in graphs]  # type: ignore[union-attr]


@pytest.mark.parametrize("in_flight", [0, 256 * 2**20])
def test_gradients_through_spilled_graphs_equal_in_memory_ones_bit_for_bit(tmp_path: Path, in_flight: int) -> None:
    """``in_flight=0``: every buffer goes back as its write ends, so backward reads every graph from the file; with
    room in flight, a graph whose buffer is still held when backward asks for it is used without a read."""
    torch.manual_seed(0)
    block, x0 = Block(), torch.randn(3, 2, 8, 32)
    expected = grads(block, x0, None)
    spill = spill_of(tmp_path, in_flight)
    got = grads(block, x0, spill)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    counters = spill.store.counters  # type: ignore[attr-defined]
    assert counters.total(kind="graphs", direction="write") == spill.written > 0
    reads = counters.total(kind="graphs", direction="read")
    assert (reads == spill.written if in_flight == 0 else reads <= spill.written) and not spill._graphs


def test_buffers_are_reused_across_iterations(tmp_path: Path) -> None:
    torch.manual_seed(0)
    block, x0 = Block(), torch.randn(3, 2, 8, 32)
    spill = spill_of(tmp_path, in_flight=0)
    for _ in range(4):
        grads(block, x0, spill)
        spill.clear()
    pooled = sum(len(buffers) for buffers in spill._buffers._free.values())
    assert 0 < pooled <= 3  # one iteration's graphs at most, not one set per iteration
    spill.close()
    assert not spill._buffers._free


def test_a_graph_the_disk_returns_wrong_is_an_error_naming_its_file(tmp_path: Path) -> None:
    """The graph's file damaged between its write and its read: the checksum fails the read (twice: the retry
    reads the same damage) and backward stops with the file's name instead of training on wrong activations."""
    torch.manual_seed(0)
    block = Block()
    spill = spill_of(tmp_path, in_flight=0)
    x = torch.randn(2, 8, 32, requires_grad=True)
    with parameter_references(list(block.parameters()), spill=spill.packer((5, 1), [x])):
        out = block(x)
    spill.flush((5, 1))
    spill._reap(0)  # the write is done and its buffer handed back: backward must read the file
    path = tmp_path / "graphs" / "b5m1"
    damaged = bytearray(path.read_bytes())
    damaged[100] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptReadError, match="graphs b5m1"):
        out.backward(torch.ones_like(out))
    spill.clear()
    assert not spill._graphs
