"""``smartinf-soak``: a long ``smartinf-train`` run watched from outside, to show that nothing grows without bound.

    smartinf-soak --minutes 60 -- recipe=gpt_125m data.seq_len=256 trainer.checkpoint_every_n_steps=20 \\
        trainer.val_check_interval=20

Every ``--interval`` seconds the run's process tree is sampled: resident memory, open file descriptors and threads,
and the bytes under its state directory and its checkpoint directory. After ``--minutes`` the run gets SIGTERM (it
saves a checkpoint and exits, as under a scheduler's preemption). Reported: each quantity's least-squares slope per
hour over the samples after the warm-up (the first ``--warmup`` share of the run: set-up, the first checkpoint, the
page cache filling), beside its range; a picture of the four series (``soak.png``) and the samples (``soak.json``).
Needs no GPU; not part of the test suite.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from lightning_smartinf import extras

SERIES = {"rss_mib": "resident memory (MiB)", "fds": "open file descriptors", "threads": "threads",
          "disk_mib": "state + checkpoints on disk (MiB)"}  # fmt: skip


@dataclass
class Sample:
    t: float
    step: int
    rss_mib: float
    fds: int
    threads: int
    disk_mib: float


@dataclass
class SoakReport:
    minutes: float = 0.0
    steps: int = 0
    checkpoints: int = 0
    validations: int = 0
    exit_code: int | None = None
    samples: list[Sample] = field(default_factory=list)
    slopes: dict[str, float] = field(default_factory=dict)
    """Per hour, over the samples after the warm-up."""


def tree_usage(pid: int) -> tuple[float, int, int]:
    """(RSS in MiB, open fds, threads) summed over ``pid`` and its children (data-parallel ranks, workers)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0, 0
    rss, fds, threads = 0, 0, 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
    return rss / 2**20, fds, threads


def du_mib(*paths: Path) -> float:
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:  # a checkpoint being removed as we walk
                    continue
    return total / 2**20


def metrics(run: Path) -> tuple[int, int]:
    """(the newest step logged, validation passes logged) from the run's metrics.csv (0, 0 before the first)."""
    path = run / "logs" / "metrics.csv"
    if not path.is_file():
        return 0, 0
    rows = list(csv.DictReader(path.read_text(errors="replace").splitlines()))
    steps = [int(row["step"]) for row in rows if row.get("step", "").isdigit()]
    return max(steps, default=0), sum(1 for row in rows if row.get("val_loss"))


def slope_per_hour(samples: list[Sample], key: str) -> float:
    """Least-squares slope of ``key`` against time, per hour."""
    if len(samples) < 2:
        return 0.0
    ts = [s.t for s in samples]
    ys = [float(getattr(s, key)) for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else 3600.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def soak(out: Path, minutes: float, interval: float, warmup: float, overrides: list[str]) -> SoakReport:
    state, run = out / "state", out / "run"
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", f"hydra.run.dir={run}", f"offload.nvme_path={state}",
           "trainer.max_steps=1000000000", *overrides]  # fmt: skip
    log_path = out / "train.log"
    report = SoakReport()
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            now = time.perf_counter() - started
            if now >= minutes * 60:
                proc.send_signal(signal.SIGTERM)  # a preemption: it saves and exits
                break
            rss, fds, threads = tree_usage(proc.pid)
            step = metrics(run)[0]
            report.samples.append(Sample(now, step, rss, fds, threads, du_mib(state, run / "checkpoints")))
            time.sleep(interval)
        report.exit_code = proc.wait()
    report.minutes = (time.perf_counter() - started) / 60
    text = log_path.read_text(errors="replace")
    report.steps, report.validations = metrics(run)
    report.checkpoints = len(re.findall(r"smart_infinity: checkpoint ", text))
    steady = [s for s in report.samples if s.t >= warmup * minutes * 60]
    report.slopes = {key: slope_per_hour(steady, key) for key in SERIES}
    return report


def plot(report: SoakReport, path: Path, warmup_s: float) -> None:
    plt = extras.pyplot("smartinf-soak's plot")
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    minutes = [s.t / 60 for s in report.samples]
    for ax, (key, label) in zip(axes.flat, SERIES.items(), strict=True):
        ax.plot(minutes, [getattr(s, key) for s in report.samples], lw=1)
        ax.axvline(warmup_s / 60, color="grey", ls=":", lw=1)
        ax.set_title(f"{label}: {report.slopes[key]:+.2f}/h after warm-up", fontsize=9)
        ax.set_xlabel("minutes")
    fig.suptitle(f"smartinf-soak: {report.minutes:.0f} min, {report.steps} steps, {report.checkpoints} checkpoints")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the run trains before SIGTERM")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.15, help="share of the run left out of the slopes")
    parser.add_argument("--out", type=Path, default=Path("smartinf_soak"), help="working directory (made fresh)")
    parser.add_argument("overrides", nargs="*", help="smartinf-train overrides (after --)")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"smartinf-soak: {args.out} exists; give a fresh --out")
    args.out.mkdir(parents=True)
    report = soak(args.out.absolute(), args.minutes, args.interval, args.warmup, args.overrides)
    (args.out / "soak.json").write_text(json.dumps(asdict(report), indent=1))
    plot(report, args.out / "soak.png", args.warmup * args.minutes * 60)
    print(f"{report.minutes:.1f} min, {report.steps} steps, {report.checkpoints} checkpoints, "
          f"{report.validations} validation logs, exit code {report.exit_code}")  # fmt: skip
    print("| quantity | first | last | min | max | slope after warm-up, per hour |\n|---|---|---|---|---|---|")
    for key, label in SERIES.items():
        values = [getattr(s, key) for s in report.samples] or [0]
        print(f"| {label} | {values[0]:.0f} | {values[-1]:.0f} | {min(values):.0f} | {max(values):.0f} | "
              f"{report.slopes[key]:+.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
