"""SmartComp: top-k gradient compression on the training device, before the gradient crosses the host link.

Each subgroup's gradient is cut into blocks of ``compression.block`` elements; in every block the ``keep`` fraction
of largest magnitudes is kept. The wire format is int32 indices (within the subgroup) plus 16-bit values, so a
subgroup of n elements travels as ``k * (4 + 2)`` bytes instead of ``4 n``. The near-storage device zero-fills and
scatters (fpga_kernels/sparse.cl) before its update kernel.

Error feedback (beyond the paper, which drops what it does not send): the residual (everything not sent, including
the 16-bit rounding of what was) is kept on the training side and added back before the next selection. It lives
in training-device memory, fp32, up to ``compression.residual_budget_mb``, and in 16-bit host memory beyond; it
never travels to the devices.

Catch-up (``compression.catch_up``, Adam/AdamW): beside the residual, the sum of squared gradients since an
element was last sent is kept too, and both sums travel when the element is selected (int32 index, 16-bit sum,
16-bit sum of squares). The device then updates only the elements it receives, each by the steps it missed, with the
mean gradient and mean square of that wait (fpga_kernels/sparse.cl ``adam_catch_up``). Gradients are unscaled and
clipped here, step by step, before they are summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_smartinf.config import CompressionConfig
from lightning_smartinf.core import Layout, StepContext, Subgroup
from lightning_smartinf.errors import ConfigError

VALUE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class SparseGradient:
    """A subgroup's gradient on the wire: int32 indices, 16-bit values (and, with catch-up, 16-bit sums of
    squares)."""

    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    squares: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        squares = self.squares.numel() * self.squares.element_size() if self.squares is not None else 0
        return self.indices.numel() * 4 + self.values.numel() * self.values.element_size() + squares

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
        self._numels = [sg.numel for sg in layout.subgroups]
        self._residuals: dict[int, torch.Tensor] = {}
        self._squares: dict[int, torch.Tensor] = {}
        if cfg.error_feedback:
            budget = int(cfg.residual_budget_mb * 2**20)
            buffers = 2 if cfg.catch_up else 1
            for sg in layout.subgroups:  # fp32 on the training device while the budget lasts, then 16-bit host
                on_device = budget >= sg.numel * 4 * buffers
                budget -= sg.numel * 4 * buffers if on_device else 0
                where, dtype = (device, torch.float32) if on_device else (torch.device("cpu"), self.value_dtype)
                self._residuals[sg.index] = torch.zeros(sg.numel, dtype=dtype, device=where)
                if cfg.catch_up:
                    self._squares[sg.index] = torch.zeros(sg.numel, dtype=dtype, device=where)

    @property
    def residual_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in (*self._residuals.values(), *self._squares.values()):
            key = f"{r.device.type}/{str(r.dtype).removeprefix('torch.')}"
            out[key] = out.get(key, 0) + r.numel() * r.element_size()
        return out

    @property
    def has_state(self) -> bool:
        """Whether there are residuals to checkpoint (error feedback on)."""
        return bool(self._residuals)

    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        return {"residual": {index: r.cpu() for index, r in self._residuals.items()},
                "squares": {index: q.cpu() for index, q in self._squares.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        if state and all(isinstance(key, int) for key in state):  # written before catch-up: residuals only
            state = {"residual": state}
        for name, mine in (("residual", self._residuals), ("squares", self._squares)):
            saved = state.get(name, {})
            if saved.keys() != mine.keys():
                raise ConfigError(
                    f"the checkpoint's error-feedback {name} belong to another layout or another "
                    "compression.catch_up setting"
                )
            for index, buffer in mine.items():
                buffer.copy_(saved[index])

    @property
    def element_bytes(self) -> int:
        """Bytes per sent element: an int32 index, a 16-bit value and, with catch-up, a 16-bit sum of squares."""
        return 4 + self.value_dtype.itemsize * (2 if self.cfg.catch_up else 1)

    def summary(self) -> dict[str, Any]:
        """What the run reports about compression: ``keep`` and the wire ratio it gives over the whole model (bytes on
        the wire per step over the dense fp32 gradient's), plus the error-feedback memory."""
        sent = sum(max_nnz(numel, self.cfg) for numel in self._numels) * self.element_bytes
        return {"keep": self.cfg.keep, "block": self.cfg.block, "wire_ratio": sent / (4 * sum(self._numels)),
                "error_feedback": self.cfg.error_feedback, "catch_up": self.cfg.catch_up,
                "warmup_steps": self.cfg.warmup_steps, "residual_bytes": self.residual_bytes}  # fmt: skip

    def describe(self) -> str:
        """One line for the start-up log and the run summary."""
        s, dtype = self.summary(), self.cfg.value_dtype
        wire = f"int32 index + {dtype} value" + (f" + {dtype} sum of squares" if self.cfg.catch_up else "")
        parts = [f"top-k keep={s['keep']:g} per {s['block']}-element block, wire {s['wire_ratio']:.4f} of the dense "
                 f"fp32 gradient ({wire})"]  # fmt: skip
        if self.cfg.error_feedback:
            memory = ", ".join(f"{where} {n / 2**20:.1f} MiB" for where, n in s["residual_bytes"].items())
            parts.append(f"error feedback ({memory})")
        if self.cfg.catch_up:
            parts.append("catch-up")
        if self.cfg.warmup_steps:
            parts.append(f"dense for the first {self.cfg.warmup_steps} steps")
        return "; ".join(parts)

    def compress(self, sg: Subgroup, grad: torch.Tensor, ctx: StepContext) -> SparseGradient:
        """Select each block's largest magnitudes of ``grad`` (+ the residual), on the training device.

        Without catch-up the device unscales and clips what it receives; with it, each step's gradient is unscaled
        and clipped here (``ctx``) before it joins the sums, since a sum spans steps with different coefficients."""
        acc = grad.to(self.device, dtype=torch.float32, copy=True)
        squares = self._squares.get(sg.index)
        if squares is not None:
            ctx.prepare(acc)
            total = acc.square().add_(squares.to(self.device, dtype=torch.float32))
        residual = self._residuals.get(sg.index)
        if residual is not None:
            acc += residual.to(self.device, dtype=torch.float32)
        indices = self._select(acc)
        values = acc[indices].to(self.value_dtype)
        if residual is not None:
            acc[indices] -= values.float()  # what was not sent, including the 16-bit rounding of what was
            residual.copy_(acc.to(residual.device, dtype=residual.dtype))
        sent_squares = None
        if squares is not None:
            sent_squares = total[indices].to(self.value_dtype).cpu()
            total[indices] = 0.0  # a sent element starts a new wait
            squares.copy_(total.to(squares.device, dtype=squares.dtype))
        return SparseGradient(indices.to(torch.int32).cpu(), values.cpu(), sg.numel, sent_squares)

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
