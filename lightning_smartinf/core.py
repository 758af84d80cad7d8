"""The data every layer shares: the layout of the flat buffers, the step's context, and the names of state
kinds and links. The bottom of the package: it imports nothing of it (docs/architecture.md), so storage, the
updaters, the compressor, the schedules and the checkpoint code can all speak in these types without importing
the engine.

The layout: a *block* is a unit that is streamed (one transformer layer, say); parameters outside every block form
the *resident* block (embeddings, final norm, head). Each block is one flat buffer cut into *subgroups*, the unit of
the optimizer step and of every state file (``engine/layout.py`` builds it from a model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

MASTER: Final = "master"
"""The state kind of a subgroup's fp32 master copy (optimizer moments take their rule's names: ``exp_avg``...)."""
PARAM: Final = "param"
"""The state kind of a subgroup's 16-bit parameter copy."""
FROZEN: Final = "frozen"
"""The state kind of a streamed block's frozen parameters (``requires_grad=False``), stored once in their own dtype
and only read: no master, no optimizer state, no gradient, no write-back."""
GRAD: Final = "grad"
"""The state kind of a subgroup's accumulated fp32 gradient."""
HOST_LINK: Final = "host"
"""The link between host memory and the host's storage (the one ZeRO-Infinity saturates)."""


def device_link(index: int) -> str:
    """The link between near-storage device ``index`` and its own storage (``device0``, ``device1``, ...)."""
    return f"device{index}"


ELEMENT_ALIGN = 2048


def round_up(n: int, multiple: int = ELEMENT_ALIGN) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class ParamSlot:
    """One parameter's place in its block's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype
    """The parameter's dtype in the user's module (the engine computes in the training precision's)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter in its own dtype."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Subgroup:
    """A contiguous range of one block's flat buffer, all in one optimizer param group and one state precision."""

    index: int
    block: int
    param_group: int
    offset: int
    numel: int
    precision: str = "fp32"
    """Of its optimizer state: ``fp32``, or ``8bit`` (block-wise quantized, update/quant8.py)."""

    @property
    def key(self) -> str:
        return f"sg{self.index:06d}"


@dataclass
class Block:
    index: int
    name: str
    module: nn.Module | None
    resident: bool
    numel: int = 0
    slots: list[ParamSlot] = field(default_factory=list)
    subgroups: list[Subgroup] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(s.numel for s in self.slots)


@dataclass
class Layout:
    blocks: list[Block]
    subgroups: list[Subgroup]
    rank: int = 0
    world: int = 1
    fp32_state: list[str] | None = None
    """With 8-bit optimizer state: the parameters that keep fp32 state (None: every parameter's state is fp32)."""

    def chunk(self, block: Block) -> tuple[int, int]:
        """The [start, end) of ``block``'s flat buffer that this rank owns."""
        size = block.numel // self.world
        return self.rank * size, (self.rank + 1) * size

    @property
    def num_params(self) -> int:
        return sum(b.params for b in self.blocks)

    @property
    def local_numel(self) -> int:
        """Elements this rank updates (all parameters with one rank)."""
        return sum(sg.numel for sg in self.subgroups)

    @property
    def max_subgroup_numel(self) -> int:
        return max((sg.numel for sg in self.subgroups), default=ELEMENT_ALIGN)

    @property
    def max_block_numel(self) -> int:
        return max(b.numel for b in self.blocks if not b.resident)

    @property
    def streamed(self) -> list[Block]:
        return [b for b in self.blocks if not b.resident]

    @property
    def streamed_subgroups(self) -> list[Subgroup]:
        """This rank's subgroups of the streamed blocks, in forward order (the resident block's stay in RAM)."""
        return [sg for sg in self.subgroups if not self.blocks[sg.block].resident]

    @property
    def resident(self) -> Block:
        return self.blocks[0]


def block_pairs(layout: Layout, frozen: Layout) -> list[tuple[Block, Block]]:
    """Each block of ``layout`` with its twin in the ``frozen`` layout (same index: the same module)."""
    return list(zip(layout.blocks, frozen.blocks, strict=True))


def owned_slots(layout: Layout, frozen: Layout) -> list[ParamSlot]:
    """Every parameter an engine owns, block by block: the trainable ones, then the block's frozen ones."""
    return [slot for block, fixed in block_pairs(layout, frozen) for slot in block.slots + fixed.slots]


@dataclass
class StepContext:
    """What one optimizer step needs besides the gradients."""

    step: int
    """The optimizer step being taken, counting from 1 (skipped steps do not count)."""
    hyper: list[dict[str, Any]]
    """Per param group hyper-parameters, read from the torch optimizer now (LR schedulers apply)."""
    inv_scale: float = 1.0
    """1/loss_scale as fp32, applied to every gradient first (GradScaler's unscale)."""
    clip_coef: float = 1.0
    """Clip coefficient as fp32, applied next (clip_grad_norm_'s multiply)."""

    def prepare(self, grad: torch.Tensor) -> None:
        """Unscale and clip a gradient in place, in the order and precision torch uses."""
        for coef in (self.inv_scale, self.clip_coef):
            if coef != 1.0:
                grad.mul_(coef)
