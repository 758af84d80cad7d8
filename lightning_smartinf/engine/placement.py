"""What of the offloaded state lives in host memory instead of on storage, within ``offload.host_memory_budget``.

GreedySnake keeps in RAM whatever fits a budget, by value per byte. The fp32 gradients come first: kept on disk
they cross it twice per step (written in backward, read by the step), 8 B/param for 4 B/param of memory. Then the
subgroups' master and optimizer state (Adam: 12 B/param of memory, 24 B/param of disk traffic per step saved),
first subgroups first: the overlapped step updates in forward order, so the blocks the next forward needs first
get the fastest updates. Whatever does not fit stays on storage; a budget of 0 keeps everything there.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_smartinf.core import Layout
from lightning_smartinf.storage.space import human_bytes


@dataclass(frozen=True)
class HostPlacement:
    budget: int
    grads: bool
    """The fp32 gradients accumulate in host memory (as ``offload.grads=cpu``)."""
    state: frozenset[str]
    """Subgroups (by key) whose master and optimizer state live in host memory."""
    nbytes: int
    """Host memory the placement takes."""

    def describe(self, layout: Layout) -> str:
        total = max(len(layout.subgroups), 1)
        return (f"host memory budget {human_bytes(self.budget)}: gradients in {'RAM' if self.grads else 'storage'}, "
                f"master and optimizer state of {len(self.state)} of {total} subgroups in RAM; "
                f"{human_bytes(self.nbytes)} placed")  # fmt: skip


def place(budget: int, layout: Layout, state_kinds: int, grads_in_ram: bool, host_update: bool) -> HostPlacement:
    """Fill ``budget`` bytes: gradients (unless already in RAM), then whole subgroups' state (``1 + state_kinds``
    fp32 tensors each; only for the host update, whose state is the host's to keep)."""
    grad_bytes = 4 * layout.local_numel
    left, grads, used = budget, False, 0
    if not grads_in_ram and grad_bytes <= left:
        grads, left, used = True, left - grad_bytes, grad_bytes
    state: set[str] = set()
    if host_update:
        for sg in layout.subgroups:
            nbytes = 4 * sg.numel * (1 + state_kinds)
            if nbytes > left:
                break
            state.add(sg.key)
            left, used = left - nbytes, used + nbytes
    return HostPlacement(budget, grads, frozenset(state), used)
