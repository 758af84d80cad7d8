"""The messages between the trainer and a near-storage device's transfer handler (update/smart.py): jobs in,
updated parameters and the step's end out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_smartinf.compress.topk import SparseGradient
from lightning_smartinf.core import StepContext, Subgroup


@dataclass(frozen=True)
class SentGradient:
    """The subgroup's gradient from host memory, sent over the host link with the job (in the wire dtype)."""

    values: torch.Tensor


@dataclass(frozen=True)
class StoredGradient:
    """The gradient already sits in the device's own directory (written during backward): read over its link."""


@dataclass(frozen=True)
class NoGradient:
    """No gradient reached the subgroup since the last step: it steps with zeros."""


Gradient = SentGradient | StoredGradient | NoGradient | SparseGradient
"""How a job's gradient reaches the device (SparseGradient: SmartComp's top-k, scattered on the device)."""


@dataclass(frozen=True)
class Job:
    """Update one subgroup: its gradient, the step's context and the kernel's scalars for its param group."""

    sg: Subgroup
    gradient: Gradient
    ctx: StepContext
    scalars: list[Any]


@dataclass(frozen=True)
class EndOfStep:
    """No more jobs this step: finish the one in flight, then say ``StepFinished``."""


@dataclass(frozen=True)
class Stop:
    """``close``: the transfer handler ends."""


@dataclass(frozen=True)
class Updated:
    """A subgroup's new parameters (in the wire dtype), sent back over the host link."""

    sg: Subgroup
    params: torch.Tensor


@dataclass(frozen=True)
class StepFinished:
    device: int


@dataclass(frozen=True)
class Failed:
    device: int
    error: BaseException


Inbound = Job | EndOfStep | Stop
Outbound = Updated | StepFinished | Failed
