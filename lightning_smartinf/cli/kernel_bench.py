"""``smartinf-kernel-bench``: Adam update throughput, OpenCL kernel (one device) vs DeepSpeed's CPU Adam op, and
the host's fused update with 8-bit state (``offload.state_precision=8bit``, update/quant8.py).

All update the same number of fp32 parameters in memory (no storage I/O), on the same cores, interleaved, and the
median of the repetitions is reported as parameters/s and GB/s (32 B touched per parameter with fp32 state: param,
grad, m, v read; param, m, v and the parameter copy written; 16 B with 8-bit state: param, grad and one byte each
of m and v read, param, m and v written).

    smartinf-kernel-bench --params 16777216 --reps 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from lightning_smartinf.extras import require
from lightning_smartinf.update.optimizers import OptimizerRule, StateSpec

BYTES_PER_PARAM = 32
BYTES_PER_PARAM_8BIT = 16
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
ADAMW = OptimizerRule("adamw", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0)))
"""torch's AdamW as the OpenCL kernel and the fused 8-bit update take it."""


def adam_state(n: int) -> list[np.ndarray]:
    """Realistic inputs for both kernels: master, gradient, exp_avg, exp_avg_sq (non-negative)."""
    rng = np.random.default_rng(0)
    master = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    grad = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    exp_avg = grad * np.float32(0.1)
    exp_avg_sq = grad * grad * np.float32(0.05)
    return [master, grad, exp_avg, exp_avg_sq]


def opencl_adam(n: int, platform: str) -> Callable[[int], None]:
    cl = require("pyopencl", "smartinf-kernel-bench's OpenCL kernels")

    from lightning_smartinf.update.arguments import kernel_scalars
    from lightning_smartinf.update.opencl import DeviceSpec, launch_shape, open_device

    _, ctx, program = open_device(DeviceSpec(platform=platform), torch.float32, torch.float32)
    queue = cl.CommandQueue(ctx)
    kernel = program.adam
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    master, grad, exp_avg, exp_avg_sq = adam_state(n)
    buffers = [cl.Buffer(ctx, flags, hostbuf=a) for a in (master, exp_avg, exp_avg_sq, grad, master)]

    def run(step: int) -> None:
        args = [np.uint32(n), np.float32(1.0), np.float32(1.0), *kernel_scalars(ADAMW, HYPER, step)]
        kernel(queue, *launch_shape(n), *buffers, *args).wait()

    return run


def deepspeed_adam(n: int) -> Callable[[int], None]:
    from lightning_smartinf.update.cpu_adam import DeepSpeedCPUAdamKernel

    adam = DeepSpeedCPUAdamKernel()
    master, grad, exp_avg, exp_avg_sq = (torch.from_numpy(a.copy()) for a in adam_state(n))

    def run(step: int) -> None:
        adam.update(True, master, grad, exp_avg, exp_avg_sq, HYPER, step)

    return run


def host_adam_8bit(n: int) -> tuple[str, Callable[[int], None]]:
    """The host update with 8-bit state, fused (quant8.fused_step), and the instruction set of its gathers."""
    from lightning_smartinf.update import quant8

    compiled = quant8.kernel()
    if compiled is None:
        raise SystemExit("the 8-bit state kernel did not build (a C++ compiler is needed): see the warning above")
    master, grad, exp_avg, exp_avg_sq = (torch.from_numpy(a.copy()) for a in adam_state(n))
    raw = {kind: torch.empty(quant8.payload(n, quant8.INT8), dtype=torch.uint8) for kind in ("exp_avg", "exp_avg_sq")}
    quant8.quantize(exp_avg, True, raw["exp_avg"])
    quant8.quantize(exp_avg_sq, False, raw["exp_avg_sq"])

    def run(step: int) -> None:
        quant8.fused_step(ADAMW, master, grad, raw, HYPER, max(step, 2), {})

    return f"host_adam_8bit ({compiled.isa()})", run


def measure(fns: dict[str, Callable[[int], None]], reps: int, rounds: int = 3) -> dict[str, list[float]]:
    """Alternating blocks of ``reps`` calls per kernel, ``rounds`` times: machine noise hits both, while one
    kernel's threads (OpenMP spins after a parallel region) do not steal cores from the other's next call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (kernel compile, page faults)
        fn(1)
    step = 2
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(0.2)  # let the other kernel's worker threads go idle
            for _ in range(reps):
                start = time.perf_counter()
                fn(step)
                times[name].append(time.perf_counter() - start)
                step += 1
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=16_777_216)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--platform", default="Portable Computing Language")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    eight_bit, fused = host_adam_8bit(args.params)
    fns = {
        "opencl_adam (PoCL)": opencl_adam(args.params, args.platform),
        "deepspeed_cpu_adam": deepspeed_adam(args.params),
        eight_bit: fused,
    }
    times = measure(fns, args.reps)
    rows = {}
    print(f"Adam update of {args.params:,} fp32 parameters, median of 3 x {args.reps} calls, "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    print(f"{'kernel':28s} {'ms':>9s} {'Mparams/s':>10s} {'GB/s':>7s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        rate = args.params / median
        touched = BYTES_PER_PARAM_8BIT if name == eight_bit else BYTES_PER_PARAM
        rows[name] = {"ms": median * 1e3, "params_per_s": rate, "GBps": rate * touched / 1e9}
        print(f"{name:28s} {median * 1e3:9.2f} {rate / 1e6:10.1f} {rate * touched / 1e9:7.2f}")
    names = list(rows)
    ratio = rows[names[0]]["params_per_s"] / rows[names[1]]["params_per_s"]
    ratio_8bit = rows[eight_bit]["params_per_s"] / rows[names[1]]["params_per_s"]
    print(f"OpenCL / DeepSpeed throughput: {ratio:.2f}x")
    print(f"host with 8-bit state / DeepSpeed (fp32 state) throughput: {ratio_8bit:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "reps": args.reps, "results": rows, "ratio": ratio,
                       "ratio_8bit": ratio_8bit}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
