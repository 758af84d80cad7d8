"""Optimizer state in 8 bits: block-wise dynamic quantization (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2022), so a step reads and writes about 1 byte per element of each state tensor instead of 4.

Each block of ``BLOCK`` elements keeps its largest magnitude (``absmax``, fp32); each element keeps the index of the
value of a 256-entry *dynamic* map nearest to ``element / absmax``. The map spends its codes where optimizer state
lives: a run of zero bits after the sign sets a power of ten (10^0 ... 10^-6), an indicator bit ends it, and the bits
left give a linear fraction in [0.1, 1]. The signed map serves state with a sign (Adam's first moment, SGD's
momentum), the unsigned one, which spends the sign bit on one more fraction bit, state that is never negative
(Adam's second moment, Adagrad's sum). Both hold 0 and 1 exactly, so a block's largest element round-trips.

A state file of ``n`` elements holds the ``n`` codes (uint8), padded to 4 bytes, then ``ceil(n / BLOCK)`` absmax
values (fp32). ``BLOCK`` divides the 2048-element subgroup alignment, so blocks never straddle two subgroups.
"""

from __future__ import annotations

from functools import cache

import torch

BLOCK = 2048
FP32, INT8 = "fp32", "8bit"
PRECISIONS = (FP32, INT8)
UNSIGNED_KINDS = frozenset({"exp_avg_sq", "sum"})
"""State kinds that are never negative (the unsigned map); every other kind takes the signed one."""
POWERS = 7
"""Powers of ten the map spans (10^0 down to 10^-6)."""


def _fractions(bits: int) -> list[float]:
    """``2**bits`` linear steps of [0.1, 1], each the middle of its interval."""
    count = 1 << bits
    width = 0.9 / count
    return [0.1 + width * (i + 0.5) for i in range(count)]


@cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values (ascending, fp32) a code stands for, as fractions of the block's absmax."""
    fraction_bits = 6 if signed else 7  # of the 7 (8) bits after the sign, the exponent's zeros and its indicator
    magnitudes = [10.0**-zeros * f for zeros in range(POWERS) for f in _fractions(fraction_bits - zeros)]
    values = magnitudes + [-m for m in magnitudes] if signed else magnitudes
    values += [0.0, 1.0]
    if len(values) != 256:
        raise AssertionError(f"the dynamic map has {len(values)} values, not 256")
    return torch.tensor(sorted(values), dtype=torch.float32)


def is_signed(kind: str) -> bool:
    return kind not in UNSIGNED_KINDS


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def codes_bytes(numel: int) -> int:
    """Bytes of the codes, padded so the absmax values after them are 4-byte aligned."""
    return -(-numel // 4) * 4


def payload(numel: int, precision: str) -> int:
    """Bytes one state tensor of ``numel`` elements takes in ``precision``."""
    return 4 * numel if precision == FP32 else codes_bytes(numel) + 4 * blocks(numel)


def bytes_per_element(precision: str) -> float:
    """About what one element of one state tensor costs (the absmax shared by a block included)."""
    return 4.0 if precision == FP32 else 1.0 + 4.0 / BLOCK


def split(raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8) and absmax values (fp32) of a quantized state tensor held in the bytes ``raw``."""
    codes = raw[:numel]
    start = codes_bytes(numel)
    scales = raw[start : start + 4 * blocks(numel)].view(torch.float32)
    return codes, scales


def dequantize(raw: torch.Tensor, numel: int, signed: bool, out: torch.Tensor) -> None:
    """The fp32 values of the quantized tensor in ``raw`` into ``out`` (``numel`` elements)."""
    codes, scales = split(raw, numel)
    values = dynamic_map(signed)[codes.long()]
    full = (numel // BLOCK) * BLOCK
    out[:full].view(-1, BLOCK).copy_(values[:full].view(-1, BLOCK) * scales[: full // BLOCK, None])
    if full < numel:
        out[full:numel] = values[full:] * scales[-1]


def quantize(values: torch.Tensor, signed: bool, raw: torch.Tensor) -> None:
    """``values`` (fp32, ``numel`` elements) quantized into the bytes ``raw``: per block its absmax, per element the
    code of the map value nearest to ``value / absmax`` (the lower one on a tie)."""
    numel = values.numel()
    codes, scales = split(raw, numel)
    padded = torch.zeros(blocks(numel) * BLOCK, dtype=torch.float32)
    padded[:numel] = values
    grid = padded.view(-1, BLOCK)
    absmax = grid.abs().amax(dim=1)
    scales.copy_(absmax)
    normalized = (grid / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]).view(-1)[:numel]
    table = dynamic_map(signed)
    above = torch.searchsorted(table, normalized).clamp_(1, 255)  # table[above - 1] < y <= table[above]
    below = above - 1
    nearer_below = (normalized - table[below]) <= (table[above] - normalized)
    codes.copy_(torch.where(nearer_below, below, above).to(torch.uint8))
