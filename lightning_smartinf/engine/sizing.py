"""What an engine's host memory takes, sized before its parts exist, and what the host memory budget places.

``offload.host_memory_budget=auto`` is half the available memory less what the engine holds whatever the budget:
its buffer pools (their shapes are known before any is made: ``planned_pool_bytes``), the resident set and
set-up's working set. ``engine/build.py`` decides the placement from these first, then builds the stores the
placement splits between RAM and disk with their names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_smartinf.config import CompressionConfig, OffloadConfig, UpdateConfig, parse_bytes
from lightning_smartinf.core import Layout, Subgroup, block_pairs
from lightning_smartinf.engine.grads import GradientAccumulator
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.placement import HostPlacement, auto_budget, place
from lightning_smartinf.errors import HostMemoryError
from lightning_smartinf.memory import host_available_bytes
from lightning_smartinf.storage.aligned import BufferPool, align_up, allocated_bytes
from lightning_smartinf.storage.space import human_bytes
from lightning_smartinf.storage.store import stripe_of
from lightning_smartinf.update import quant8
from lightning_smartinf.update.host import HostUpdater
from lightning_smartinf.update.opencl import device_specs
from lightning_smartinf.update.optimizers import OptimizerRule
from lightning_smartinf.update.smart import SmartUpdater, wire_dtype

log = logging.getLogger(__name__)


class Sizes(Protocol):
    """What the host memory budget is sized from: ``EngineParts`` once built, ``PlannedSizes`` before."""

    rule: OptimizerRule | None
    layout: Layout
    frozen_layout: Layout
    itemsize: int
    frozen_itemsize: int

    @property
    def pool_bytes(self) -> int: ...


@dataclass
class PlannedSizes:
    """``Sizes`` before the parts are made: the pools' bytes from their shapes (``planned_pool_bytes``)."""

    rule: OptimizerRule | None
    layout: Layout
    frozen_layout: Layout
    itemsize: int
    frozen_itemsize: int
    pool_bytes: int


@dataclass(frozen=True)
class Tiers:
    """Which stores a host memory budget may split between RAM and disk."""

    params: bool
    frozen: bool
    state: bool
    grads: bool


def planned_pool_bytes(layout: Layout, frozen_layout: Layout, itemsize: int, frozen_itemsize: int,
                       rule: OptimizerRule | None, offload: OffloadConfig, update: UpdateConfig,
                       compression: CompressionConfig, param_dtype: torch.dtype) -> int:  # fmt: skip
    """``EngineParts.pool_bytes`` before any pool is made, from the shapes each part's pools will have."""
    shapes = ParamStreamer.pool_shapes(layout, itemsize, offload.prefetch)
    if frozen_itemsize:
        shapes += ParamStreamer.pool_shapes(frozen_layout, frozen_itemsize, offload.prefetch)
    shapes.append(GradientAccumulator.pool_shape(layout, offload.step_lookahead))
    if rule is not None and update.backend == "host":
        shapes += HostUpdater.pool_shapes(rule, layout.max_subgroup_numel, quant8.largest_payload(layout.subgroups),
                                          offload.step_lookahead)  # fmt: skip
    total = sum(BufferPool.planned_bytes(count, nbytes) for count, nbytes in shapes)
    total += allocated_bytes(layout.max_block_numel * 4)  # grad_flat
    if rule is not None and update.backend != "host":
        sparse = compression if compression.kind == "topk" else None
        total += SmartUpdater.planned_host_bytes(rule, len(device_specs(update.devices)), layout.max_subgroup_numel,
                                                 wire_dtype(update.wire, param_dtype), sparse,
                                                 quant8.largest_payload(layout.subgroups))  # fmt: skip
    return total


def planned_storage_bytes(
    layout: Layout, rule: OptimizerRule | None, cfg: OffloadConfig, itemsize: int, state_here: bool,
    frozen: Layout | None = None, frozen_itemsize: int = 0,
) -> list[int]:  # fmt: skip
    """Bytes the files under each directory of ``nvme_path`` take (each padded to 4 KiB); ``state_here``: master,
    state and gradients live here too (the host update), rather than in near-storage devices' directories;
    ``frozen``: the streamed blocks' frozen parameters, ``frozen_itemsize`` bytes an element, beside the 16-bit
    ones."""
    totals = [0] * len(cfg.paths)
    for sg in layout.subgroups:
        fp32 = align_up(sg.numel * 4)
        state = align_up(quant8.payload(sg.numel, sg.precision))
        total = fp32 + state * len(rule.states) if rule and state_here else 0
        total += fp32 if cfg.grads == "nvme" and state_here else 0
        streamed = not layout.blocks[sg.block].resident
        total += align_up(sg.numel * itemsize) if cfg.params == "nvme" and streamed else 0
        totals[stripe_of(sg.key, len(totals))] += total
    for sg in frozen.subgroups if frozen is not None and cfg.params == "nvme" else ():
        totals[stripe_of(sg.key, len(totals))] += align_up(sg.numel * frozen_itemsize)
    return totals


