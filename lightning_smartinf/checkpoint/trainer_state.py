"""Lightning's part of a checkpoint (loops, callbacks, hyper-parameters, buffers) as data that cannot run code.

A checkpoint may come from elsewhere, and its manifest's SHA-256 sums prove integrity, not origin: whoever crafts
the file writes the manifest too. So the trainer state is reduced to plain data when saved (dicts, lists, tuples,
strings, numbers, tensors) and read back with ``torch.load(weights_only=True)``, whose unpickler builds only those
types and refuses any other global, such as the ``os.system`` a crafted ``__reduce__`` names, before calling it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import logging
import os
from collections import OrderedDict
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from lightning_smartinf.checkpoint.manifest import CheckpointError

log = logging.getLogger(__name__)

PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)
"""Leaf types ``torch.load(weights_only=True)`` builds without any allowlist."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickled object that loading would have to construct by calling its code."""


def plain(value: Any, where: str = "checkpoint") -> Any:
    """``value`` with every object turned into plain data: dataclasses, ``AttributeDict`` and OmegaConf containers
    into dicts, paths into strings, enums into their values, numpy into tensors or numbers. An object with no plain
    form is kept as its ``repr`` (logged with its key), so a save never fails over a hyper-parameter."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, OrderedDict):
        return OrderedDict((k, plain(v, f"{where}.{k}")) for k, v in value.items())
    if isinstance(value, dict):
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, tuple):  # named tuples too: their fields, in order
        return tuple(plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, (list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(items)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value, where)
    if isinstance(value, (PurePath, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    container = _omegaconf_container(value)
    if container is not None:
        return plain(container, where)
    log.warning("smart_infinity: %s (%s) has no plain-data form; the checkpoint keeps its repr",
                where, type(value).__qualname__)  # fmt: skip
    return repr(value)


def _omegaconf_container(value: Any) -> Any:
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover - hydra-core brings omegaconf
        return None
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else None


def dumps(checkpoint: dict[str, Any]) -> bytes:
    """The trainer state as the bytes of a ``torch.save`` file that ``load`` reads with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(plain(checkpoint), buffer)
    return buffer.getvalue()


LEGACY_TYPES: list[Any] = []
"""Types that trainer states of earlier versions pickled (the shipped GPT's config, a dataclass rebuilt from its
fields, which runs no code): ``load`` lets torch rebuild them while it reads a trainer state, and nowhere else.
Registered by the module that defines them (``allow_legacy``)."""


def allow_legacy(cls: type) -> None:
    """Let ``load`` rebuild ``cls`` where an earlier version's trainer state pickled it."""
    if cls not in LEGACY_TYPES:
        LEGACY_TYPES.append(cls)


def _torch_load(path: Path) -> Any:
    scoped = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; before it, process-wide
    if scoped is None:
        torch.serialization.add_safe_globals(LEGACY_TYPES)
        return torch.load(path, map_location="cpu", weights_only=True)
    with scoped(LEGACY_TYPES):
        return torch.load(path, map_location="cpu", weights_only=True)


def load(path: Path) -> dict[str, Any]:
    """Read a trainer state written by ``dumps`` (or by earlier versions, whose only objects were ``LEGACY_TYPES``).
    Anything else is refused, unrun, with one line."""
    try:
        state = _torch_load(path)
    except Exception as err:  # the unpickler raises UnpicklingError, or RuntimeError wrapping it
        if "weights_only" not in str(err) and "Weights only" not in str(err):
            raise CheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}") from err
        raise UnsafeCheckpointError(
            f"{path} holds a pickled object that loading would have to run as code ({_culprit(err)}): refused. "
            "A checkpoint saved by lightning-smartinf holds plain data only; if you trust this file and that type, "
            "allow it with torch.serialization.add_safe_globals([...]) before loading"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not Lightning's checkpoint dict")
    return state


def _culprit(err: Exception) -> str:
    """The global the unpickler refused (``GLOBAL posix.system``), from torch's message."""
    for line in str(err).splitlines():
        line = line.strip()
        if "GLOBAL" in line or line.startswith("Unsupported"):
            return line.rstrip(".").split(" was not an allowed global")[0][:200]
    return "a global outside the allowlist"
