"""``smartinf-faults``: train with the state on a file system that fails on purpose, and check that every injected
fault is retried or named, and none becomes a wrong value in the model.

    smartinf-faults --seeds 3                                  # gpt_tiny, both backends, each kind and all mixed
    smartinf-faults --seeds 2 --backends aio -- update=smart

For each I/O backend (DeepSpeed's aio, the thread pool), each fault kind (an I/O error on a read or a write, a torn
write, a read that returns wrong bytes) and all kinds mixed, and each seed: the state directory is a fault-injecting
FUSE pass-through (``faultfs.py``, mounted with ``direct_io`` so the O_DIRECT requests reach it) over a fresh
directory; checkpoints go to the real disk. A run that stops on an error is finished from its last checkpoint on the
real directory. The final fp32 weights are compared bit for bit with a run that saw no fault.

Each injected fault's outcome, from the run's log: ``retried`` (a warning names its file and the retry succeeded),
``error`` (the run stopped with an error naming its file), ``harmless`` (neither, and the chain ended bit-exact:
the damaged bytes were overwritten before anything read them) or ``silent`` (neither, and the weights differ).
Needs root, ``/dev/fuse``, ``fusermount3`` (Debian's ``fuse3``) and ``mfusepy``; minutes, not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from smartinf_tools.chaos import chain_difference, final_weights, newest_step, train_command
from smartinf_tools.faultfs import KINDS

STATE_FILES = "state/*/sg*"
"""The faults' targets under the mount: the state files (not the planner's disk probe)."""
OUTCOMES = ("retried", "error", "harmless", "silent")
BASE = ("offload.host_memory_budget=0",)
"""Every run's state on the faulty disk (the default budget would keep the tiny model's state in RAM); later
overrides win."""


@dataclass
class Fault:
    backend: str
    kind: str
    path: str
    offset: int
    outcome: str = ""


@dataclass
class RunRecord:
    backend: str
    kinds: str
    seed: int
    returncode: int
    resumed_from: int | None
    """The step of the checkpoint a stopped run was finished from (-1: none yet, started over; None: not stopped)."""
    exact: bool
    faults: list[Fault] = field(default_factory=list)


class FaultMount:
    """``faultfs`` serving ``source`` at ``mountpoint`` with a plan, for the length of a ``with`` block."""

    def __init__(self, source: Path, mountpoint: Path, kinds: str, rate: float, limit: int, seed: int,
                 log: Path) -> None:  # fmt: skip
        self.mountpoint = mountpoint
        self.cmd = [sys.executable, "-m", "smartinf_tools.faultfs", str(source), str(mountpoint),
                    f"--kinds={kinds}", f"--rate={rate}", f"--limit={limit}", f"--seed={seed}",
                    f"--include={STATE_FILES}", f"--log={log}"]  # fmt: skip
        self.output = log.with_suffix(".fuse.log")

    def __enter__(self) -> FaultMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.output.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.mountpoint.is_mount():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"smartinf-faults: the fault-injecting file system did not mount: {self.output}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], check=False)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def outcome(fault: Fault, log: str, mountpoint: Path, failed: bool, exact: bool) -> str:
    """What became of one fault, from the training run's log (see the module docstring)."""
    named = str(mountpoint / fault.path)
    lines = [line for line in log.splitlines() if named in line]
    if failed and any("retrying once" not in line for line in lines):  # the error that stopped the run names it
        return "error"
    if any("retrying once" in line for line in lines):
        return "retried"
    return "harmless" if exact else "silent"


