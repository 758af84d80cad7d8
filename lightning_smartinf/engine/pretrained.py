"""Pretrained weights read tensor by tensor from safetensors: one file, or a Hugging Face style directory.

``init_from`` names a ``.safetensors`` file, or a directory holding ``model.safetensors`` or a sharded
``model.safetensors.index.json`` with its shards (what ``save_pretrained`` writes). Everything is checked before any
state is written, from the files' headers alone: every shard exists and is as long as its header says (a truncated
download is caught here), every parameter of the module has a tensor, no tensor is left over, shapes match, and
dtypes match or widen losslessly (a bf16 checkpoint into fp32 master weights). Names are mapped by the one prefix
that makes the file's names the module's (``model.layers.0...`` in the file, ``model.model.layers.0...`` in a
LightningModule holding the HF model as ``self.model``); a tied weight saved under either of its names serves both.
Values are then read one tensor at a time (memory-mapped), as each block is materialized.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from lightning_smartinf.checkpoint.shards import INDEX, SINGLE
from lightning_smartinf.ecosystem.adapters import adapter_parameters, checkpoint_name
from lightning_smartinf.errors import ConfigError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}  # fmt: skip
WIDENS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
          (torch.bfloat16, torch.float64), (torch.float32, torch.float64)}  # fmt: skip


class PretrainedError(ConfigError):
    """A pretrained file or directory that cannot initialize this module; the message names file and tensor."""


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors a safetensors file declares, checked against the file's length."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        size = path.stat().st_size
    except FileNotFoundError as err:
        raise PretrainedError(f"init_from: {path} does not exist") from err
    except (OSError, struct.error, ValueError) as err:
        raise PretrainedError(f"init_from: {path} is not a readable safetensors file ({err})") from err
    entries: dict[str, Entry] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise PretrainedError(f"init_from: {path} holds {name} as {info['dtype']}, which is not supported")
        entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]))
        end = max(end, info["data_offsets"][1])
    if size < 8 + length + end:
        raise PretrainedError(
            f"init_from: {path} is truncated: {size} bytes, its header describes {8 + length + end} "
            "(an interrupted download or copy?)"
        )
    return entries


def shard_files(path: Path) -> list[Path]:
    """The safetensors files ``init_from=path`` names (see the module docstring)."""
    if not path.exists():
        raise PretrainedError(f"init_from={path} does not exist: give a .safetensors file or a directory from "
                              "save_pretrained")  # fmt: skip
    if path.is_file():
        return [path]
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise PretrainedError(f"init_from: {path / INDEX} is not a valid index ({err})") from err
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise PretrainedError(f"init_from: {path / INDEX} lists shard {missing[0]}, which is not in {path}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))  # fmt: skip
        return [path / f for f in files]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise PretrainedError(f"init_from: {path} holds neither {SINGLE} nor {INDEX}")


def name_prefix(file_names: set[str], module_names: set[str]) -> str:
    """The prefix that turns the most file names into module names ('' when they already are)."""
    votes: Counter[str] = Counter()
    for f in file_names:
        for m in module_names:
            if m.endswith(f) and (len(m) == len(f) or m[len(m) - len(f) - 1] == "."):
                votes[m[: len(m) - len(f)]] += 1
    return votes.most_common(1)[0][0] if votes else ""


class PretrainedSource:
    """Initial values for a module's parameters and buffers from safetensors (see the module docstring)."""

    def __init__(self, path: str | Path, model: nn.Module) -> None:
        self.path = Path(path).expanduser()
        entries: dict[str, Entry] = {}
        for file in shard_files(self.path):
            for name, entry in read_header(file).items():
                if name in entries:
                    raise PretrainedError(f"init_from: {name} is in both {entries[name].file} and {file}")
                entries[name] = entry
        # every name of every parameter (tied weights have several) and of every persistent buffer
        names: dict[str, list[str]] = {}
        first: dict[int, str] = {}
        adapters = adapter_parameters(model)
        self.adapters: dict[str, tuple[nn.Module, str]] = {}
        """PEFT adapter parameters (by module name): no pretrained directory holds them; they take PEFT's init."""
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in adapters:
                self.adapters.setdefault(name, adapters[id(p)])
                continue
            names.setdefault(first.setdefault(id(p), name), []).append(name)
        buffers = {n for n, _ in model.named_buffers()} & set(model.state_dict())
        # a PEFT-wrapped base weight (``q_proj.base_layer.weight``) is looked up by its checkpoint name
        every = {checkpoint_name(alias) for aliases in names.values() for alias in aliases} | buffers
        self.prefix = name_prefix(set(entries), every)
        self.source: dict[str, str] = {}
        """Module name (the first name of a parameter; a buffer's name) -> file tensor name."""
        by_module = {self.prefix + n: n for n in entries}
        unexpected = [n for n in entries if self.prefix + n not in every]
        if unexpected:
            raise PretrainedError(
                f"init_from: {entries[unexpected[0]].file} holds {unexpected[0]}, which is no parameter or buffer of "
                f"{type(model).__name__}" + (f" under the prefix {self.prefix!r}" if self.prefix else "")
                + (f" ({len(unexpected) - 1} more such)" if len(unexpected) > 1 else "")
            )  # fmt: skip
        shapes = {**{n: p for n, p in model.named_parameters()}, **dict(model.named_buffers())}
        for name, aliases in names.items():
            found = next((by_module[checkpoint_name(a)] for a in aliases if checkpoint_name(a) in by_module), None)
            if found is None:
                raise PretrainedError(f"init_from: {self.path} has no tensor for parameter {name} (looked for "
                                      f"{checkpoint_name(name).removeprefix(self.prefix)!r})")  # fmt: skip
            self.source[name] = found
        for name in buffers:
            if name in by_module:
                self.source[name] = by_module[name]
        for name, tensor_name in self.source.items():
            entry, target = entries[tensor_name], shapes[name]
            if entry.shape != tuple(target.shape):
                raise PretrainedError(f"init_from: {tensor_name} in {entry.file} has shape {list(entry.shape)}, "
                                      f"{name} needs {list(target.shape)}")  # fmt: skip
            if entry.dtype != target.dtype and (entry.dtype, target.dtype) not in WIDENS:
                raise PretrainedError(
                    f"init_from: {tensor_name} in {entry.file} is {entry.dtype}, {name} is {target.dtype}, and that "
                    "conversion would lose precision: build the module in the file's dtype or convert the file"
                )
        self.entries = entries

    def fill(self, name: str, target: torch.Tensor) -> None:
        """Copy the file's tensor for ``name`` (a module name) into ``target``."""
        tensor_name = self.source[name]
        entry = self.entries[tensor_name]
        with safe_open(str(entry.file), framework="pt") as f, torch.no_grad():
            target.copy_(f.get_tensor(tensor_name))

    def fill_buffers(self, model: nn.Module) -> None:
        """Persistent buffers the file holds (position ids, masks saved by the library) into the module."""
        for name, buffer in model.named_buffers():
            if name in self.source:
                self.fill(name, buffer)
