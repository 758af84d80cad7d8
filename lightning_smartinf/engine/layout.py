"""How the model's parameters map onto blocks, flat buffers and subgroups.

A *block* is a unit that is streamed: one transformer layer, say. Parameters outside every block form the
*resident* block (embeddings, final norm, head), which stays on the training device. Each block is one flat
buffer; its parameters sit in optimizer-param-group order, each group's region starting on a 2048-element
boundary. Every region is cut into *subgroups* of at most ``subgroup_size`` elements, again on 2048-element
boundaries, so every subgroup starts 4096-byte aligned in a 16-bit or fp32 buffer and can be read with O_DIRECT
straight into its place. A subgroup is the unit of the optimizer step and of every state file.

With 8-bit optimizer state, a group's region is two: first the parameters whose state is quantized, then those that
keep fp32 state (small tensors, embeddings: ``eight_bit_params``), each on its own 2048-element boundary, so every
subgroup has one state precision and no quantization block spans the two.

Data parallel (``world`` ranks): each block's buffer is padded to ``world`` equal, aligned chunks and rank ``r``
owns chunk ``r`` of every block (ZeRO-Infinity's bandwidth-centric partitioning: every block is read from all ranks'
disks at once). A rank's subgroups cut only its own chunk; every rank keeps the whole-block offsets, so a block's
16-bit params are one all-gather of the chunks and its gradient one reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from lightning_smartinf.core import ELEMENT_ALIGN, Block, Layout, ParamSlot, Subgroup, round_up
from lightning_smartinf.errors import ConfigError


def build_layout(
    model: nn.Module,
    block_modules: Sequence[tuple[str, nn.Module]],
    param_groups: Sequence[Sequence[nn.Parameter]],
    subgroup_size: int,
    rank: int = 0,
    world: int = 1,
    frozen: bool = False,
    eight_bit: Collection[int] | None = None,
) -> Layout:
    """Place every trainable parameter of ``model`` into a block, a flat offset and (on rank ``rank`` of ``world``)
    a subgroup.

    ``param_groups`` lists the optimizer's parameters per group; every trainable parameter must be in exactly one.
    Frozen parameters (``requires_grad=False``) are left out: they get no optimizer state and no gradient traffic
    (and an optimizer that lists them does not step them, as torch skips a parameter without a gradient). A
    parameter used by several blocks is resident, so that it is one tensor for all of them.

    ``frozen=True`` lays out the frozen parameters of the streamed blocks instead (``param_groups``: one group of
    them), which stream read-only beside the trainable ones; the resident block is then empty (frozen parameters
    outside the blocks stay in the module, on the training device).

    ``eight_bit``: with 8-bit optimizer state, the ids of the parameters whose state is quantized
    (``eight_bit_params``); the others' stays fp32 (None: every parameter's state is fp32).
    """
    quantized = eight_bit if eight_bit is not None else frozenset()
    group_of: dict[int, int] = {}
    for gi, group in enumerate(param_groups):
        for p in group:
            if id(p) in group_of:
                raise ConfigError("a parameter appears in two optimizer param groups")
            group_of[id(p)] = gi
    names = {id(p): n for n, p in model.named_parameters()}
    for pid in group_of:
        if pid not in names:
            raise ConfigError("the optimizer holds a parameter that is not in the LightningModule")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing and not frozen:
        raise ConfigError(
            f"parameters {missing[:5]}{'...' if len(missing) > 5 else ''} require gradients but are not in the "
            "optimizer: pass them to the optimizer, or freeze them with requires_grad_(False) before fit"
        )

    def trainable(module: nn.Module, prefix: str) -> list[nn.Parameter]:
        """The parameters this layout places: the trainable ones (or, with ``frozen``, the frozen ones)."""
        return [p for _, p in module.named_parameters(prefix=prefix) if p.requires_grad != frozen]

    users: dict[int, int] = {}
    for name, module in block_modules:
        for p in trainable(module, name):
            users[id(p)] = users.get(id(p), 0) + 1
    in_block: set[int] = set()
    blocks = [Block(0, "resident", None, resident=True)]
    for name, module in block_modules:
        block = Block(len(blocks), name, module, resident=False)
        for p in trainable(module, name):
            if users[id(p)] == 1:
                in_block.add(id(p))
                block.slots.append(ParamSlot(names[id(p)], p, 0, p.numel(), p.shape, p.dtype))
        blocks.append(block)
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in in_block and not frozen:
            blocks[0].slots.append(ParamSlot(name, p, 0, p.numel(), p.shape, p.dtype))

    rounded = round_up(subgroup_size)
    subgroups: list[Subgroup] = []
    for block in blocks:
        offset = 0
        regions: list[tuple[int, str, int, int]] = []
        for gi in range(len(param_groups)):
            in_group = [s for s in block.slots if group_of[id(s.param)] == gi]
            for precision in ("8bit", "fp32"):
                region = [s for s in in_group if (id(s.param) in quantized) == (precision == "8bit")]
                if not region:
                    continue
                start = offset
                for slot in region:
                    slot.offset = offset
                    offset += slot.numel
                regions.append((gi, precision, start, offset))
                offset = round_up(offset)
        block.slots.sort(key=lambda s: s.offset)
        block.numel = round_up(offset, ELEMENT_ALIGN * world) if block.slots else 0
        size = block.numel // world
        lo, hi = rank * size, (rank + 1) * size
        for gi, precision, start, end in regions:
            for sg_start in range(max(start, lo), min(end, hi), rounded):
                numel = min(rounded, min(end, hi) - sg_start)
                sg = Subgroup(len(subgroups), block.index, gi, sg_start, numel, precision)
                subgroups.append(sg)
                block.subgroups.append(sg)
    fp32_state = None
    if eight_bit is not None:
        fp32_state = [s.name for b in blocks for s in b.slots if id(s.param) not in quantized]
    return Layout(blocks, subgroups, rank, world, fp32_state)


def eight_bit_params(model: nn.Module, min_size: int, embeddings_fp32: bool) -> frozenset[int]:
    """The ids of the trainable parameters whose optimizer state ``offload.state_precision=8bit`` quantizes: those of
    at least ``min_size`` elements (``offload.min_8bit_size``), less the weights of ``nn.Embedding`` modules where
    ``embeddings_fp32`` (``offload.fp32_embedding_state``), as bitsandbytes does."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if embeddings_fp32 else set()
    return frozenset(id(p) for p in model.parameters()
                     if p.requires_grad and p.numel() >= min_size and id(p) not in embeddings)  # fmt: skip
