"""Restore a checkpoint written with another layout: by another number of ranks, or with another subgroup size.

Every element of a block's flat buffer has one place whatever the layout: its block and its offset. Parameters sit
at the same offsets for any rank count and subgroup size; only the chunk each rank owns and the subgroup cuts
differ (engine/layout.py). So each subgroup of this run's layout is assembled from the saved subgroups that
overlap it, read from whichever saved rank's files hold them. One subgroup is in memory at a time: no whole-model
gather, and nothing to convert offline. The error-feedback residuals of top-k compression follow the same map,
read through a memory map of each saved rank's file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.checkpoint.manifest import CheckpointError
from lightning_smartinf.core import Subgroup
from lightning_smartinf.storage.aligned import align_up
from lightning_smartinf.update import quant8

STATE_BYTES = 4
"""Every state kind (fp32 master, optimizer state, catch-up's step) holds 4 bytes per element."""


@dataclass(frozen=True)
class SavedPiece:
    """One saved subgroup: where its elements sit in their block, and which saved rank's files hold them."""

    part: int
    index: int
    key: str
    block: int
    offset: int
    numel: int


def mappable(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What keeps a saved layout record from mapping onto this run's (empty: every parameter of every block sits at
    the same offset, so the state can be re-cut for any rank count and subgroup size)."""
    old = [(b["name"], [p[:3] for p in b["params"]]) for b in saved["blocks"]]
    new = [(b["name"], [p[:3] for p in b["params"]]) for b in current["blocks"]]
    if old == new:
        return []
    old_blocks, new_blocks = [b for b, _ in old], [b for b, _ in new]
    if old_blocks != new_blocks:
        return [f"blocks {old_blocks[:3]}... (this run: {new_blocks[:3]}...)"]
    for (name, a), (_, b) in zip(old, new, strict=True):
        if a != b:
            return [f"block {name!r} lays out its parameters otherwise (another parameter order or param groups)"]
    return []


class SavedLayout:
    """The subgroups every saved rank wrote (``parts``: each rank's engine-state directory and layout record), by
    block and offset, and the files that hold them."""

    def __init__(self, parts: list[tuple[Path, dict[str, Any]]], element_bytes: int = STATE_BYTES,
                 pattern: str = "state*/*/sg*") -> None:  # fmt: skip
        """``element_bytes``: bytes an element of the files takes; ``pattern``: the files under each root, each
        named ``{kind}/{subgroup key}``."""
        self.roots = [root for root, _ in parts]
        self.element_bytes = element_bytes
        self.pieces: dict[int, list[SavedPiece]] = {}
        for part, (_, layout) in enumerate(parts):
            for index, (key, block, _, offset, numel) in enumerate(layout["subgroups"]):
                self.pieces.setdefault(block, []).append(SavedPiece(part, index, key, block, offset, numel))
        for pieces in self.pieces.values():
            pieces.sort(key=lambda p: p.offset)
        self._files: list[dict[tuple[str, str], Path]] = [
            {(f.parent.name, f.name): f for f in root.glob(pattern)} for root in self.roots
        ]

    def covering(self, sg: Subgroup) -> Iterator[tuple[SavedPiece, int, int, int]]:
        """(piece, first element in the piece, first element in ``sg``, count) for each saved subgroup overlapping
        ``sg``, in order; fails naming the elements no saved subgroup holds."""
        lo, hi = sg.offset, sg.offset + sg.numel
        at = lo
        for piece in self.pieces.get(sg.block, []):
            start, end = max(lo, piece.offset), min(hi, piece.offset + piece.numel)
            if start >= end:
                continue
            if start != at:
                break
            yield piece, start - piece.offset, start - lo, end - start
            at = end
        if at != hi:
            raise CheckpointError(
                f"the checkpoint holds no state for elements [{at}, {hi}) of block {sg.block}: it was written for "
                "another model or is incomplete"
            )

    def file(self, piece: SavedPiece, kind: str) -> Path | None:
        return self._files[piece.part].get((kind, piece.key))

    def assemble_quantized(self, sg: Subgroup, kind: str) -> torch.Tensor | None:
        """``sg``'s 8-bit ``kind`` state (update/quant8.py) as the bytes of its state file: each element's code and
        each 2048-element block's absmax, from the saved subgroups. Subgroups start on 2048-element boundaries of
        their block, so every quantization block lies whole in one saved subgroup and one of this layout."""
        pieces = list(self.covering(sg))
        files = [self.file(piece, kind) for piece, _, _, _ in pieces]
        if all(f is None for f in files):
            return None
        out = torch.zeros(align_up(quant8.payload(sg.numel, quant8.INT8)), dtype=torch.uint8)
        codes, scales = quant8.split(out, sg.numel)
        scale_bytes = scales.view(torch.uint8)
        for (piece, first, into, count), path in zip(pieces, files, strict=True):
            if path is None:
                raise CheckpointError(f"the checkpoint holds no {kind} file for saved subgroup {piece.key} of rank "
                                      f"{piece.part}, though other subgroups have one")  # fmt: skip
            blocks = quant8.blocks(count)
            with path.open("rb") as f:
                f.seek(first)
                got_codes = f.read(count)
                f.seek(quant8.codes_bytes(piece.numel) + 4 * (first // quant8.BLOCK))
                got_scales = f.read(4 * blocks)
            if len(got_codes) != count or len(got_scales) != 4 * blocks:
                raise CheckpointError(f"{path} is shorter than its subgroup")
            codes[into : into + count] = torch.frombuffer(bytearray(got_codes), dtype=torch.uint8)
            at = 4 * (into // quant8.BLOCK)
            scale_bytes[at : at + 4 * blocks] = torch.frombuffer(bytearray(got_scales), dtype=torch.uint8)
        return out

    def assemble(self, sg: Subgroup, kind: str) -> torch.Tensor | None:
        """``sg``'s ``kind`` state as the bytes of a state file (padded to the 4 KiB alignment files have), or None
        where no saved rank has that kind yet (a checkpoint from before the first step has masters only)."""
        pieces = list(self.covering(sg))
        files = [self.file(piece, kind) for piece, _, _, _ in pieces]
        if all(f is None for f in files):
            return None
        width = self.element_bytes
        out = torch.zeros(align_up(sg.numel * width), dtype=torch.uint8)
        for (piece, first, into, count), path in zip(pieces, files, strict=True):
            if path is None:
                raise CheckpointError(f"the checkpoint holds no {kind} file for saved subgroup {piece.key} of rank "
                                      f"{piece.part}, though other subgroups have one")  # fmt: skip
            with path.open("rb") as f:
                f.seek(first * width)
                data = f.read(count * width)
            if len(data) != count * width:
                raise CheckpointError(f"{path} is shorter than its subgroup")
            out[into * width : (into + count) * width] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    def residuals(self, name: str, sg: Subgroup, like: torch.Tensor, saved: list[dict[str, Any]]) -> torch.Tensor:
        """``sg``'s slice of the top-k residual table ``name`` (``residual`` or ``squares``), from every saved
        rank's table (``saved``, memory-mapped), in ``like``'s dtype."""
        out = torch.zeros(sg.numel, dtype=like.dtype)
        for piece, first, into, count in self.covering(sg):
            table = saved[piece.part].get(name, {})
            if piece.index not in table:
                raise CheckpointError(f"the checkpoint's error-feedback {name} lack saved subgroup {piece.key} of "
                                      f"rank {piece.part}: another compression setting")  # fmt: skip
            out[into : into + count] = table[piece.index][first : first + count]
        return out

