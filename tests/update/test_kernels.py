"""Each OpenCL optimizer kernel against torch's own optimizer math, on PoCL and under Oclgrind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

from lightning_smartinf.update.arguments import kernel_scalars
from lightning_smartinf.update.opencl import (
    KERNEL_SOURCE,
    SPARSE_SOURCE,
    DeviceSpec,
    launch_shape,
    open_device,
)
from lightning_smartinf.update.optimizers import OptimizerRule, StateSpec, torch_update

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


def open_program(platform: str, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                 source: str = KERNEL_SOURCE) -> tuple[Any, Any, Any]:  # fmt: skip
    """(context, queue, built program) for ``fpga_kernels/<source>`` on the platform's first device."""
    import pyopencl as cl

    _, ctx, program = open_device(DeviceSpec(platform=platform), grad_dtype, param_dtype, source)
    return ctx, cl.CommandQueue(ctx), program


def run_kernel(platform: str, name: str, grad_dtype: torch.dtype, param_dtype: torch.dtype, steps: int = 3,
               n: int = 1003) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run ``steps`` updates on device; return (device master, torch reference master, device 16-bit params)."""
    import pyopencl as cl

    rule, hyper = RULES[name], HYPER[name]
    ctx, queue, program = open_program(platform, grad_dtype, param_dtype)
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

    ctx, queue, program = open_program(platform, values_dtype, values_dtype, SPARSE_SOURCE)
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


def run_catch_up(platform: str, rule: str, values_dtype: torch.dtype, n: int = 1003,
                 nnz: int = 37) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """adam_decay then adam_catch_up on the device; return (device tensors, PyTorch reference in float64)."""
    import pyopencl as cl

    from lightning_smartinf.update.arguments import catch_up_scalars

    ctx, queue, program = open_program(platform, values_dtype, values_dtype, SPARSE_SOURCE)
    gen = torch.Generator().manual_seed(3)
    step, start, hyper = 40, 10, HYPER[rule]
    state = {
        "master": torch.randn(n, generator=gen),
        "exp_avg": torch.randn(n, generator=gen) * 0.1,
        "exp_avg_sq": torch.rand(n, generator=gen) * 0.01,
        "last_step": torch.randint(0, step, (n,), generator=gen).float(),  # some before compression started
        "param": torch.empty(n),
    }
    indices = torch.randperm(n, generator=gen)[:nnz].sort().values.to(torch.int32)
    values = torch.randn(nnz, generator=gen).to(values_dtype)
    squares = (values.float().square() * (1 + torch.rand(nnz, generator=gen))).to(values_dtype)

    ref = {k: v.double() for k, v in state.items() if k != "param"}
    beta1, beta2 = hyper["betas"]
    lr, wd, eps = hyper["lr"], hyper["weight_decay"], hyper["eps"]
    if rule == "adamw":
        ref["master"] *= 1 - lr * wd  # every element decays every step
    i = indices.long()
    t = step - ref["last_step"][i].clamp(min=start)
    g, s = values.double() / t, squares.double() / t
    p = ref["master"][i]
    if rule == "adam":  # L2: grad + wd * p over the whole wait
        g, s = g + wd * p, s + 2 * g * wd * p + (wd * p) ** 2
    m = beta1**t * ref["exp_avg"][i] + (1 - beta1**t) * g
    v = beta2**t * ref["exp_avg_sq"][i] + (1 - beta2**t) * s
    step_size, bc2 = lr / (1 - beta1**step), (1 - beta2**step) ** 0.5
    ref["master"][i] = p - t * step_size * m / (v.sqrt() / bc2 + eps)
    ref["exp_avg"][i], ref["exp_avg_sq"][i], ref["last_step"][i] = m, v, float(step)

    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    tensors = [*state.values(), indices, values, squares]
    bufs = [cl.Buffer(ctx, flags, hostbuf=t_.view(torch.uint8).numpy()) for t_ in tensors]
    master, exp_avg, exp_avg_sq, last_step, param, index, value, square = bufs
    decay, *args = catch_up_scalars(RULES[rule], hyper, step, start)
    program.adam_decay(queue, (n,), None, master, param, np.uint32(n), decay)
    program.adam_catch_up(queue, (nnz,), None, master, exp_avg, exp_avg_sq, last_step, param, np.uint32(n), index,
                          value, square, np.uint32(nnz), *args)  # fmt: skip
    for tensor, buf in zip(state.values(), bufs, strict=False):
        cl.enqueue_copy(queue, tensor.view(torch.uint8).numpy(), buf)
    return state, ref


@pytest.mark.parametrize("rule", ["adamw", "adam"])
@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16])
def test_catch_up_matches_torch(rule: str, fmt: torch.dtype) -> None:
    got, want = run_catch_up("Portable", rule, fmt)
    for kind, expected in want.items():
        torch.testing.assert_close(got[kind].double(), expected, rtol=2e-5, atol=1e-7, msg=kind)
    assert torch.equal(got["param"], got["master"])  # every element goes back, moved or only decayed


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
        from test_kernels import run_catch_up
        run_catch_up("Oclgrind", "adam", torch.bfloat16, n=70, nnz=9)
        run_catch_up("Oclgrind", "adamw", torch.float16, n=70, nnz=9)
        print("ran")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
    assert "Invalid" not in done.stderr and "error" not in done.stderr.lower(), done.stderr[-3000:]