def run(root: Path, backend: str, kinds: str, seed: int, rate: float, limit: int, steps: int, every: int,
        extra: list[str], expected: dict) -> RunRecord:  # fmt: skip
    name = f"{backend}-{kinds.replace(',', '+')}-{seed}"
    work = root / name
    source, mountpoint, out = work / "source", work / "mount", work / "out"
    source.mkdir(parents=True)
    faults_log, train_log = work / "faults.jsonl", work / "train.log"
    overrides = [f"offload.io_backend={backend}", *BASE, *extra]
    with FaultMount(source, mountpoint, kinds, rate, limit, seed, faults_log), train_log.open("w") as log:
        returncode = subprocess.run(train_command(out, mountpoint / "state", steps, every, overrides, resume=False),
                                    stdout=log, stderr=subprocess.STDOUT).returncode  # fmt: skip
    text = train_log.read_text(errors="replace")
    resumed_from = None
    if returncode != 0:  # finish from the last checkpoint, on the same files without the faulty layer
        resumed_from = newest_step(out / "checkpoints")
        if resumed_from < 0:  # it stopped before its first checkpoint: start over, as a user would
            shutil.rmtree(source / "state", ignore_errors=True)
        with (work / "resume.log").open("w") as log:
            cmd = train_command(out, source / "state", steps, every, overrides, resume=resumed_from >= 0)
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"smartinf-faults: finishing {name} from its checkpoint failed: {work}/resume.log")
    exact = chain_difference(expected, final_weights(out, steps)) == 0.0
    injected = [json.loads(line) for line in faults_log.read_text().splitlines()] if faults_log.exists() else []
    record = RunRecord(backend, kinds, seed, returncode, resumed_from, exact)
    for item in injected:
        fault = Fault(backend, item["kind"], item["path"], item["offset"])
        fault.outcome = outcome(fault, text, mountpoint, returncode != 0, exact)
        record.faults.append(fault)
    shutil.rmtree(source)  # the state files; the logs and checkpoints stay
    return record


def table(records: list[RunRecord]) -> str:
    """Faults per backend and kind by outcome, then the runs."""
    rows = ["| backend | kind | injected | " + " | ".join(OUTCOMES) + " |", "|---" * (3 + len(OUTCOMES)) + "|"]
    backends = sorted({r.backend for r in records})
    for backend in backends:
        faults = [f for r in records if r.backend == backend for f in r.faults]
        for kind in KINDS:
            of_kind = [f for f in faults if f.kind == kind]
            counts = [sum(f.outcome == o for f in of_kind) for o in OUTCOMES]
            rows.append(f"| {backend} | {kind} | {len(of_kind)} | " + " | ".join(map(str, counts)) + " |")
    runs = len(records)
    stopped = [r.resumed_from for r in records if r.resumed_from is not None]
    exact = sum(r.exact for r in records)
    rows.append(f"\n{runs} runs: {runs - len(stopped)} finished through their faults, {len(stopped)} stopped on an "
                f"error and were finished from their last checkpoint (steps {sorted(stopped)}; -1: none yet, started "
                f"over); {exact}/{runs} bit-exact with the run without faults")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-faults", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per backend and kind set")
    parser.add_argument("--backends", default="aio,threads", help="offload.io_backend values, comma-separated")
    parser.add_argument("--kinds", default=",".join(KINDS), help="fault kinds run one at a time, then all mixed")
    parser.add_argument("--rate", type=float, default=0.001, help="probability that a state file request fails")
    parser.add_argument("--limit", type=int, default=4, help="most faults per run (each file at most once)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run")
    parser.add_argument("--every", type=int, default=5, help="trainer.checkpoint_every_n_steps")
    parser.add_argument("--out", type=Path, default=Path("smartinf_faults"), help="working directory (made fresh)")
    parser.add_argument("--json", type=Path, help="also write every fault and run here")
    parser.add_argument("overrides", nargs="*", help="smartinf-train overrides for every run (after --)")
    args = parser.parse_args(argv)
    if shutil.which("fusermount3") is None:
        raise SystemExit("smartinf-faults: needs fusermount3 (apt-get install fuse3) and mfusepy (pip install mfusepy)")
    root = args.out.absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with (root / "reference.log").open("w") as log:
        cmd = train_command(root / "reference", root / "reference_state", args.steps, args.every,
                            [*BASE, *args.overrides], resume=False)  # fmt: skip
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"smartinf-faults: the run without faults failed: {root}/reference.log")
    expected = final_weights(root / "reference", args.steps)
    kinds = args.kinds.split(",")
    sets = [*kinds, ",".join(kinds)] if len(kinds) > 1 else kinds
    records = []
    for backend in args.backends.split(","):
        for kind_set in sets:
            for seed in range(args.seeds):
                record = run(root, backend, kind_set, seed, args.rate, args.limit, args.steps, args.every,
                             args.overrides, expected)  # fmt: skip
                records.append(record)
                print(f"{backend} {kind_set} seed {seed}: {len(record.faults)} faults "
                      f"({', '.join(f.outcome for f in record.faults)}); exit {record.returncode}; "
                      f"{'exact' if record.exact else 'NOT EXACT'}", flush=True)  # fmt: skip
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in records], indent=1))
    if any(not r.exact for r in records) or any(f.outcome == "silent" for r in records for f in r.faults):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
