"""``smartinf-bench``: smart_infinity against the real DeepSpeed ZeRO-Infinity, same model, data, batch and disk.

Runs each system in its own process, interleaved over ``--reps`` repetitions (a b c d e a b c d e ...), and writes
a Markdown table, a PNG and the raw JSON, plus the exact DeepSpeed config it ran:

    smartinf-bench --quick                     # GPT-125M shapes, under 10 minutes here
    smartinf-bench --full --out docs/bench     # GPT-350M shapes
    smartinf-bench --recipe gpt_760m --seq 512 --micro-batches 8 --systems a b c

Systems: (a) DeepSpeed ZeRO-Infinity (ZeRO-3, params + optimizer on NVMe, DeepSpeedCPUAdam); (s) smart_infinity
with every setting at its default (micro-batches as accumulate_grad_batches); (q) (s) with 8-bit optimizer state;
(b) smart_infinity, horizontal, host update; (c) + vertical schedule and step overlap; (d) + SmartUpdate on
``--devices`` near-storage devices; (e) + SmartComp (top-k 1%, error feedback; with ``--catch-up`` also
compression.catch_up). See ``bench/systems.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

from lightning_smartinf import extras
from lightning_smartinf.bench.systems import NAMES, SYSTEMS, Workload, deepspeed_config
from lightning_smartinf.resources import asset_dir
from lightning_smartinf.schedule.planner import probe_machine
from lightning_smartinf.schedule.timing import Machine

PRESETS = {
    "quick": {"recipe": "gpt_125m", "seq": 256, "micro_batch": 1, "micro_batches": 4, "steps": 2, "reps": 1},
    "full": {"recipe": "gpt_350m", "seq": 256, "micro_batch": 1, "micro_batches": 8, "steps": 3, "reps": 2},
}


def recipe_model(name: str, seq: int) -> dict[str, Any]:
    path = asset_dir("recipes") / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in asset_dir("recipes").glob("*.yaml")))
        raise SystemExit(f"--recipe={name!r} is not one of {known}")
    recipe: Any = OmegaConf.to_container(OmegaConf.load(path))
    model = dict(recipe["model"])
    return {**model, "block_size": max(seq, int(model.get("block_size", seq)))}


def run_one(system: str, w: Workload, work: Path, rep: int) -> dict[str, Any]:
    state = Path(w.nvme_path) / f"bench_{system}"
    shutil.rmtree(state, ignore_errors=True)
    spec = work / f"{system}_{rep}.spec.json"
    out = work / f"{system}_{rep}.json"
    spec.write_text(json.dumps({"system": system, "workload": {**w.__dict__, "nvme_path": str(state)}}))
    done = subprocess.run([sys.executable, "-m", "lightning_smartinf.bench.worker", str(spec), str(out)],
                          capture_output=True, text=True)  # fmt: skip
    shutil.rmtree(state, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"system ({system}) {NAMES.get(system, 'compute probe')} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(out.read_text()))


def roofline(system: str, r: dict[str, Any], w: Workload, m: Machine) -> float:
    """max(compute, disk time): 6 FLOP/param/token for DeepSpeed, plus 2 for each block forward we recompute ((b)
    recomputes every block; (c)-(e) all but the ``--keep-activations`` share)."""
    flops_per_token = 6 if system == "a" else 8 if system == "b" else 6 + 2 * (1 - w.keep_activations)
    compute = flops_per_token * r["params"] * w.tokens_per_step / m.flops
    disk = r["disk_read_per_step"] / m.disk_read + r["disk_write_per_step"] / m.disk_write
    return max(compute, disk)


def bound(r: dict[str, Any], compute: float, m: Machine) -> tuple[float, str]:
    """The bound from this run's own measurements, and which term binds: max(the measured forward and backward of
    the step's micro-batches, nothing recomputed, plus the update measured alone where the same CPU cores run it;
    the system's disk bytes at the measured read and write speeds)."""
    disk = r["disk_read_per_step"] / m.disk_read + r["disk_write_per_step"] / m.disk_write
    return (compute, "compute") if compute >= disk else (disk, "disk")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("seconds_per_step", "disk_read_per_step", "disk_write_per_step", "peak_rss_bytes")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in ("host_link_per_step", "device_link_per_step"):
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    out["params"] = runs[0]["params"]
    out["reps"] = [r["seconds_per_step"] for r in runs]
    return out


