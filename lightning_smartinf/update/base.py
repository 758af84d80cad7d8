"""The updater seam: takes each subgroup's gradient, gives back its updated fp32 master.

The engine streams subgroups through ``Updater.step`` and never sees where the optimizer state lives: the host
updater reads and writes it through the storage layer itself; a near-storage updater would keep it on the device
that owns the subgroup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from lightning_smartinf.core import StepContext, Subgroup


class GradientSource(Protocol):
    """Hands out each subgroup's accumulated fp32 gradient; ``fetch`` may be called ahead of use."""

    def fetch(self, sg: Subgroup) -> Future[torch.Tensor]: ...

    def release(self, sg: Subgroup) -> None: ...

    def sync(self) -> None:
        """Wait until every accumulated gradient is stored."""
        ...

    def holds(self, sg: Subgroup) -> bool:
        """Whether any gradient reached ``sg`` since the last step (else it steps with zeros)."""
        ...


class Updater(Protocol):
    name: str

    def initialize(self, subgroups: Sequence[Subgroup], master_of: Callable[[Subgroup], torch.Tensor]) -> None:
        """Write each subgroup's initial fp32 master (its optimizer state starts lazily at the first step)."""
        ...

    def step(
        self, subgroups: Iterable[Subgroup], grads: GradientSource, ctx: StepContext
    ) -> Iterator[tuple[Subgroup, torch.Tensor]]:
        """Update every subgroup; yield each one's new fp32 master, valid until the next item is requested."""
        ...

    def state_directories(self) -> list[Path]:
        """Directories holding master and optimizer-state files (one per device for near-storage updaters)."""
        ...

    def read_master(self, sg: Subgroup) -> torch.Tensor:
        """A copy of one subgroup's fp32 master (for export and tests; not on the hot path)."""
        ...

    def close(self) -> None: ...
