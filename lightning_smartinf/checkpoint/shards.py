"""Safetensors written tensor by tensor: the header is planned from names, dtypes and shapes alone, then each
tensor's bytes are appended as it is produced, so memory holds one tensor whatever the model's size.

``write_sharded`` splits the tensors into files of at most ``max_shard_bytes`` the way Hugging Face's
``save_pretrained`` names them (``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... with
``model.safetensors.index.json``), so ``from_pretrained`` and this project's ``init_from`` read the result. Every file
is written under a ``.partial`` name and renamed once complete: an interrupted export leaves nothing that loads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_smartinf.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
"""The file names of ``save_pretrained``'s layout (sharded with an index, or one file)."""

CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL"}  # fmt: skip


@dataclass(frozen=True)
class Planned:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def _header(entries: list[Planned], metadata: dict[str, str]) -> bytes:
    offset, header = 0, {}
    for e in entries:
        header[e.name] = {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def shard_plan(entries: list[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    """Consecutive entries grouped into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_sharded(
    out: Path, entries: list[Planned], tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
    metadata: dict[str, str],
) -> list[Path]:  # fmt: skip
    """Write ``tensors`` (in ``entries``' order, each converted to its planned dtype) under directory ``out``;
    returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(entries, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                              for i in range(len(shards))]  # fmt: skip
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    written: list[Path] = []
    for name, shard in zip(names, shards, strict=True):
        written.append(write_file(out / name, shard, stream, metadata))
    if next(stream, None) is not None:
        raise ValueError("more tensors than planned for the export")
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: n for n, shard in zip(names, shards, strict=True) for e in shard}}  # fmt: skip
        _atomic_text(out / INDEX, json.dumps(index, indent=2))
    return written


def write_file(
    path: Path, entries: list[Planned], tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]
) -> Path:
    """One safetensors file holding ``entries``, taking their tensors from ``tensors`` in order."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("wb") as f:
        f.write(_header(entries, metadata))
        for e in entries:
            name, tensor = next(tensors)
            if name != e.name or tuple(tensor.shape) != e.shape:
                raise ValueError(f"export: got {name} {list(tensor.shape)} where {e.name} {list(e.shape)} was planned")
            data = tensor.detach().to(device="cpu", dtype=e.dtype).contiguous()
            f.write(data.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    return path


def _atomic_text(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def parse_size(text: str | int) -> int:
    """``"2GB"``, ``"500MB"``, ``"40KB"`` or a byte count."""
    if isinstance(text, int):
        return text
    units: dict[str, Callable[[float], float]] = {"KB": lambda n: n * 1e3, "MB": lambda n: n * 1e6,
                                                   "GB": lambda n: n * 1e9, "B": lambda n: n}  # fmt: skip
    try:
        for unit, scale in units.items():
            if text.upper().endswith(unit):
                return int(scale(float(text[: -len(unit)])))
        return int(text)
    except ValueError:
        raise ConfigError(f"max shard size {text!r} is not a size: give bytes or a number with KB, MB or GB") from None
