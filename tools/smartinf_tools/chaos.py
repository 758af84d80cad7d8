"""``smartinf-chaos``: kill ``smartinf-train`` at random moments, resume it each time, and compare the end result
bit for bit with an uninterrupted run.

    smartinf-chaos --kills 20                                  # gpt_tiny, CLI defaults, 40 steps, saves every 2
    smartinf-chaos --kills 10 --steps 60 --every 4 -- update=smart schedule=vertical schedule.micro_batches=2
    smartinf-chaos --kills 10 --kill-rank -- trainer.devices=2                  # data parallel: kill one rank
    smartinf-chaos --kills 20 --world-sizes 2 1 -- trainer.precision=32-true optim=sgd   # resume on 2, 1, 2, ... ranks

One reference run trains ``--steps`` steps straight through. Then a chaos run on its own state and checkpoint
directories is started, SIGKILLed after a random delay (one in five during start-up, set-up and restore, the rest
spread over the steps still to run, so kills land in steps, saves and checkpoint removals too), and restarted with
``trainer.resume`` on its checkpoint directory, ``--kills`` times; a last restart runs to the end. A chain of runs
that reaches the last step is compared with the reference and a new chain starts from nothing.

With ``--kill-rank`` (data parallel runs) each kill takes one rank's process, chosen at random, and the others must
stop on their own with the peer error within ``--peer-timeout`` seconds (counted as ``hung`` otherwise, and
killed); every rank then restarts from the checkpoint.

With ``--world-sizes 2 1`` each restart runs on the next rank count of the list in turn (the reference on the
first), accumulating ``max / M`` batches on ``M`` ranks so the global batch stays the same: every resume re-cuts the
state for another rank count (engine/relayout.py). The sums of a batch's gradient then run in another order, so a
chain cannot equal the single-rank-count reference bit for bit; instead each chain is replayed without kills: the
same rank counts over the same steps, each leg run to the step the chain's next leg resumed from (a clean stop and
resume). A chain is exact when its final weights equal its replay's bit for bit: the kills lost nothing and the
re-cut restores are deterministic. Reported beside: each chain's largest relative difference from the reference,
and how far an uninterrupted run on each other rank count ends from it (the order's rounding grown by training; a
1.9e-6 difference at step 12 is 2.4e-3 at step 60 with SGD at lr 0.05: docs/checkpoints.md).

Reported: kills (``--kills`` of them land: restarts that finish before their kill time do not count), resumes
(restarts that found a checkpoint), exact (chains whose final fp32 weights equal the reference's, or with
``--world-sizes`` their replay's, bit for bit), lost (kills after which the newest intact checkpoint was older
than before), corrupt (published checkpoints that fail verification, plus checkpoints a resume had to skip).
Needs no GPU; not part of the test suite (minutes).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from lightning_smartinf.checkpoint.export import consolidated_state_dict
from lightning_smartinf.checkpoint.manifest import MANIFEST, CheckpointError, latest_checkpoint, verify_checkpoint

SET_UP = "smart_infinity storage backend"
"""A line the engine logs once its storage is set up: start-up ends there."""
START_UP_SHARE = 0.2
"""The share of kills that land before the engine is set up (imports, verification, set-up)."""
RESTORE_SHARE = 0.5
"""A restore (and Lightning's fit start) takes about this share of the reference's start-up: kill windows after
set-up are that much longer than the steps left, so that a chain near its end still moves (a restart killed in every
restore would not), and some restarts finish first (they do not count as kills)."""


@dataclass
class ChaosReport:
    kills: int = 0
    resumes: int = 0
    chains: int = 0
    """Runs from a fresh start to the last step, each through any number of kills and resumes."""
    exact_chains: int = 0
    """Chains whose final fp32 weights equal the uninterrupted run's (``--world-sizes``: their replay's) bit for
    bit."""
    lost: int = 0
    corrupt: int = 0
    skipped: int = 0
    """Restarts' skipped checkpoints (damaged or unfinished ones passed over by the resume rule)."""
    reference_s: float = 0.0
    startup_s: float = 0.0
    """Of the reference run: until its engine is set up (imports, storage, initial values)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Kills by what the run was doing: start-up, restore, train, save."""
    steps_at_kill: list[int] = field(default_factory=list)
    ranks_killed: dict[int, int] = field(default_factory=dict)
    """``--kill-rank``: kills by the rank taken."""
    hung: int = 0
    """``--kill-rank``: kills after which a surviving rank did not stop on its own within the peer timeout."""
    world_sizes: list[int] = field(default_factory=list)
    """``--world-sizes``: the rank count of each run after the reference, in order (0: not chosen by chaos)."""
    differences: list[float] = field(default_factory=list)
    """Each chain's largest relative difference from the reference over its tensors (0.0: bit for bit)."""
    legs: list[list[int]] = field(default_factory=list)
    """``--world-sizes``: each chain's replayed legs, as the rank count of each and the step it ran to."""
    spread: dict[str, float] = field(default_factory=dict)
    """``--world-sizes``: by rank count, how far an uninterrupted run on it ends from the reference."""


