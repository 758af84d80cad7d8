"""8-bit optimizer state on a near-storage device (``offload.state_precision=8bit`` with ``update=smart``).

The state files in the device's directory hold the quantized state (update/quant8.py); the device reads them over
its own link, widens each state tensor to fp32 in device memory (``dequantize8``), runs the optimizer kernel on the
wide tensors, and quantizes them again (``quantize8``) into the buffers written back. Neither the host link nor the
device's link carries fp32 state. The kernels (fpga_kernels/quant8.cl) do the host kernel's arithmetic, so the
codes equal the host's for the same fp32 values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning_smartinf.update import quant8
from lightning_smartinf.update.arguments import KERNEL_ARGUMENTS
from lightning_smartinf.update.opencl import QUANT_SOURCE, NamedKernel, build_program


class DeviceQuantizer:
    """One device's quantization kernels and tables (the map, and the bucket tables for each signedness)."""

    def __init__(self, cl: Any, context: Any, device: Any) -> None:
        self.cl = cl
        self.context = context
        program = build_program(context, device, torch.float32, torch.float32, None, QUANT_SOURCE)
        self.dequantize = NamedKernel(program, "dequantize8", QUANT_SOURCE, KERNEL_ARGUMENTS["dequantize8"])
        self.quantize = NamedKernel(program, "quantize8", QUANT_SOURCE, KERNEL_ARGUMENTS["quantize8"])
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        self.tables: dict[bool, tuple[Any, Any, Any, int, int]] = {}
        for signed in (True, False):
            direct, below, offset = quant8.buckets(signed)
            self.tables[signed] = (
                cl.Buffer(context, flags, hostbuf=quant8.dynamic_map(signed).numpy()),
                cl.Buffer(context, flags, hostbuf=direct.numpy()),
                cl.Buffer(context, flags, hostbuf=below.numpy()),
                offset,
                below.numel(),
            )

    def wide_buffers(self, kinds: tuple[str, ...], max_numel: int) -> dict[str, Any]:
        """Device memory for each state kind widened to fp32 (one set per slot)."""
        return {kind: self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, 4 * max_numel) for kind in kinds}

    def widen(self, queue: Any, raw: Any, wide: Any, kind: str, numel: int, init: float | None) -> None:
        """``raw`` (the quantized tensor) into ``wide`` as fp32; ``init``: the first step's value instead."""
        if init is not None:
            self.cl.enqueue_fill_buffer(queue, wide, np.float32(init), 0, 4 * numel)
            return
        table = self.tables[quant8.is_signed(kind)][0]
        self.dequantize(queue, (numel,), None, raw=raw, scales_at=np.uint32(quant8.codes_bytes(numel)), table=table,
                        out=wide, n=np.uint32(numel))  # fmt: skip

    def narrow(self, queue: Any, wide: Any, raw: Any, kind: str, numel: int) -> Any:
        """``wide`` quantized into ``raw``; returns the kernel's event."""
        signed = quant8.is_signed(kind)
        table, direct, below, offset, buckets = self.tables[signed]
        return self.quantize(queue, (quant8.blocks(numel),), None, values=wide, raw=raw,
                             scales_at=np.uint32(quant8.codes_bytes(numel)), table=table, direct=direct, below=below,
                             offset=np.int32(offset), buckets=np.int32(buckets), shift=np.int32(quant8.BUCKET_SHIFT),
                             lowest=np.float32(-1.0 if signed else 0.0), n=np.uint32(numel))  # fmt: skip

    def release(self, wide: dict[str, Any]) -> None:
        for buffer in wide.values():
            buffer.release()
