"""SmartComp: top-k gradient compression on the training device, before the gradient crosses the host link.

Each subgroup's gradient is cut into blocks of ``compression.block`` elements; in every block the ``keep`` fraction
of largest magnitudes is kept. The wire format is int32 indices (within the subgroup) plus 16-bit values, so a
subgroup of n elements travels as ``k * (4 + 2)`` bytes instead of ``4 n``. The near-storage device zero-fills and
scatters (fpga_kernels/sparse.cl) before its update kernel.

Error feedback (beyond the paper, which drops what it does not send): the residual (everything not sent, including
the 16-bit rounding of what was) is kept on the training side and added back before the next selection. It lives
in training-device memory, fp32, up to ``compression.residual_budget_mb``, and in 16-bit host memory beyond; it
never travels to the devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_smartinf.config import CompressionConfig
from lightning_smartinf.engine.layout import Layout, Subgroup

VALUE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class SparseGradient:
    """A subgroup's gradient on the wire: int32 indices, 16-bit values."""

    indices: torch.Tensor
    values: torch.Tensor
    numel: int

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * 4 + self.values.numel() * self.values.element_size()

    def to_dense(self) -> torch.Tensor:
        """The dense fp32 gradient the device reconstructs (the reference for its scatter kernel)."""
        dense = torch.zeros(self.numel, dtype=torch.float32)
        dense[self.indices.long()] = self.values.float()
        return dense


def kept_per_block(keep: float, block: int) -> int:
    return max(1, round(keep * block))


def max_nnz(numel: int, cfg: CompressionConfig) -> int:
    """Most values a subgroup of ``numel`` elements can send (sizes the devices' fixed buffers)."""
    full, tail = divmod(numel, cfg.block)
    k = kept_per_block(cfg.keep, cfg.block)
    return full * k + (min(tail, max(1, round(cfg.keep * tail))) if tail else 0)


class TopKCompressor:
    def __init__(self, cfg: CompressionConfig, layout: Layout, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.value_dtype = VALUE_DTYPES[cfg.value_dtype]
        self._residuals: dict[int, torch.Tensor] = {}
        if cfg.error_feedback:
            budget = int(cfg.residual_budget_mb * 2**20)
            for sg in layout.subgroups:  # fp32 on the training device while the budget lasts, then 16-bit host
                on_device = budget >= sg.numel * 4
                budget -= sg.numel * 4 if on_device else 0
                where, dtype = (device, torch.float32) if on_device else (torch.device("cpu"), self.value_dtype)
                self._residuals[sg.index] = torch.zeros(sg.numel, dtype=dtype, device=where)

    @property
    def residual_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self._residuals.values():
            key = f"{r.device.type}/{str(r.dtype).removeprefix('torch.')}"
            out[key] = out.get(key, 0) + r.numel() * r.element_size()
        return out

    @property
    def has_state(self) -> bool:
        """Whether there are residuals to checkpoint (error feedback on)."""
        return bool(self._residuals)

    def state_dict(self) -> dict[int, torch.Tensor]:
        return {index: r.cpu() for index, r in self._residuals.items()}

    def load_state_dict(self, state: dict[int, torch.Tensor]) -> None:
        if state.keys() != self._residuals.keys():
            raise ValueError("the checkpoint's error-feedback residuals belong to another layout")
        for index, residual in self._residuals.items():
            residual.copy_(state[index])

    def wire_ratio(self, numel: int) -> float:
        """Bytes on the wire over dense fp32 bytes for a subgroup of ``numel`` elements."""
        return max_nnz(numel, self.cfg) * (4 + self.value_dtype.itemsize) / (4 * numel)

    def compress(self, sg: Subgroup, grad: torch.Tensor) -> SparseGradient:
        """Select each block's largest magnitudes of ``grad`` (+ the residual), on the training device."""
        acc = grad.to(self.device, dtype=torch.float32, copy=True)
        residual = self._residuals.get(sg.index)
        if residual is not None:
            acc += residual.to(self.device, dtype=torch.float32)
        indices = self._select(acc)
        values = acc[indices].to(self.value_dtype)
        if residual is not None:
            acc[indices] -= values.float()  # what was not sent, including the 16-bit rounding of what was
            residual.copy_(acc.to(residual.device, dtype=residual.dtype))
        return SparseGradient(indices.to(torch.int32).cpu(), values.cpu(), sg.numel)

    def _select(self, acc: torch.Tensor) -> torch.Tensor:
        block, numel = self.cfg.block, acc.numel()
        full = numel // block * block
        k = kept_per_block(self.cfg.keep, block)
        parts = []
        if full:
            top = acc[:full].view(-1, block).abs().topk(k, dim=1).indices  # (blocks, k)
            offsets = torch.arange(0, full, block, device=acc.device).unsqueeze(1)
            parts.append((top + offsets).reshape(-1))
        if numel > full:
            tail = numel - full
            k_tail = min(tail, max(1, round(self.cfg.keep * tail)))
            parts.append(acc[full:].abs().topk(k_tail).indices + full)
        return torch.cat(parts).sort().values
