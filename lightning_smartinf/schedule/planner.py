"""The planner of ``schedule=auto``: micro-batches, overlap, graph and checkpoint placement for the vertical schedule.

It searches the one time model (``schedule/timing.py``, which ``smartinf-plan`` predicts with too) over the divisors
of the batch (or the micro-batch counts the user fixed):

- Kept graphs: GreedySnake recomputes nothing it can afford to keep; the planner keeps as many blocks' forward
  graphs (measured bytes per block) as the activation memory holds. The rest are kept on storage
  (schedule/spill.py) where that is predicted faster than recomputing them (the disk has time to spare beside
  compute) and the disk has room for them; otherwise they recompute in backward.
- Checkpoints (M x boundaries x hidden bytes) go to the device-memory budget; what does not fit goes to host
  memory, then to storage. A choice whose checkpoints fit none of them is not taken; where no choice fits, the
  plan is an error that names the bytes and the budgets.

GreedySnake solves a small linear program over the same quantities; with one disk and one device the choice reduces
to this search.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_smartinf.errors import ConfigError
from lightning_smartinf.schedule.timing import Machine, Workload, predict
from lightning_smartinf.storage.io import IOBackend
from lightning_smartinf.storage.probe import probe_disk

log = logging.getLogger(__name__)


@dataclass
class Plan:
    micro_batches: int
    overlap: float
    checkpoint_host: float
    checkpoint_nvme: float
    predicted_s: float
    breakdown: dict[str, float]
    keep_activations: float = 0.0
    keep_bytes: int = 0
    """A module without the vertical protocol: the memory its blocks' kept graphs may take (sized as they run)."""
    spill_activations: float = 0.0
    """The share of blocks whose graphs are kept on storage (a module without the protocol: above 0, every graph
    the memory does not hold)."""
    workload: Workload | None = None
    """What it was planned for, and on what (``smartinf-plan`` predicts from the same two)."""
    machine: Machine | None = None

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.3f}s" for k, v in self.breakdown.items())
        keep = (f"kept graphs within {self.keep_bytes / 2**20:.0f} MiB" if self.keep_bytes
                else f"keep_activations={self.keep_activations:.2f}")  # fmt: skip
        keep += f", spill_activations={self.spill_activations:.2f}"
        return (f"schedule=auto: micro_batches={self.micro_batches}, overlap={self.overlap:.2f}, checkpoints "
                f"host {self.checkpoint_host:.2f} / nvme {self.checkpoint_nvme:.2f}, {keep}; predicted "
                f"{self.predicted_s:.3f} s/iteration ({parts})")  # fmt: skip

    def reasons(self) -> list[str]:
        """Why each choice, one line each (logged at start-up beside ``describe``)."""
        b = self.breakdown
        lines = [
            f"vertical: each block is read once per iteration in forward and once in backward, whatever the number "
            f"of micro-batches (parameter I/O {b['params_io']:.3f} s against compute {b['compute']:.3f} s)",
            f"overlap={self.overlap:.2f}: that share of the optimizer step ({b['step']:.3f} s) runs behind the next "
            f"forward ({b['step_hidden']:.3f} s hidden); each block waits for its own update, so it stays exact",
        ]
        if self.keep_bytes or self.keep_activations:
            lines.append("kept graphs: blocks whose forward graphs fit the memory the host budget leaves skip their "
                         "recompute in backward (a quarter less compute for each)")  # fmt: skip
        elif not self.spill_activations:
            lines.append("no kept graphs: offload.host_memory_budget leaves no memory for them; every block is "
                         "recomputed in backward")  # fmt: skip
        if self.spill_activations:
            lines.append(f"graphs on storage: the graphs memory does not hold go to disk and back "
                         f"({b['graphs_io']:.3f} s of disk time, beside the compute) instead of recomputing their "
                         "blocks in backward")  # fmt: skip
        elif self.keep_activations < 1.0 and not self.keep_bytes:
            lines.append("no graphs on storage: reading and writing them is predicted slower than recomputing, or "
                         "the disk lacks the room")  # fmt: skip
        return lines


