"""What of the offloaded state lives in host memory instead of on storage, within ``offload.host_memory_budget``.

GreedySnake keeps in RAM whatever fits a budget, by value per byte. The 16-bit parameters come first: kept on disk
they are read by every forward and backward (per micro-batch horizontally) and written by every step, at least 3 B of
disk traffic saved per byte of memory, and the next forward finds each block's update where the step left it instead
of waiting for it to go to disk and back. Then the fp32 gradients: kept on disk they cross it twice per step
(written in backward, read by the step), 8 B/param for 4 B/param of memory. Then the subgroups' master and
optimizer state (Adam: 12 B/param of memory, 24 B/param of disk traffic per step saved), first subgroups first: the
overlapped step updates in forward order, so the blocks the next forward needs first get the fastest updates. Then
the streamed blocks' frozen weights (a LoRA base), first blocks first: read twice per iteration or more (forward and
backward, per micro-batch horizontally), never written, in their own dtype: at least the same disk bytes saved per
byte of memory. Whatever does not fit stays on storage; a budget of 0 keeps everything there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_smartinf.core import Layout, Subgroup
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
    frozen: frozenset[str] = frozenset()
    """Frozen-weight subgroups (by key, in the frozen layout) held in host memory."""
    params: frozenset[str] = frozenset()
    """Subgroups (by key) whose 16-bit parameters live in host memory."""

    def describe(self, layout: Layout, frozen_layout: Layout | None = None) -> str:
        if not self.nbytes:
            return f"host memory budget {human_bytes(self.budget)}: everything on storage"
        total = max(len(layout.subgroups), 1)
        text = (f"host memory budget {human_bytes(self.budget)}: 16-bit parameters of {len(self.params)} of "
                f"{len(layout.streamed_subgroups)} streamed subgroups, gradients in "
                f"{'RAM' if self.grads else 'storage'}, master and optimizer state of {len(self.state)} of {total} "
                f"subgroups in RAM")  # fmt: skip
        if frozen_layout is not None and frozen_layout.subgroups:
            text += f", frozen weights of {len(self.frozen)} of {len(frozen_layout.subgroups)} subgroups in RAM"
        return f"{text}; {human_bytes(self.nbytes)} placed"


def auto_budget(available: int, ranks: int, reserved: int) -> int:
    """``auto``: half of this rank's share of the ``available`` host memory, less the ``reserved`` bytes the engine
    holds whatever the budget (its pools, resident set and set-up's working set). The other half is left to what
    set-up cannot see: activations, the data pipeline, the page cache, the rest of the process."""
    return max(0, available // (2 * ranks) - reserved)


def place(budget: int, layout: Layout, state_bytes: Callable[[Subgroup], float], grads: bool, state: bool,
          frozen: Layout | None = None, frozen_itemsize: int = 0,
          params_itemsize: int = 0) -> HostPlacement:  # fmt: skip
    """Fill ``budget`` bytes: whole subgroups' 16-bit parameters (``params_itemsize`` bytes an element; 0: they are
    not the budget's to place), then the fp32 gradients (where ``grads``: they would otherwise go to storage), then
    whole subgroups' state (``state_bytes(sg)`` an element: the fp32 master and the optimizer state, 4 bytes an
    element each, about 1 for a subgroup of 8-bit state; where ``state``: the host update's state, the
    host's to keep), then whole subgroups of the ``frozen`` layout (``frozen_itemsize`` bytes an element)."""
    params: list[str] = []
    left, in_ram, used = budget, False, 0
    if params_itemsize:
        params, used = _first_fitting(layout.streamed_subgroups, lambda _: params_itemsize, left)
        left -= used
    grad_bytes = 4 * layout.local_numel
    if grads and grad_bytes <= left:
        in_ram, left, used = True, left - grad_bytes, used + grad_bytes
    keys: list[str] = []
    if state:
        keys, taken = _first_fitting(layout.subgroups, state_bytes, left)
        left, used = left - taken, used + taken
    fixed: list[str] = []
    if frozen is not None and (len(keys) == len(layout.subgroups) or not state):  # the state first, all of it
        fixed, taken = _first_fitting(frozen.subgroups, lambda _: frozen_itemsize, left)
        used += taken
    return HostPlacement(budget, in_ram, frozenset(keys), used, frozenset(fixed), frozenset(params))


def _first_fitting(subgroups: list[Subgroup], bytes_per_element: Callable[[Subgroup], float],
                   left: int) -> tuple[list[str], int]:  # fmt: skip
    """The keys of the leading ``subgroups`` whose bytes fit in ``left`` together (up to the first that does not),
    and those bytes."""
    keys, used = [], 0
    for sg in subgroups:
        nbytes = math.ceil(bytes_per_element(sg) * sg.numel)
        if used + nbytes > left:
            break
        keys.append(sg.key)
        used += nbytes
    return keys, used
