"""``smartinf-schedule-bench``: horizontal vs vertical vs vertical + overlap, same global batch, one run.

For each number of micro-batches M, trains a GPT of the given shape for a few optimizer steps under each schedule
with the same global batch (M micro-batches of ``--micro-batch`` sequences), state on disk, and reports the median
seconds per optimizer step, tokens/s, parameter bytes read per step, and the roofline bound max(compute, disk time)
with how close each run gets:

- compute: the same run with its state directory in RAM (``--ram-path``, a tmpfs): everything the step does but
  wait for the disk (on a CPU-only machine that includes the optimizer math and the copies, on the same cores);
- disk time: the iteration's bytes, counted over the measured steps only, at the disk's speed measured just before
  the run (``storage.probe.probe_disk``: reads alone, writes alone and both at once, sustained over
  ``--probe-gb``).

Writes a Markdown table, a JSON file and a PNG.

    smartinf-schedule-bench --layers 24 --width 1024 --heads 16 --seq 128 --micro-batches 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_smartinf import extras
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.models.gpt import GPTConfig, GPTModule
from lightning_smartinf.storage.probe import probe_disk

MODES: dict[str, dict[str, Any]] = {
    "horizontal": {},
    "vertical": {"kind": "vertical"},
    "vertical + overlap": {"kind": "vertical", "overlap": 1.0},
    "vertical + overlap + eager": {"kind": "vertical", "overlap": 1.0, "eager_update": True},
    "vertical, parked": {"kind": "vertical", "parked": True},
}
"""``parked``: the module's vertical_pre/vertical_loss are hidden, so its training_step runs parked at every block
(the route any module without the protocol takes; docs/models.md measures what it costs)."""


class StepTimer(pl.Callback):
    """Wall time and the host link's read and write bytes at the end of each optimizer step."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        if not engine.micro_batches:
            host = engine.counters
            self.stamps.append((time.perf_counter(), host.total(link="host", direction="read"),
                                host.total(link="host", direction="write")))  # fmt: skip