def train_command(out: Path, state: Path, steps: int, every: int, extra: list[str], resume: bool,
                  world: tuple[int, int] | None = None, stop: int | None = None) -> list[str]:  # fmt: skip
    """``world``: (ranks, batches each accumulates per step) where the run's rank count is chosen for it; ``stop``:
    the step to stop at, where not ``steps`` (a replay's leg; validation stays where ``steps`` puts it)."""
    ranks = [f"trainer.devices={world[0]}", f"trainer.accumulate_grad_batches={world[1]}"] if world else []
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", f"hydra.run.dir={out}", f"offload.nvme_path={state}",
           f"trainer.max_steps={stop or steps}", f"trainer.checkpoint_every_n_steps={every}",
           f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=1", *extra, *ranks]  # fmt: skip
    return [*cmd, f"trainer.resume={out / 'checkpoints'}"] if resume else cmd


def newest_step(directory: Path) -> int:
    """The step of the newest intact checkpoint under ``directory`` (-1: none)."""
    found = latest_checkpoint(directory) if directory.is_dir() else None
    if found is None:
        return -1
    return int(json.loads((found / MANIFEST).read_text())["meta"].get("global_step", 0))


def final_weights(out: Path, steps: int) -> dict[str, torch.Tensor]:
    return consolidated_state_dict(out / "checkpoints" / f"step{steps}.ckpt")[0]