def describe_machine(m: Machine) -> str:
    cpu = platform.processor() or platform.machine()
    ram = psutil.virtual_memory().total / 2**30
    return (f"{psutil.cpu_count()} CPU cores ({cpu}), {ram:.0f} GiB RAM, matmul {m.flops / 1e12:.2f} TFLOP/s measured; "
            f"disk {m.disk_read / 1e9:.2f} GB/s read, {m.disk_write / 1e9:.2f} GB/s write (O_DIRECT, measured); "
            f"torch {torch.__version__}")  # fmt: skip


def report(results: dict[str, dict[str, Any]], compute: float, update: float, w: Workload, m: Machine,
           args: argparse.Namespace) -> str:  # fmt: skip
    base = results.get("a")
    params = next(iter(results.values()))["params"]
    lines = [
        f"{'Llama (transformers)' if w.family == 'llama' else 'GPT'} {w.model['n_layer']}x{w.model['n_embd']} "
        f"({params / 1e6:.0f}M parameters), {w.precision}, global "
        f"batch {w.micro_batches} x {w.micro_batch} x {w.seq_len} tokens, state on one disk; median of "
        f"{args.reps} interleaved repetitions of {w.steps} timed steps after {w.warmup} warm-up.",
        f"Machine: {describe_machine(m)}.",
        f"Command: `smartinf-bench {' '.join(sys.argv[1:])}`",
        f"Compute (forward and backward of the step's micro-batches, plain PyTorch, model in memory, weights in the "
        f"training dtype{', plus one update of the model measured alone: the same CPU cores run it' if update else ''}"
        f"): {compute:.2f} s{f' ({compute - update:.2f} + {update:.2f})' if update else ''}.",
        "",
        "| system | s/step | tokens/s | vs (a) | host link B/param | device links B/param | disk GB/step "
        "(read+write) | peak host RSS GiB | roofline s | of roofline | bound s | binds | x bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in results.items():
        peak = roofline(system, r, w, m)
        measured, binds = bound(r, compute, m)
        host = r["host_link_per_step"]
        host = (r["disk_read_per_step"] + r["disk_write_per_step"]) if host is None else host
        device = r["device_link_per_step"] or 0.0
        ratio = f"{base['seconds_per_step'] / r['seconds_per_step']:.2f}x" if base else "-"
        disk = (r["disk_read_per_step"] + r["disk_write_per_step"]) / 1e9
        tokens = w.tokens_per_step / r["seconds_per_step"]
        lines.append(
            f"| ({system}) {NAMES[system]} | {r['seconds_per_step']:.2f} | {tokens:.0f} "
            f"| {ratio} | {host / params:.1f} | {device / params:.1f} | {disk:.2f} | {r['peak_rss_bytes'] / 2**30:.1f} "
            f"| {peak:.2f} | {peak / r['seconds_per_step']:.0%} | {measured:.2f} | {binds} "
            f"| {r['seconds_per_step'] / measured:.2f}x |"
        )  # fmt: skip
    lines += [
        "",
        "Host link for (a) is its disk traffic (all of it crosses host memory); for (b)-(e) it is the engine's byte "
        "counters (payload). Roofline: max(compute, disk read / read bandwidth + disk write / write bandwidth) with "
        f"6 FLOP/param/token for (a), 8 for (b) (recomputed block forward), {6 + 2 * (1 - w.keep_activations):g} for "
        f"(c)-(e) (--keep-activations {w.keep_activations:g}). Bound: max(the compute above, measured in this run; "
        "the system's disk bytes at the measured disk speeds), and which of the two binds; x bound: the step time "
        "over it.",
    ]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], w: Workload, path: Path, compute: float) -> None:
    systems = list(results)
    tokens = [w.tokens_per_step / results[s]["seconds_per_step"] for s in systems]
    plt = extras.pyplot("smartinf-bench's plot")
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = ["#888", "#dd8452", "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3"]
    bars = ax.bar([f"({s}) {NAMES[s]}" for s in systems], tokens, color=colors[: len(systems)])
    base = tokens[0] if systems[0] == "a" else None
    for bar, value in zip(bars, tokens, strict=True):
        label = f"{value:.0f}" + (f"\n{value / base:.2f}x" if base else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
    ax.axhline(w.tokens_per_step / compute, color="k", linestyle="--", linewidth=1)
    ax.annotate("compute bound", (0, w.tokens_per_step / compute), fontsize=8, va="bottom")
    params = next(iter(results.values()))["params"]
    ax.set(ylabel="tokens/s", title=f"{w.family} {params / 1e6:.0f}M, {w.precision}, state on disk")
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="GPT-125M shapes (the default)")
    size.add_argument("--full", action="store_true", help="GPT-350M shapes, two repetitions")
    parser.add_argument("--recipe", help="a recipe name (recipes/*.yaml) for the model shape")
    parser.add_argument("--layers", type=int, help="override the recipe's n_layer (smaller runs)")
    parser.add_argument("--vocab", type=int, help="override the recipe's vocab_size (e.g. 256: bytes)")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--micro-batches", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps first (2: with one, smart_infinity's first timed step was still 25%% "
                             "slower than the rest at GPT-350M shapes, docs/benchmarks.md)")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--devices", type=int, default=2, help="near-storage devices for (d) and (e)")
    parser.add_argument("--keep-activations", type=float, default=1.0,
                        help="(c)-(e): share of blocks whose forward graph serves backward (0: recompute all)")
    parser.add_argument("--family", choices=("gpt", "llama"), default="gpt",
                        help="gpt: the shipped GPT; llama: a transformers Llama of the same shape, its own forward")
    parser.add_argument("--host-memory-budget", default="auto",
                        help="(s)-(e): offload.host_memory_budget, e.g. 2GB of optimizer state in RAM, or 0 (default "
                        "auto, as smartinf-train)")
    parser.add_argument("--catch-up", action="store_true", help="(e) with compression.catch_up (docs/compression.md)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nvme-path", default="smartinf_bench_state")
    parser.add_argument("--out", default="smartinf_bench")
    args = parser.parse_args(argv)
    preset = PRESETS["full" if args.full else "quick"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model = recipe_model(args.recipe, args.seq)
    if args.layers:
        model["n_layer"] = args.layers
    if args.vocab:
        model["vocab_size"] = args.vocab
    nvme = Path(args.nvme_path).absolute()
    nvme.mkdir(parents=True, exist_ok=True)
    w = Workload(model, args.seq, args.micro_batch, args.micro_batches, args.precision, str(nvme), args.devices,
                 args.warmup, args.steps, accelerator=args.accelerator, catch_up=args.catch_up,
                 keep_activations=args.keep_activations, host_memory_budget=args.host_memory_budget,
                 family=args.family)  # fmt: skip
    out = Path(args.out)
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.precision.startswith("bf16") else torch.float32
    machine = probe_machine(torch.device(args.accelerator), nvme, dtype)
    (out / "deepspeed_config.json").write_text(json.dumps(deepspeed_config(w, str(nvme / "bench_a")), indent=2))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    computes: list[float] = []
    updates: list[float] = []
    for rep in range(args.reps):
        probe = run_one("compute", w, work, rep)
        computes.append(probe["seconds_per_step"])
        updates.append(probe["update_seconds"] if args.accelerator == "cpu" else 0.0)
        print(f"rep {rep + 1}/{args.reps} compute (forward + backward, in memory): {computes[-1]:.2f} s/step; "
              f"update alone {probe['update_seconds']:.2f} s", flush=True)  # fmt: skip
        for system in args.systems:
            result = run_one(system, w, work, rep)
            runs[system].append(result)
            print(f"rep {rep + 1}/{args.reps} ({system}) {NAMES[system]}: {result['seconds_per_step']:.2f} s/step",
                  flush=True)  # fmt: skip
    results = {s: aggregate(r) for s, r in runs.items()}
    update = statistics.median(updates)
    compute = statistics.median(computes) + update
    table = report(results, compute, update, w, machine, args)
    print(table)
    (out / "benchmarks.md").write_text(table + "\n")
    (out / "benchmarks.json").write_text(json.dumps({"args": vars(args), "results": results, "compute": computes,
                                                     "update": updates, "machine": machine.__dict__},
                                                    indent=2))  # fmt: skip
    plot(results, w, out / "benchmarks.png", compute)
    print(f"wrote {out / 'benchmarks.md'}, {out / 'benchmarks.png'}, {out / 'deepspeed_config.json'}")


if __name__ == "__main__":
    main()
