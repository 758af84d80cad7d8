"""A live engine's trained weights as safetensors, read block by block from its masters (bounded host memory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from lightning_smartinf.checkpoint.export import DTYPES, plan_tensors, with_aliases, write_tensors
from lightning_smartinf.core import Block, Layout, block_pairs, owned_slots
from lightning_smartinf.ecosystem.adapters import Merge, lora_merges, merge_block, merged_name
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.snapshot import parameter_aliases
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.memory import release_free_heap


class Exportable(Protocol):
    """The parts of a live engine (``OffloadEngine`` is one) an export reads."""

    model: nn.Module
    layout: Layout
    frozen_layout: Layout
    frozen: ParamStreamer | None
    step_count: int

    def block_masters(self, block: Block) -> torch.Tensor: ...


def export_live(engine: Exportable, out: Path, dtype: str = "fp32", max_shard_bytes: int = 2_000_000_000,
                strip_prefix: str = "", write: bool = True, merge_adapters: bool = False) -> list[Path]:  # fmt: skip
    """The trained weights of a live engine, as ``export_safetensors`` writes them, read block by block from its
    masters and, for frozen weights, their files (a collective under data parallelism: every rank calls it,
    ``write`` on one). ``merge_adapters``: LoRA adapters merged into their base weights block by block and left out,
    named as ``merge_and_unload`` names the merged model (bounded memory, whatever the base's size)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    pairs, slots = block_pairs(engine.layout, engine.frozen_layout), owned_slots(engine.layout, engine.frozen_layout)
    aliases = parameter_aliases(engine.model)
    owned = {slot.name for slot in slots} | set(aliases)
    extra = {k: v for k, v in engine.model.state_dict().items() if k not in owned}
    merges = _merges(engine) if merge_adapters else []
    adapters = {name for m in merges for name in (m.lora_a, m.lora_b)}
    rename = merged_name if merge_adapters else (lambda name: name)
    plan = plan_tensors(((rename(s.name), tuple(s.shape)) for s in slots if s.name not in adapters),
                        {rename(a): rename(n) for a, n in aliases.items()},
                        {rename(k): v for k, v in extra.items()}, target)  # fmt: skip

    def params() -> Iterator[tuple[str, torch.Tensor]]:
        """Each block's trained parameters from their masters and its frozen ones from their files, merged."""
        for block, fixed in pairs:
            tensors = _block_tensors(engine, block, fixed)
            for name, value in (merge_block(tensors, merges) if merges else tensors).items():
                yield name, value.to(target)
            del tensors
            release_free_heap()  # one block at a time in fact, not only in intent (memory.py)

    tensors = with_aliases(params(), {rename(a): rename(n) for a, n in aliases.items()},
                           {rename(k): v for k, v in extra.items()})  # fmt: skip
    if not write:
        for _ in tensors:
            pass
        return []
    metadata = {"format": "pt", "global_step": str(engine.step_count), "dtype": dtype}
    return write_tensors(out, plan, tensors, max_shard_bytes, metadata, strip_prefix)


def _block_tensors(engine: Exportable, block: Block, fixed: Block) -> dict[str, torch.Tensor]:
    """One block's parameters by name: the trained ones (fp32 masters), then the frozen ones (their own dtype)."""
    flat = engine.block_masters(block)
    tensors = {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in block.slots}
    if fixed.slots and engine.frozen is not None:
        values = engine.frozen.read_block(fixed.index)
        tensors.update({s.name: values[s.offset : s.offset + s.numel].view(s.shape) for s in fixed.slots})
    return tensors


def _merges(engine: Exportable) -> list[Merge]:
    """The LoRA merges of the engine's model; each must lie within one streamed block."""
    merges = lora_merges(engine.model)
    if not merges:
        raise ConfigError("merge_adapters=True: the model holds no LoRA adapters to merge")
    block_of = {s.name: b.index for b, f in block_pairs(engine.layout, engine.frozen_layout)
                for s in b.slots + f.slots}  # fmt: skip
    for m in merges:
        homes = {block_of.get(m.base), block_of.get(m.lora_a), block_of.get(m.lora_b)}
        if len(homes) != 1 or homes == {0} or None in homes:
            raise ConfigError(f"merge_adapters=True merges adapters inside the streamed blocks; {m.base} is not "
                              "(an adapter on a resident layer): export without merging")  # fmt: skip
    return merges
