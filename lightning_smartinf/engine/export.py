"""A live engine's trained weights as safetensors, read block by block from its masters (bounded host memory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lightning_smartinf.checkpoint.export import DTYPES, plan_tensors, with_aliases, write_tensors
from lightning_smartinf.engine.snapshot import parameter_aliases
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.memory import release_free_heap

if TYPE_CHECKING:
    from lightning_smartinf.engine.engine import OffloadEngine


def export_live(engine: OffloadEngine, out: Path, dtype: str = "fp32", max_shard_bytes: int = 2_000_000_000,
                strip_prefix: str = "", write: bool = True) -> list[Path]:  # fmt: skip
    """The trained weights of a live engine, as ``export_safetensors`` writes them, read block by block from its
    masters (a collective under data parallelism: every rank calls it, ``write`` on one)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    aliases = parameter_aliases(engine)
    pairs = list(zip(engine.layout.blocks, engine.frozen_layout.blocks, strict=True))
    slots = [slot for block, fixed in pairs for slot in block.slots + fixed.slots]
    owned = {slot.name for slot in slots} | set(aliases)
    extra = {k: v for k, v in engine.model.state_dict().items() if k not in owned}
    plan = plan_tensors(((s.name, tuple(s.shape)) for s in slots), aliases, extra, target)

    def params() -> Iterator[tuple[str, torch.Tensor]]:
        """Each block's trained parameters from their masters, then its frozen ones from their files."""
        for block, fixed in pairs:
            flat = engine.block_masters(block)
            for slot in block.slots:
                yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape).to(target)
            del flat
            if fixed.slots and engine.frozen is not None:
                values = engine.frozen.read_block(fixed.index)
                for slot in fixed.slots:
                    yield slot.name, values[slot.offset : slot.offset + slot.numel].view(slot.shape).to(target)
                del values
            release_free_heap()  # one block at a time in fact, not only in intent (memory.py)

    tensors = with_aliases(params(), aliases, extra)
    if not write:
        for _ in tensors:
            pass
        return []
    metadata = {"format": "pt", "global_step": str(engine.step_count), "dtype": dtype}
    return write_tensors(out, plan, tensors, max_shard_bytes, metadata, strip_prefix)
