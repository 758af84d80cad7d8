"""Each OpenCL optimizer kernel against torch's own optimizer math, on PoCL and under Oclgrind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lightning_smartinf.update.opencl import DeviceSpec, build_program, find_device, launch_shape
from lightning_smartinf.update.optimizers import OptimizerRule, StateSpec, torch_update
from lightning_smartinf.update.smart import kernel_scalars

RULES = {
    "adam": OptimizerRule("adam", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0))),
    "adamw": OptimizerRule("adamw", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0))),
    "sgd": OptimizerRule("sgd", (StateSpec("momentum_buffer", 0.0),)),
    "adagrad": OptimizerRule("adagrad", (StateSpec("sum", 0.1),)),
}
HYPER = {
    "adam": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    "adamw": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    "sgd": {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": True},
    "adagrad": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "eps": 1e-10},
}


def run_kernel(platform: str, name: str, grad_dtype: torch.dtype, param_dtype: torch.dtype, steps: int = 3,
               n: int = 1003) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run ``steps`` updates on device; return (device master, torch reference master, device 16-bit params)."""
    import pyopencl as cl

    rule, hyper = RULES[name], HYPER[name]
    device = find_device(DeviceSpec(platform=platform))
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    program = build_program(ctx, device, grad_dtype, param_dtype, None)
    kernel = getattr(program, "adam" if name == "adamw" else name)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    reference = master.clone()
    ref_state = {s.kind: torch.full((n,), s.init) for s in rule.states}
    dev_state = {s.kind: torch.full((n,), s.init) for s in rule.states}
    params = torch.empty(n, dtype=param_dtype)
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        inv_scale, clip = 0.5, 0.75
        torch_update(rule, reference, grad.float() * inv_scale * clip, ref_state, hyper, step)
        bufs = [cl.Buffer(ctx, flags, hostbuf=t.view(torch.uint8).numpy()) for t in (master, *dev_state.values(),
                                                                                   grad, params)]  # fmt: skip
        args = [np.uint32(n), np.float32(inv_scale), np.float32(clip), *kernel_scalars(rule, hyper, step)]
        kernel(queue, *launch_shape(n), *bufs, *args)  # n % 8 != 0 and whole work-groups: the tail path runs
        for tensor, buf in zip((master, *dev_state.values(), grad, params), bufs, strict=True):
            cl.enqueue_copy(queue, tensor.view(torch.uint8).numpy(), buf)
    return master, reference, params


def run_scatter(platform: str, values_dtype: torch.dtype, n: int = 1003, nnz: int = 37) -> tuple[torch.Tensor, ...]:
    """Zero-fill and scatter on the device; return (device result, the PyTorch reference)."""
    import pyopencl as cl

    from lightning_smartinf.compress.topk import SparseGradient
    from lightning_smartinf.update.opencl import SPARSE_SOURCE

    device = find_device(DeviceSpec(platform=platform))
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    program = build_program(ctx, device, values_dtype, values_dtype, None, SPARSE_SOURCE)
    gen = torch.Generator().manual_seed(0)
    indices = torch.randperm(n, generator=gen)[:nnz].sort().values.to(torch.int32)
    values = torch.randn(nnz, generator=gen).to(values_dtype)
    dense = torch.full((n,), 7.0)  # stale contents the zero-fill must clear
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    bufs = [cl.Buffer(ctx, flags, hostbuf=t.view(torch.uint8).numpy()) for t in (dense, indices, values)]
    program.zero_fill(queue, (n,), None, bufs[0], np.uint32(n))
    program.scatter(queue, (nnz,), None, bufs[0], np.uint32(n), bufs[1], bufs[2], np.uint32(nnz))
    cl.enqueue_copy(queue, dense.view(torch.uint8).numpy(), bufs[0])
    return dense, SparseGradient(indices, values, n).to_dense()


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16])
def test_scatter_matches_torch(fmt: torch.dtype) -> None:
    got, want = run_scatter("Portable", fmt)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(RULES))
def test_kernel_matches_torch_fp32(name: str) -> None:
    got, want, params = run_kernel("Portable", name, torch.float32, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(params, got)


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16])
def test_kernel_16bit_grads_and_params(fmt: torch.dtype) -> None:
    got, want, params = run_kernel("Portable", "adamw", fmt, fmt)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(params, got.to(fmt))  # round-to-nearest-even, as torch converts


def test_kernels_under_oclgrind_have_no_invalid_access() -> None:
    """Oclgrind simulates every work-item and reports out-of-bounds or uninitialised accesses on stderr."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_kernels import RULES, run_kernel
        for name in RULES:
            run_kernel("Oclgrind", name, torch.float32, torch.float32, steps=2, n=70)
        run_kernel("Oclgrind", "adam", torch.bfloat16, torch.bfloat16, steps=1, n=70)
        run_kernel("Oclgrind", "adam", torch.float16, torch.float16, steps=1, n=70)
        from test_kernels import run_scatter
        run_scatter("Oclgrind", torch.bfloat16, n=70, nnz=9)
        print("ran")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
    assert "Invalid" not in done.stderr and "error" not in done.stderr.lower(), done.stderr[-3000:]
