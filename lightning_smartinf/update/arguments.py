"""The OpenCL kernels' arguments: each kernel's names in its signature's order (checked against fpga_kernels/ when
a program is built), and the hyper-parameter scalars, computed on the host in double precision as torch does."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_smartinf.update.optimizers import OptimizerRule

DENSE = ("master", "grad", "param_out", "n", "inv_scale", "clip_coef")
"""The dense kernels' common arguments; their optimizer state comes between master and grad, their
hyper-parameters (``kernel_scalars``, in order) after clip_coef."""
KERNEL_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "adam": ("master", "exp_avg", "exp_avg_sq", "grad", "param_out", "n", "inv_scale", "clip_coef", "beta1_weight",
             "beta2", "one_minus_beta2", "eps", "weight_decay", "decoupled", "decay", "step_size", "bc2_sqrt"),
    "sgd": ("master", "momentum_buffer", "grad", "param_out", "n", "inv_scale", "clip_coef", "lr", "momentum",
            "dampening_weight", "weight_decay", "nesterov", "first_step"),
    "adagrad": ("master", "state_sum", "grad", "param_out", "n", "inv_scale", "clip_coef", "clr", "weight_decay",
                "eps"),
    "zero_fill": ("grad", "n"),
    "scatter": ("grad", "n", "index", "value", "nnz"),
    "adam_decay": ("master", "param_out", "n", "decay"),
    "dequantize8": ("raw", "scales_at", "table", "out", "n"),
    "quantize8": ("values", "raw", "scales_at", "table", "direct", "below", "offset", "buckets", "shift", "lowest",
                  "n"),
    "adam_catch_up": ("master", "exp_avg", "exp_avg_sq", "last_step", "param_out", "n", "index", "value", "square",
                      "nnz", "beta1", "beta2", "eps", "l2", "step", "start", "step_size", "bc2_sqrt"),
}  # fmt: skip
"""Every kernel's arguments by name, in its signature's order (checked against fpga_kernels/ at build time)."""


def kernel_scalars(rule: OptimizerRule, hyper: dict[str, Any], step: int) -> list[Any]:
    """The kernel's hyper-parameter arguments, computed in double precision on the host as torch does."""
    f32, i32 = np.float32, np.int32
    lr, wd = hyper["lr"], hyper["weight_decay"]
    if rule.name in ("adam", "adamw"):
        beta1, beta2 = hyper["betas"]
        decoupled = rule.name == "adamw"
        return [f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(hyper["eps"]), f32(wd), i32(decoupled),
                f32(1 - lr * wd), f32(lr / (1 - beta1**step)), f32((1 - beta2**step) ** 0.5)]  # fmt: skip
    if rule.name == "sgd":
        return [f32(lr), f32(hyper["momentum"]), f32(1 - hyper["dampening"]), f32(wd), i32(hyper["nesterov"]),
                i32(step == 1)]  # fmt: skip
    if rule.name == "adagrad":
        return [f32(lr / (1 + (step - 1) * hyper["lr_decay"])), f32(wd), f32(hyper["eps"])]
    raise AssertionError(rule.name)


def catch_up_scalars(rule: OptimizerRule, hyper: dict[str, Any], step: int, start: int) -> list[Any]:
    """The catch-up kernels' arguments (decay for adam_decay, the rest for adam_catch_up); ``start`` is the step
    compression started after (its warmup), before which every element moved every step."""
    f32 = np.float32
    lr, wd = hyper["lr"], hyper["weight_decay"]
    beta1, beta2 = hyper["betas"]
    decoupled = rule.name == "adamw"
    return [f32(1 - lr * wd if decoupled else 1.0), f32(beta1), f32(beta2), f32(hyper["eps"]),
            f32(0.0 if decoupled else wd), f32(step), f32(start), f32(lr / (1 - beta1**step)),
            f32((1 - beta2**step) ** 0.5)]  # fmt: skip