def run_mode(
    cfg: GPTConfig, mode: str, micro_batches: int, args: argparse.Namespace, nvme_path: str
) -> dict[str, float]:
    """Train ``args.warmup + args.steps`` steps with state under ``nvme_path``; seconds and bytes per measured step."""
    torch.manual_seed(0)
    module = GPTModule(cfg, lr=1e-4)
    vertical = mode != "horizontal"
    schedule = {**MODES[mode], "micro_batches": micro_batches} if vertical else {"kind": "horizontal"}
    if schedule.pop("parked", False):
        module.vertical_pre = module.vertical_loss = None  # type: ignore[assignment]
    batch = args.micro_batch * (micro_batches if vertical else 1)
    steps = args.warmup + args.steps
    data = torch.randint(0, 256, (batch * steps * (1 if vertical else micro_batches), args.seq + 1))
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": nvme_path, "subgroup_size": args.subgroup_size, "host_memory_budget": "0"},
        schedule=schedule,
    )
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=steps,
        accumulate_grad_batches=1 if vertical else micro_batches, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=batch))  # type: ignore[arg-type]
    engine = strategy.engine
    assert engine is not None
    engine.wait_step()  # an overlapped last step still counts its bytes
    window = timer.stamps[args.warmup - 1 :]
    seconds = statistics.median(b[0] - a[0] for a, b in zip(window[:-1], window[1:], strict=True))
    host = engine.counters
    # steady state: an overlapped step's I/O that spills into the next interval is balanced by the previous one's
    read, write = ((window[-1][i] - window[0][i]) / args.steps for i in (1, 2))
    result = {
        "seconds_per_step": seconds,
        "tokens_per_s": args.micro_batch * micro_batches * args.seq / seconds,
        "param_read_bytes_per_step": host.total(link="host", kind="param", direction="read") / steps,
        "disk_read_bytes_per_step": read,
        "disk_write_bytes_per_step": write,
        "params": engine.layout.num_params,
    }
    strategy.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--subgroup-size", type=int, default=1 << 24)
    parser.add_argument("--nvme-path", default="smartinf_state_bench", help="state directory on the disk measured")
    parser.add_argument(
        "--ram-path",
        default="/dev/shm/smartinf_state_bench",
        help="state directory in RAM (tmpfs) for the compute reference; removed after each run",
    )
    parser.add_argument("--probe-gb", type=float, default=1.0, help="GB each way for the disk probe before each run")
    parser.add_argument("--out", default="schedule_bench")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="horizontal is the base")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1: the first measured interval starts at a warm-up step's end")
    if Path(args.ram_path).resolve() == Path(args.nvme_path).resolve():
        parser.error("--ram-path and --nvme-path must differ: the RAM run is the compute reference for the disk run")
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, vocab_size=args.vocab,
                    block_size=args.seq)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    modes = ["horizontal", *(mode for mode in args.modes if mode != "horizontal")]
    results: dict[str, dict[int, dict[str, float]]] = {mode: {} for mode in modes}
    for m in args.micro_batches:
        for mode in modes:
            disk = probe_disk(Path(args.nvme_path), int(args.probe_gb * 1e9))
            r = run_mode(cfg, mode, m, args, args.nvme_path)
            try:
                r["ram_seconds_per_step"] = run_mode(cfg, mode, m, args, args.ram_path)["seconds_per_step"]
            finally:
                shutil.rmtree(args.ram_path, ignore_errors=True)
            r.update(disk_read_bw=disk.read, disk_write_bw=disk.write, disk_mixed_bw=disk.mixed)
            r["disk_s"] = disk.seconds(r["disk_read_bytes_per_step"], r["disk_write_bytes_per_step"])
            r["roofline_s"] = max(r["ram_seconds_per_step"], r["disk_s"])
            results[mode][m] = r
            print(f"M={m} {mode}: {r['seconds_per_step']:.2f} s/step on disk, {r['ram_seconds_per_step']:.2f} in RAM",
                  flush=True)  # fmt: skip
    params = next(iter(results["horizontal"].values()))["params"]
    lines = [
        f"GPT {args.layers}x{args.width} ({params / 1e6:.0f}M parameters), {args.precision}, micro-batch "
        f"{args.micro_batch}x{args.seq} tokens; disk speeds measured before each run, GB/s reads / writes / both",
        "",
        "| M | schedule | s/step | tokens/s | vs horizontal | param GB read/step | disk GB read + written/step | "
        "disk GB/s | compute s (RAM) | disk s | roofline s | of roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.micro_batches:
        base = results["horizontal"][m]["tokens_per_s"]
        for mode in modes:
            r = results[mode][m]
            lines.append(
                f"| {m} | {mode} | {r['seconds_per_step']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s'] / base:.2f}x | {r['param_read_bytes_per_step'] / 1e9:.2f} | "
                f"{r['disk_read_bytes_per_step'] / 1e9:.2f} + {r['disk_write_bytes_per_step'] / 1e9:.2f} | "
                f"{r['disk_read_bw'] / 1e9:.2f} / {r['disk_write_bw'] / 1e9:.2f} / {r['disk_mixed_bw'] / 1e9:.2f} | "
                f"{r['ram_seconds_per_step']:.2f} | {r['disk_s']:.2f} | {r['roofline_s']:.2f} | "
                f"{r['roofline_s'] / r['seconds_per_step']:.0%} |"
            )
    table = "\n".join(lines)
    print(table)
    (out / "schedule_bench.md").write_text(table + "\n")
    (out / "schedule_bench.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    plt = extras.pyplot("smartinf-schedule-bench's plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        ax.plot(args.micro_batches, [results[mode][m]["tokens_per_s"] for m in args.micro_batches], "o-", label=mode)
    ax.set(xlabel="micro-batches per step (M)", ylabel="tokens/s", title=f"GPT {params / 1e6:.0f}M, state on disk")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "schedule_bench.png", dpi=100)
    print(f"wrote {out / 'schedule_bench.md'} and {out / 'schedule_bench.png'}")


if __name__ == "__main__":
    main()