def checkpoint_placement(work: Workload, machine: Machine, micro_batches: int) -> tuple[float, float] | None:
    """Fractions of each boundary's micro-batches in host memory and on storage, or None where they do not fit the
    device budget, host memory and the disk's room together."""
    per_micro = work.checkpoint_bytes_per_sample * (work.batch_size // micro_batches)
    on_device = min(micro_batches, machine.device_memory // max(per_micro, 1))
    rest = micro_batches - on_device
    on_host = min(rest, machine.host_memory // max(per_micro, 1))
    on_nvme = rest - on_host
    if on_nvme * per_micro > machine.graph_storage:
        return None
    return on_host / micro_batches, on_nvme / micro_batches


def kept_share(work: Workload, machine: Machine) -> float:
    """The share of blocks whose forward graphs fit the activation memory (the last blocks keep theirs)."""
    if not work.blocks or work.kept_block_bytes <= 0:
        return 0.0
    return min(work.blocks, machine.activation_memory // work.kept_block_bytes) / work.blocks


def plan(work: Workload, machine: Machine, max_micro_batches: int = 16, choices: list[int] | None = None) -> Plan:
    """The best vertical schedule for ``work`` over the divisors of its batch (or over ``choices``: the micro-batch
    counts the user fixed, e.g. ``accumulate_grad_batches``)."""
    keep = kept_share(work, machine)  # the graphs cover the whole batch whatever M: the same for every M
    spill = spilled_share(work, machine, keep)
    best: Plan | None = None
    for m in choices or range(1, min(max_micro_batches, work.batch_size) + 1):
        if work.batch_size % m:
            continue
        placement = checkpoint_placement(work, machine, m)
        if placement is None:
            continue
        parts = predict(work, machine, True, m, 1.0, keep, spill)
        overlap = 1.0 if parts["step"] else 0.0  # never slower: each block waits only for its own update
        if best is None or parts["total"] < best.predicted_s * 0.98:  # prefer fewer micro-batches on near-ties
            best = Plan(m, overlap, placement[0], placement[1], parts["total"], parts, keep, spill_activations=spill,
                        workload=work, machine=machine)  # fmt: skip
    if best is None:
        tried = choices or [m for m in range(1, min(max_micro_batches, work.batch_size) + 1) if not work.batch_size % m]
        raise ConfigError(
            f"schedule=auto: the activation checkpoints do not fit: {work.checkpoint_bytes_per_sample:,} B per sample "
            f"x {work.batch_size} samples = {work.checkpoint_bytes_per_sample * work.batch_size:,} B per batch, "
            f"against a device budget of {machine.device_memory:,} B, host memory of {machine.host_memory:,} B and "
            f"{machine.graph_storage:,} B of disk room (micro-batches tried: {tried}); lower data.batch_size or "
            "data.seq_len, or free disk space under offload.nvme_path"
        )
    return best


def spilled_share(work: Workload, machine: Machine, keep: float) -> float:
    """The share of blocks to keep on storage: all that memory does not keep (``1 - keep``) where that is predicted
    at least 2% faster than recomputing them and the disk has room, else none."""
    rest = 1.0 - keep
    needed = rest * work.blocks * work.kept_block_bytes
    if rest <= 0 or not work.blocks or work.kept_block_bytes <= 0 or machine.graph_storage < needed:
        return 0.0
    recompute = predict(work, machine, True, 1, 1.0, keep)["total"]
    return rest if predict(work, machine, True, 1, 1.0, keep, rest)["total"] < 0.98 * recompute else 0.0


def measure_machine(device: torch.device, directory: Path, backend: IOBackend | None, update_params_per_s: float,
                    dtype: torch.dtype, device_memory: int, host_memory: int,
                    probe_bytes: int = 128 * 2**20) -> Machine:  # fmt: skip
    """Short probes: the best of a few square matmuls for FLOP/s (2048^3, or smaller where the dtype is slow on this
    device, as fp16 on most CPUs: the size doubles from 256 while one takes under 50 ms); 128 MiB written and read,
    8 requests of 16 MiB at a time through the engine's I/O backend (None: one of its default kind), for disk
    bandwidth (``probe_disk``); ``probe_bytes`` less for a model whose traffic is smaller than that."""
    flops, n = 0.0, 256
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)
        seconds = float("inf")
        for _ in range(4 if n == 2048 else 2):
            start = time.perf_counter()
            a @ a
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = min(seconds, time.perf_counter() - start)
        flops = max(flops, 2 * n**3 / seconds)
        if n == 2048 or seconds > 0.05:
            break
        n *= 2
    try:
        disk = probe_disk(directory, probe_bytes, backend)
    except OSError as err:  # as the state's own I/O: a failed request is tried once more, then it is an error
        log.warning("smart_infinity: the disk probe under %s failed (%s); trying it once more", directory, err)
        disk = probe_disk(directory, probe_bytes, backend)
    return Machine(flops, disk.read, disk.write, update_params_per_s, device_memory, host_memory)


def probe_machine(device: torch.device, directory: Path, dtype: torch.dtype) -> Machine:
    """``measure_machine`` for a command without an engine: FLOP/s and the disk under ``directory`` through an I/O
    backend of its own (speeds only: no update rate, no memory limits)."""
    return measure_machine(device, directory, None, float("inf"), dtype, 0, 0)