def chain_difference(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over the tensors (0.0: bit for bit; inf: other tensors)."""
    if expected.keys() != got.keys():
        return float("inf")
    return max((relative_difference(expected[k], got[k]) for k in expected), default=0.0)


def check_chain(report: ChaosReport, expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                replayed: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Count a finished chain: exact when bit for bit equal to the reference, or to its ``replayed`` legs."""
    report.chains += 1
    report.differences.append(chain_difference(expected, got))
    report.exact_chains += chain_difference(expected if replayed is None else replayed, got) == 0.0


def replay_legs(legs: list[tuple[int, int]], steps: int) -> list[tuple[int, int]]:
    """A chain's runs as (index in the rank plan, step it resumed from; -1: a fresh start), in order, to the legs
    that moved it on: (index in the rank plan, step the next run resumed from, or ``steps`` for the last)."""
    moved = []
    for i, (world, start) in enumerate(legs):
        stop = legs[i + 1][1] if i + 1 < len(legs) else steps
        if stop > max(start, 0):
            moved.append((world, stop))
    return moved


def replay(root: Path, legs: list[tuple[int, int]], plan: list[tuple[int, int]], steps: int, every: int,
           extra: list[str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """Run a chain's legs without kills, each stopping at its step and the next resuming there on its own rank
    count: the final weights the chain must equal bit for bit."""
    out, state = root / "replay", root / "replay_state"
    for directory in (out, state):
        shutil.rmtree(directory, ignore_errors=True)
    for i, (world, stop) in enumerate(legs):
        log_path = root / f"replay{len(list(root.glob('replay*.log'))):02d}.log"
        with log_path.open("w") as log:
            cmd = train_command(out, state, steps, every, extra, resume=i > 0, world=plan[world], stop=stop)
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"smartinf-chaos: a replay run failed: {log_path}")
    return final_weights(out, steps)


def spread(root: Path, plan: list[tuple[int, int]], expected: dict[str, torch.Tensor], steps: int, every: int,
           extra: list[str]) -> dict[str, float]:  # fmt: skip
    """How far an uninterrupted run on each other rank count of the plan ends from the reference."""
    found = {}
    for world in sorted(set(plan[1:]) - {plan[0]}):
        out = root / f"uninterrupted{world[0]}"
        with (root / f"uninterrupted{world[0]}.log").open("w") as log:
            cmd = train_command(out, root / f"uninterrupted{world[0]}_state", steps, every, extra, False, world)
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"smartinf-chaos: the uninterrupted run on {world[0]} rank(s) failed: {log.name}")
        found[str(world[0])] = chain_difference(expected, final_weights(out, steps))
    return found


def relative_difference(expected: torch.Tensor, got: torch.Tensor) -> float:
    if torch.equal(expected, got):
        return 0.0
    if not expected.is_floating_point():
        return float("inf")
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    if not scale:  # all zeros: equal or not
        return 0.0 if torch.equal(expected, got) else float("inf")
    return float((expected.float() - got.float()).abs().max()) / scale


def rank_plan(world_sizes: list[int]) -> list[tuple[int, int]]:
    """(ranks, accumulate_grad_batches) for each entry of ``--world-sizes``: the same global batch on each."""
    most = max(world_sizes)
    if any(w < 1 or most % w for w in world_sizes):
        raise SystemExit(f"smartinf-chaos: --world-sizes {world_sizes}: each must divide the largest ({most}), so the "
                         "global batch can stay the same by accumulation")  # fmt: skip
    return [(w, most // w) for w in world_sizes]


def count_corrupt(directory: Path) -> int:
    """Published checkpoints (a manifest is present) that fail verification."""
    bad = 0
    for entry in directory.iterdir() if directory.is_dir() else []:
        if entry.name.startswith(".") or not (entry / MANIFEST).is_file():
            continue
        try:
            verify_checkpoint(entry)
        except CheckpointError:
            bad += 1
    return bad


def rank_processes(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The run's ranks: its own process (rank 0) and the training processes Lightning's launcher started."""
    root = psutil.Process(proc.pid)
    children = [c for c in root.children(recursive=True) if "lightning_smartinf.cli.train" in " ".join(c.cmdline())]
    return [root, *children]


def kill_one_rank(proc: subprocess.Popen[bytes], rng: random.Random, peer_timeout: float,
                  report: ChaosReport) -> None:  # fmt: skip
    """SIGKILL one rank at random; the others must stop on their own (the peer error) within ``peer_timeout``."""
    try:
        ranks = rank_processes(proc)
    except psutil.NoSuchProcess:
        return
    rank = rng.randrange(len(ranks))
    ranks[rank].kill()
    report.ranks_killed[rank] = report.ranks_killed.get(rank, 0) + 1
    others = [r for i, r in enumerate(ranks) if i != rank]
    _, alive = psutil.wait_procs(others, timeout=peer_timeout)
    if alive:
        report.hung += 1
        for survivor in alive:
            survivor.kill()
    proc.wait()


def phase(log: str, ckpts: Path, pid: int) -> str:
    """What a run was doing when killed: saving (its staging directory exists), restoring (resuming, the state not
    yet restored), starting up (before any step), or training."""
    if list(ckpts.glob(f".*.partial-{pid}")) or list(ckpts.glob(f".*.replaced-{pid}")):
        return "save"
    if "resuming from" in log and "restored the offloaded state" not in log:
        return "restore"
    return "train" if SET_UP in log else "start-up"


def kill_all_ranks(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's every rank (a lost node takes the whole job)."""
    try:
        ranks = rank_processes(proc)
    except psutil.NoSuchProcess:
        ranks = []
    for rank in reversed(ranks):
        try:
            rank.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def campaign(root: Path, kills: int, steps: int, every: int, extra: list[str], seed: int, kill_rank: bool = False,
             peer_timeout: float = 120.0, world_sizes: list[int] | None = None) -> ChaosReport:  # fmt: skip
    """``world_sizes``: each restart on the next rank count in turn (the reference on the first); each chain is
    then compared with its replay."""
    report = ChaosReport()
    plan = rank_plan(world_sizes) if world_sizes else None
    restarts = 0
    rng = random.Random(seed)
    reference_log = root / "reference.log"
    with reference_log.open("w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(train_command(root / "reference", root / "reference_state", steps, every, extra,
                                              resume=False, world=plan[0] if plan else None),
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        while proc.poll() is None:
            if not report.startup_s and SET_UP in reference_log.read_text(errors="replace"):
                report.startup_s = time.perf_counter() - started
            time.sleep(0.05)
        report.reference_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"smartinf-chaos: the reference run failed: {reference_log}")
    training_s = report.reference_s - report.startup_s
    expected = final_weights(root / "reference", steps)
    out, state, ckpts = root / "chaos", root / "chaos_state", root / "chaos" / "checkpoints"
    legs: list[tuple[int, int]] = []

    def finish_chain() -> None:
        replayed = None
        if plan:
            moved = replay_legs(legs, steps)
            report.legs.append([v for world, stop in moved for v in (plan[world][0], stop)])
            replayed = replay(root, moved, plan, steps, every, extra)
        check_chain(report, expected, final_weights(out, steps), replayed)
        legs.clear()

    attempt = 0
    while True:
        before = newest_step(ckpts)
        if before == steps:  # this chain of runs got to the end: check it, then start a new chain
            finish_chain()
            for directory in (out, state):
                shutil.rmtree(directory)
            before = -1
        if attempt > 3 * kills:
            raise SystemExit(f"smartinf-chaos: {attempt} restarts landed only {report.kills} of {kills} kills: the "
                             "runs are too short for their kill times (more --steps)")  # fmt: skip
        log_path = root / f"attempt{attempt:02d}.log"
        attempt += 1
        with log_path.open("w") as log:
            world = plan[restarts % len(plan)] if plan else None
            legs.append((restarts % len(plan) if plan else 0, before))
            restarts += 1
            report.world_sizes.append(world[0] if world else 0)
            proc = subprocess.Popen(train_command(out, state, steps, every, extra, resume=before >= 0, world=world),
                                    stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            report.resumes += before >= 0
            if report.kills == kills:
                if proc.wait() != 0:
                    raise SystemExit(f"smartinf-chaos: the last restart failed: {log_path}")
                break
            # one kill in START_UP_SHARE lands in start-up; the others after the engine is set up, spread over the
            # restore and the reference's time for the steps still to run
            early = rng.random() < START_UP_SHARE
            delay = rng.uniform(0.0, report.startup_s) if early else rng.uniform(
                0.0, RESTORE_SHARE * report.startup_s + training_s * (steps - max(before, 0)) / steps)  # fmt: skip
            if not early:
                while proc.poll() is None and SET_UP not in log_path.read_text(errors="replace"):
                    time.sleep(0.02)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                kind = phase(log_path.read_text(errors="replace"), ckpts, proc.pid)
                if kill_rank:
                    kill_one_rank(proc, rng, peer_timeout, report)
                elif plan:
                    kill_all_ranks(proc)
                else:
                    proc.kill()
                    proc.wait()
                report.kills += 1
                report.phases[kind] = report.phases.get(kind, 0) + 1
                after = newest_step(ckpts)
                report.steps_at_kill.append(after)
                report.lost += after < before
    for log_path in sorted(root.glob("attempt*.log")):
        report.skipped += len(re.findall(r"skipping .*newer than any intact checkpoint", log_path.read_text()))
    report.corrupt = count_corrupt(ckpts) + report.skipped
    finish_chain()
    if plan:
        report.spread = spread(root, plan, expected, steps, every, extra)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartinf-chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs before the last, uninterrupted restart")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--every", type=int, default=2, help="trainer.checkpoint_every_n_steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--out", type=Path, default=Path("smartinf_chaos"), help="working directory (made fresh)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--kill-rank", action="store_true", help="data parallel: kill one rank, not the whole run")
    parser.add_argument("--peer-timeout", type=float, default=120.0,
                        help="--kill-rank: seconds the other ranks have to stop on their own")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="resume each restart on the next of these rank counts in turn (e.g. 2 1)")
    parser.add_argument("overrides", nargs="*", help="smartinf-train overrides for every run (after --)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    report = campaign(args.out.absolute(), args.kills, args.steps, args.every, args.overrides, args.seed,
                      args.kill_rank, args.peer_timeout, args.world_sizes)
    phases = ", ".join(f"{k} {v}" for k, v in sorted(report.phases.items()))
    print("| kills | during | resumes | exact | lost | corrupt |\n|---|---|---|---|---|---|")
    print(f"| {report.kills} | {phases} | {report.resumes} | {report.exact_chains}/{report.chains} runs | "
          f"{report.lost} | {report.corrupt} |")  # fmt: skip
    if args.kill_rank:
        print(f"ranks killed: {dict(sorted(report.ranks_killed.items()))}; the others stopped on their own after "
              f"{report.kills - report.hung} of {report.kills} kills")  # fmt: skip
    if args.world_sizes:
        print(f"rank counts of the runs after the reference: {report.world_sizes}; exact: equal to a replay of the "
              f"chain's legs without kills (rank count, step reached: {report.legs}); each chain's largest relative "
              f"difference from the uninterrupted {args.world_sizes[0]}-rank run: "
              f"{[f'{d:.2g}' for d in report.differences]}; uninterrupted runs on the other rank counts end "
              f"{ {k: f'{v:.2g}' for k, v in report.spread.items()} } from it")
    print(f"reference run {report.reference_s:.1f} s ({report.startup_s:.1f} s start-up); newest intact checkpoint "
          f"after each kill: steps {report.steps_at_kill}; logs: {args.out}/attempt*.log")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    if report.exact_chains < report.chains or report.lost or report.corrupt or report.hung:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