def resident_bytes(parts: Sizes, device: torch.device) -> int:
    """Host memory of the resident block: its 16-bit copy, its autograd gradients and the fp32 gradient
    gathered from them (on a GPU only the last stays on the host)."""
    numel = parts.layout.resident.numel
    return numel * (2 * parts.itemsize + 4) if device.type == "cpu" else numel * 4


def working_bytes(parts: Sizes) -> int:
    """Set-up's working set: the largest block in its own dtype (frozen parameters too)."""
    pairs = block_pairs(parts.layout, parts.frozen_layout)
    return max((sum(s.nbytes for s in b.slots + f.slots) for b, f in pairs), default=0)


def reserved_bytes(parts: Sizes, device: torch.device) -> int:
    """Host memory the engine takes whatever the budget: its buffer pools, the resident set, set-up's working
    set."""
    return parts.pool_bytes + resident_bytes(parts, device) + working_bytes(parts)


def place_in_host_memory(parts: Sizes, setting: str, ranks_per_host: int, device: torch.device, grads: bool,
                         state: bool, frozen: bool, params: bool) -> HostPlacement:  # fmt: skip
    """``offload.host_memory_budget`` (``setting``): what of the state lives in host memory (engine/placement.py);
    ``grads``, ``state``, ``frozen`` and ``params``: whether the gradients, the optimizer state, the frozen weights
    and the 16-bit parameters may go there (a subgroup's state in its own precision). ``auto`` is half the
    available memory, shared by the ``ranks_per_host`` ranks, less the engine's own."""
    if setting == "auto":
        available, reserved = host_available_bytes(), reserved_bytes(parts, device)
        budget = auto_budget(available, ranks_per_host, reserved)
        log.info("smart_infinity host memory budget auto: half of %s available%s, less the %s the engine holds "
                 "whatever the budget (pools, resident set, set-up's working set): %s", human_bytes(available),
                 f" shared by {ranks_per_host} ranks" if ranks_per_host > 1 else "", human_bytes(reserved),
                 human_bytes(budget))  # fmt: skip
    else:
        budget = parse_bytes("offload.host_memory_budget", setting)
    kinds = len(parts.rule.states) if parts.rule is not None else 0

    def state_bytes(sg: Subgroup) -> float:
        return 4 + kinds * quant8.bytes_per_element(sg.precision)

    placement = place(budget, parts.layout, state_bytes, grads, state, parts.frozen_layout if frozen else None,
                      parts.frozen_itemsize, parts.itemsize if params else 0)  # fmt: skip
    if budget:
        log.info("smart_infinity %s", placement.describe(parts.layout, parts.frozen_layout))
    return placement


def check_host_memory(parts: Sizes, device: torch.device, disk: list[int]) -> None:
    """Say what host memory and disk this run takes, and refuse before writing any state when the memory on
    top of the (already allocated) buffer pools does not fit what the host has left."""
    resident, working, pools = resident_bytes(parts, device), working_bytes(parts), parts.pool_bytes
    available = host_available_bytes()
    log.info(
        "smart_infinity host memory: buffer pools %s, resident set %s, set-up working set (the largest block in "
        "its own dtype) %s; %s available; state on disk at most %s",
        human_bytes(pools), human_bytes(resident), human_bytes(working), human_bytes(available),
        " + ".join(human_bytes(n) for n in disk),
    )  # fmt: skip
    if resident + working > available:
        raise HostMemoryError(
            f"smart_infinity needs {human_bytes(resident + working)} of host memory beyond its buffer pools "
            f"({human_bytes(pools)}, allocated): the resident set (embeddings, head, norms: "
            f"{human_bytes(resident)}) and set-up's largest block ({human_bytes(working)}), but "
            f"{human_bytes(available)} is available: stream more of the model as blocks (offload_blocks()), "
            "train in 16-bit, or free memory"
        )
