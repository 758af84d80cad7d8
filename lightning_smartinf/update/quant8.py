"""Optimizer state in 8 bits: block-wise dynamic quantization (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2022), so a step reads and writes about 1 byte per element of each state tensor instead of 4.

Each block of ``BLOCK`` elements keeps its largest magnitude (``absmax``, fp32); each element keeps the index of the
value of a 256-entry *dynamic* map nearest to ``element / absmax``. The map spends its codes where optimizer state
lives: a run of zero bits after the sign sets a power of ten (10^0 ... 10^-6), an indicator bit ends it, and the bits
left give a linear fraction in [0.1, 1]. The signed map serves state with a sign (Adam's first moment, SGD's
momentum), the unsigned one, which spends the sign bit on one more fraction bit, state that is never negative
(Adam's second moment, Adagrad's sum). Both hold 0 and 1 exactly, so a block's largest element round-trips.

The work runs in a small C++ kernel (``quant8.cpp``, compiled on first use like DeepSpeed's ops, on torch's
intra-op threads); where it cannot be built, the same arithmetic in torch ops (about 25x slower), with a warning.
The kernel also runs the host update fused (``fused_step``): each block widened, stepped with the device kernels'
math and quantized again while in cache, so the host and SmartUpdate write the same bytes.

A state file of ``n`` elements holds the ``n`` codes (uint8), padded to 4 bytes, then ``ceil(n / BLOCK)`` absmax
values (fp32). ``BLOCK`` divides the 2048-element subgroup alignment, so blocks never straddle two subgroups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_smartinf.core import Subgroup
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.ops import clear_stale_lock, extension_build_directory
from lightning_smartinf.update.arguments import kernel_scalars
from lightning_smartinf.update.optimizers import OptimizerRule

log = logging.getLogger(__name__)

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


def largest_payload(subgroups: Iterable[Subgroup]) -> int:
    """Bytes of the largest state tensor of ``subgroups``, each in its own precision: what a buffer that holds any
    of them takes."""
    return max((payload(sg.numel, sg.precision) for sg in subgroups), default=0)


def bytes_per_element(precision: str) -> float:
    """About what one element of one state tensor costs (the absmax shared by a block included)."""
    return 4.0 if precision == FP32 else 1.0 + 4.0 / BLOCK


def split(raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8) and absmax values (fp32) of a quantized state tensor held in the bytes ``raw``."""
    codes = raw[:numel]
    start = codes_bytes(numel)
    scales = raw[start : start + 4 * blocks(numel)].view(torch.float32)
    return codes, scales


