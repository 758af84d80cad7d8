"""``smartinf-memory-bench``: peak host memory of training recipes built on meta, optionally under a cgroup limit.

For each recipe, a fresh process trains ``--steps`` optimizer steps with ``smartinf-train``'s code (model built on
meta, initialized block by block into storage, no final checkpoint) and reports its peak RSS, the model's size, its
fp32 weights' size and the seconds per step. With ``--limit-gb`` (as root, cgroup v1 or v2) each process runs in a
memory cgroup of that size, so the kernel enforces the budget: a run that needs more is killed, and says so.

    smartinf-memory-bench --recipes gpt_125m gpt_760m gpt_1_3b gpt_2_7b --limit-gb 6 --nvme-path /mnt/nvme/bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_smartinf.storage.space import human_bytes

CGROUP = Path("/sys/fs/cgroup")


def make_cgroup(name: str, limit: int) -> Path:
    """A memory cgroup holding at most ``limit`` bytes (swap included where the kernel accounts it)."""
    v1 = CGROUP / "memory"
    if v1.is_dir():
        group = v1 / name
        group.mkdir(exist_ok=True)
        memsw = group / "memory.memsw.limit_in_bytes"
        # memory+swap may never be below memory alone: raise it first when growing, lower it last when shrinking
        for path in (memsw, group / "memory.limit_in_bytes", memsw):
            if path.exists():
                try:
                    path.write_text(str(limit))
                except OSError:
                    if path.name == "memory.limit_in_bytes":
                        raise
        return group / "tasks"
    group = CGROUP / name
    group.mkdir(exist_ok=True)
    (group / "memory.max").write_text(str(limit))
    (group / "memory.swap.max").write_text("0")
    return group / "cgroup.procs"


def child(recipe: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Train in this process and report its own peak RSS."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_smartinf.cli.config import TrainConfig, register_configs
    from lightning_smartinf.cli.train import run
    from lightning_smartinf.resources import asset_dir

    register_configs()
    with initialize_config_dir(str(asset_dir("conf")), version_base=None):
        raw = compose("config", [f"recipe={recipe}", f"trainer.max_steps={steps}", "trainer.save_final=false",
                                 "trainer.limit_val_batches=1", f"trainer.val_check_interval={steps}", *overrides])
    cfg: TrainConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    out = Path(cfg.trainer.output_dir) / f"memory_bench_{recipe}"
    started = time.perf_counter()
    result = run(cfg, out)
    assert result is not None
    summary: dict[str, Any] = result["summary"]  # type: ignore[assignment]
    params = summary["params"]
    metrics = (out / "logs" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    losses = [float(row.split(",")[header.index("train_loss")]) for row in metrics[1:]
              if "train_loss" in header and row.split(",")[header.index("train_loss")]]  # fmt: skip
    return {
        "recipe": recipe,
        "params": params,
        "fp32_weights_bytes": params * 4,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds_per_step": summary["seconds"] / max(summary["optimizer_steps"], 1),
        "wall_seconds": time.perf_counter() - started,
        "losses": losses,
        "val_loss": result["val_loss"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-memory-bench", description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["gpt_125m", "gpt_760m", "gpt_1_3b", "gpt_2_7b"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit-gb", type=float, default=None, help="memory cgroup per run (root only)")
    parser.add_argument("--nvme-path", default="smartinf_state_memory_bench")
    parser.add_argument("--out", default="memory_bench.json")
    parser.add_argument("--override", nargs="*", default=["data.seq_len=256", "data.batch_size=1",
                                                          "trainer.log_every_n_steps=1"],
                        help="smartinf-train overrides for every run (default: short sequences)")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = [*args.override, f"offload.nvme_path={args.nvme_path}"]
    if args.child:
        print("RESULT " + json.dumps(child(args.child, overrides, args.steps)), flush=True)
        return
    tasks = make_cgroup("smartinf_memory_bench", int(args.limit_gb * 2**30)) if args.limit_gb else None
    results = []
    for recipe in args.recipes:

        def enter(tasks: Path | None = tasks) -> None:
            if tasks is not None:
                tasks.write_text(str(os.getpid()))

        command = [sys.executable, "-m", "lightning_smartinf.cli.memory_bench", "--child", recipe,
                   "--steps", str(args.steps), "--nvme-path", args.nvme_path, "--override", *args.override]  # fmt: skip
        done = subprocess.run(command, preexec_fn=enter, capture_output=True, text=True)  # noqa: PLW1509
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            killed = done.returncode == -9
            print(f"{recipe}: {'killed (out of memory under the limit)' if killed else 'failed'} "
                  f"(rc {done.returncode})\n{done.stderr[-3000:]}")  # fmt: skip
            results.append({"recipe": recipe, "failed": done.returncode})
            continue
        r = json.loads(lines[-1].removeprefix("RESULT "))
        results.append(r)
        print(f"{recipe}: {r['params'] / 1e9:.2f}B params, fp32 weights {human_bytes(r['fp32_weights_bytes'])}, "
              f"peak RSS {human_bytes(r['peak_rss_bytes'])}, {r['seconds_per_step']:.1f} s/step, "
              f"losses {[round(x, 3) for x in r['losses']]}", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"limit_gb": args.limit_gb, "overrides": args.override,
                                          "results": results}, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