def _split_cleared(raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``split``, for a tensor about to be quantized into ``raw``: the padding before the absmax values zeroed, so
    the files are equal run to run."""
    raw[numel : codes_bytes(numel)].zero_()
    return split(raw, numel)


KERNEL = "smartinf_quant8"


ISA_VARIABLE = "LIGHTNING_SMARTINF_QUANT8_ISA"
"""Caps the instruction set of the kernel's table gathers (to test and compare the paths; the bytes are the same)."""
ISAS = ("avx512", "avx2", "baseline")


@cache
def kernel() -> Any:
    """The compiled kernel (built on first use into this environment's op cache), or None where it cannot be."""
    from torch.utils.cpp_extension import load

    cap = os.environ.get(ISA_VARIABLE, "")
    if cap and cap not in ISAS:
        raise ConfigError(f"{ISA_VARIABLE}={cap!r} is not one of {', '.join(ISAS)}; unset it for the widest the "
                          "CPU runs")  # fmt: skip

    directory = extension_build_directory(KERNEL)
    clear_stale_lock(KERNEL, directory)
    if not any(directory.glob(f"{KERNEL}*.so")):
        log.info("compiling the 8-bit state kernel in %s (first use only; about a minute)", directory)
    try:
        # no errno from sqrt, so its loops vectorize; no contraction into FMAs, so the host and the devices agree
        flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
        return load(KERNEL, [str(Path(__file__).with_name("quant8.cpp"))], verbose=False, extra_cflags=flags,
                    extra_ldflags=["-fopenmp"])  # fmt: skip
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, or it failed
        log.warning("the 8-bit state kernel did not build (%s): quantizing with torch ops instead, much slower", err)
        return None


def dequantize(raw: torch.Tensor, numel: int, signed: bool, out: torch.Tensor) -> None:
    """The fp32 values of the quantized tensor in ``raw`` into ``out`` (``numel`` elements)."""
    codes, scales = split(raw, numel)
    compiled = kernel()
    if compiled is not None:
        compiled.dequantize(codes, scales, dynamic_map(signed), out[:numel])
        return
    values = dynamic_map(signed)[codes.long()]
    full = (numel // BLOCK) * BLOCK
    out[:full].view(-1, BLOCK).copy_(values[:full].view(-1, BLOCK) * scales[: full // BLOCK, None])
    if full < numel:
        out[full:numel] = values[full:] * scales[-1]


BUCKET_SHIFT = 12
"""Low bits of an fp32 value dropped to name its bucket: 11 mantissa bits stay, so a bucket spans at most 0.05% of
its values, far less than the map's closest neighbours (1.4% apart), and holds at most one map value."""


def _sortable(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (as int32) turned into integers in the order of the values they encode."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _nearest(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of the map value nearest to each of ``y`` (the lower one on a tie), by search: for the tables."""
    above = torch.searchsorted(table, y).clamp_(1, 255)  # table[above - 1] < y <= table[above]
    below = above - 1
    return torch.where((y - table[below]) <= (table[above] - y), below, above)


@cache
def buckets(signed: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per bucket of [-1, 1] (or [0, 1]) in the sortable order: the code of every value in it, or -1 where the
    codes of its first and last values differ (the nearest map value changes inside it; ``code`` is monotone in the
    value, so that is the only way); the index of the largest map value at or below its first value (0 where none
    is); and the offset that makes the first bucket's number 0. ``direct`` ends with one more -1, past the last
    bucket, so that the kernel's vector gathers, which read 32 bits at a bucket, stay inside it."""
    table = dynamic_map(signed)
    top = int(_sortable(torch.tensor([1.0]).view(torch.int32))) >> BUCKET_SHIFT
    bottom = int(_sortable(torch.tensor([-1.0 if signed else 0.0]).view(torch.int32))) >> BUCKET_SHIFT
    starts = torch.arange(bottom, top + 1, dtype=torch.int32) << BUCKET_SHIFT
    first = _sortable(starts).view(torch.float32)  # the transform is its own inverse
    last = _sortable(starts + ((1 << BUCKET_SHIFT) - 1)).view(torch.float32)
    lowest, highest = -1.0 if signed else 0.0, 1.0
    first, last = first.clamp(lowest, highest), last.clamp(lowest, highest)
    codes = _nearest(first, table)
    direct = torch.where(codes == _nearest(last, table), codes, torch.full_like(codes, -1))
    below = (torch.searchsorted(table, first, right=True) - 1).clamp_(0, 255)
    padded = torch.cat([direct, torch.full((1,), -1, dtype=direct.dtype)])
    return padded.to(torch.int16), below.to(torch.int16), -bottom


def quantize(values: torch.Tensor, signed: bool, raw: torch.Tensor) -> None:
    """``values`` (fp32, ``numel`` elements) quantized into the bytes ``raw``: per block its absmax, per element the
    code of the map value nearest to ``value / absmax`` (the lower one on a tie). The nearest is one of the two map
    values around ``value / absmax``; a table by fp32 bucket finds them without a search."""
    numel = values.numel()
    codes, scales = _split_cleared(raw, numel)
    compiled = kernel()
    if compiled is not None:
        direct, below, offset = buckets(signed)
        compiled.quantize(values.contiguous(), dynamic_map(signed), direct, below, offset, BUCKET_SHIFT, signed, codes,
                          scales)  # fmt: skip
        return
    full = (numel // BLOCK) * BLOCK
    grid = values[:full].view(-1, BLOCK)
    absmax = grid.abs().amax(dim=1)
    if full < numel:
        absmax = torch.cat([absmax, values[full:].abs().amax().reshape(1)])
    scales.copy_(absmax)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = torch.empty(numel, dtype=torch.float32)
    torch.div(grid, divisor[: full // BLOCK, None], out=y[:full].view(-1, BLOCK))
    if full < numel:
        torch.div(values[full:], divisor[-1], out=y[full:])
    y.clamp_(-1.0 if signed else 0.0, 1.0)
    table = dynamic_map(signed)
    _, below, offset = buckets(signed)
    bucket = (_sortable(y.view(torch.int32)) >> BUCKET_SHIFT).add_(offset)
    low = below[bucket.long()].long()
    low += (table[(low + 1).clamp_(max=255)] <= y) & (low < 255)  # the bucket's one map value, where y passed it
    high = (low + 1).clamp_(max=255)
    nearer_low = (y - table[low]) <= (table[high] - y)
    codes.copy_(torch.where(nearer_low, low, high).to(torch.uint8))


def _map(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A map and its bucket tables, as the kernel takes them."""
    direct, below, offset = buckets(signed)
    return dynamic_map(signed), direct, below, offset


def fused_step(rule: OptimizerRule, master: torch.Tensor, grad: torch.Tensor, raw: dict[str, torch.Tensor],
               hyper: dict[str, Any], step: int, init: dict[str, float]) -> bool:  # fmt: skip
    """One subgroup's update with its 8-bit state tensors (``raw``, by kind) in one pass of the kernel, with the
    device kernels' arithmetic and scalars (fpga_kernels/optimizers.cl): False where the kernel is not built (the
    caller widens, steps and quantizes in three passes instead). ``grad`` is unscaled and clipped already."""
    compiled = kernel()
    if compiled is None:
        return False
    numel = master.numel()
    grad = grad.to(torch.float32).contiguous()
    parts = {}
    for kind, buffer in raw.items():
        parts[kind] = _split_cleared(buffer, numel)
    scalars = [float(x) if not isinstance(x, np.integer) else bool(x) for x in kernel_scalars(rule, hyper, step)]
    first = step == 1
    if rule.name in ("adam", "adamw"):
        compiled.adam8(master, grad, *parts["exp_avg"], *parts["exp_avg_sq"], *_map(True), *_map(False),
                       BUCKET_SHIFT, first, *scalars)  # fmt: skip
    elif rule.name == "sgd":
        compiled.sgd8(master, grad, *parts["momentum_buffer"], *_map(True), BUCKET_SHIFT, first, *scalars[:5])
    else:
        compiled.adagrad8(master, grad, *parts["sum"], *_map(False), BUCKET_SHIFT, first, init["sum"], *scalars)
    return True
