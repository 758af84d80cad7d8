"""Systems (a)-(e) described in the terms of the one time model (``schedule/timing.py``) for ``smartinf-plan``.

Per iteration of P parameters (P_s of them streamed), T tokens in M micro-batches, mixed-precision Adam, this module
gives each system's bytes and choices; the time is ``timing.predict``'s, the same that ``schedule=auto`` plans with:

    storage      R = min(ssds x read, host link),  W = min(ssds x write, host link)   (RAID-0 behind one link)
    compute      6 FLOP/param/token where graphs are kept (ZeRO-Infinity's (a)), 8 where every block's forward is
                 recomputed in backward
    params       2 B x P_s read in forward and in backward: x M (horizontal) or x 1 (vertical); a frozen base's
                 F streamed parameters likewise, at their own itemsize, with no step (LoRA: P is the adapters)
    host step    12 B/param read, 12 + 2 B/param written (master, m, v; new 16-bit params), CPU Adam alongside
    smart step   8 B/param over the host link (fp32 gradient out, fp32 parameter back; SmartComp: ~0.06 + 4),
                 16 B read + 12 B written per param inside each device, P / k params per device
    (a)          phases in turn (ZeRO-Infinity sits near their sum, docs/benchmarks.md); (b) horizontal;
                 (c)-(e) vertical, the step behind the next forward (overlap 1)

The storage devices are shared: under (c)-(e) all disk traffic of an iteration must also fit in it. The model has
no fudge factors; docs/benchmarks.md compares it with smartinf-bench on this machine and says where it errs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_smartinf.bench.systems import NAMES
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.schedule.timing import Machine, Workload, disk_bytes, param_read_bytes
from lightning_smartinf.schedule.timing import predict as predict_time

GB = 1e9


@dataclass
class Hardware:
    """A machine, measured (``--measure``) or described. Bandwidths in GB/s, rates in G params/s."""

    name: str = "described"
    gpus: int = 1
    tflops: float = 100.0
    """Sustained training FLOP/s per GPU (or the CPU's matmul rate), in TFLOP/s."""
    gpu_memory_gb: float = 80.0
    host_memory_gb: float = 512.0
    ssds: int = 1
    ssd_read: float = 3.0
    ssd_write: float = 2.0
    host_link: float = 16.0
    """The one link all storage traffic to host memory crosses (a PCIe switch's upstream port)."""
    host_update: float = 1.0
    """CPU Adam throughput."""
    devices: int = 0
    """Near-storage devices (computational SSDs), each with its own SSD."""
    device_internal: float = 3.0
    """Each device's SSD <-> accelerator bandwidth."""
    device_update: float = 1.0
    """Each device's Adam throughput."""
    shared_disk: bool = False
    """The devices' state lives on the same SSDs as everything else (this machine's PoCL devices)."""
    compute_io_overlap: bool = True
    """Compute runs beside the I/O (a GPU computes while the CPU drives the disks); False on a CPU-only machine,
    where the cores that compute are the ones that copy, hash and submit the I/O."""
    ssd_mixed: float = 0.0
    """Total GB/s per SSD as training sustains it, reads and writes together (``--measure`` runs the engine to get
    it); 0: read time + write time at the rated bandwidths."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Hardware:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown hardware keys {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**values)


MODELED = ("a", "b", "c", "d", "e")
"""The systems ``predict`` models (``smartinf-bench``'s (s) and (q) run the engine's own choices: not modelled here)."""


@dataclass
class Job:
    params: float
    """Trainable parameters: each has a gradient, fp32 master and optimizer state."""
    streamed: float
    """Trainable parameters inside the streamed blocks."""
    tokens: float
    micro_batches: int
    hidden_bytes_per_token: float = 0.0
    frozen: float = 0.0
    """Frozen parameters inside the streamed blocks (a LoRA base): stored once, read with their block in forward and
    backward, no gradient, no state, no update."""
    frozen_resident: float = 0.0
    """Frozen parameters outside the blocks (embeddings, head of a LoRA base): computed with, kept on the device."""
    frozen_itemsize: int = 2
    state_bytes: float = 12.0
    """Bytes of fp32 master and Adam state a trainable parameter keeps on storage with our host update: 12 in fp32,
    about 6 with ``offload.state_precision=8bit`` (update/quant8.py). DeepSpeed's (a) and the devices' are fp32."""

    @property
    def model_params(self) -> float:
        """Every parameter the forward computes with."""
        return self.params + self.frozen + self.frozen_resident


@dataclass
class Prediction:
    system: str
    seconds: float
    parts: dict[str, float]
    bottleneck: str
    host_link_bytes: float
    disk_bytes: float


def machine_of(hw: Hardware) -> Machine:
    """The hardware as the time model reads it (bytes/s, FLOP/s, parameters/s). Disk room is not described: the
    checkpoints and kept graphs of a plan are taken to fit."""
    link = hw.host_link * GB
    return Machine(
        flops=hw.gpus * hw.tflops * 1e12, disk_read=min(hw.ssds * hw.ssd_read * GB, link),
        disk_write=min(hw.ssds * hw.ssd_write * GB, link), update_params_per_s=hw.host_update * 1e9,
        device_memory=int(hw.gpu_memory_gb * GB), host_memory=int(hw.host_memory_gb * GB), graph_storage=2**62,
        disk_mixed=min(hw.ssds * hw.ssd_mixed * GB, link), compute_io_overlap=hw.compute_io_overlap, host_link=link,
        devices=hw.devices, device_internal=hw.device_internal * GB, device_update=hw.device_update * 1e9,
        shared_disk=hw.shared_disk,
    )  # fmt: skip


def workload_of(system: str, job: Job, keep: float = 0.01) -> Workload:
    """System ``system``'s bytes for ``job`` (``keep``: SmartComp's share of gradient values sent, for (e))."""
    p = job.params
    streamed = job.params if system == "a" else job.streamed  # ZeRO-3 swaps the embeddings too
    param_bytes = 2 * streamed + job.frozen_itemsize * job.frozen
    per_micro_batch = round(job.hidden_bytes_per_token * job.tokens / job.micro_batches)  # activation checkpoints
    base = Workload(round(p), round(param_bytes), 0, 0, round(job.tokens), job.micro_batches, per_micro_batch,
                    frozen_params=round(job.frozen + job.frozen_resident))  # fmt: skip
    if system in ("a", "b", "c"):
        state = (12 if system == "a" else job.state_bytes) * p
        return replace(base, step_read_bytes=round(state), step_write_bytes=round(state + 2 * p))
    grads = (keep * (4 + 2) if system == "e" else 4) * p
    return replace(base, step_write_bytes=round(2 * p), near_storage=True, link_bytes=round(grads + 4 * p),
                   device_read_bytes=round(16 * p), device_write_bytes=round(12 * p))


def predict(system: str, job: Job, hw: Hardware, keep: float = 0.01, vertical: bool | None = None) -> Prediction:
    """``vertical`` overrides the system's schedule (Smart-Infinity's own runs are horizontal)."""
    work, machine = workload_of(system, job, keep), machine_of(hw)
    if hw.shared_disk and work.near_storage:  # the devices' state on the host's disk: 12 B/param each way
        work.device_read_bytes = work.device_write_bytes = round(12 * job.params)
    vertical = system in ("c", "d", "e") if vertical is None else vertical
    parts = predict_time(work, machine, vertical, job.micro_batches, 1.0 if vertical else 0.0,
                         keep=1.0 if system == "a" else 0.0, in_turn=system == "a")  # fmt: skip
    disk = sum(disk_bytes(work, machine, vertical, job.micro_batches))
    host_link = disk  # the host update: every disk byte crosses host memory
    if work.near_storage:  # gradients out and parameters back; the devices' own I/O stays behind the link
        host_link = param_read_bytes(work, vertical, job.micro_batches) + work.link_bytes + work.step_write_bytes
    shown = {k: v for k, v in parts.items() if k not in ("step", "step_hidden", "disk", "total", "graphs_io")}
    bottleneck = max((v, k) for k, v in shown.items())[1]
    return Prediction(system, parts["total"], parts, bottleneck, host_link, disk)


def memory_needs(job: Job, hw: Hardware, system: str, layers: int, subgroup: int = 1 << 24) -> dict[str, float]:
    """Bytes per tier with the engine's default settings (prefetch 1, step lookahead 1; docs/engine.md, Memory).

    Device: the resident parameters (16-bit), three streamed blocks in flight, the block-boundary activation
    checkpoints of all micro-batches (vertical) or of one (horizontal). Host: fp32 gradients (offload.grads=cpu),
    the fixed buffer pools. Storage: 16-bit parameters, and 12 B/param of fp32 master and Adam state on the host's
    SSDs (host update) or spread over the devices' (SmartUpdate)."""
    p = job.params
    block = job.streamed / max(layers, 1)
    frozen_block = job.frozen * job.frozen_itemsize / max(layers, 1)
    sg = min(subgroup, block)
    vertical = system in ("c", "d", "e")
    checkpoints = job.hidden_bytes_per_token * job.tokens / (1 if vertical else job.micro_batches)
    needs = {
        "device": 2 * (p - job.streamed) + job.frozen_itemsize * job.frozen_resident
        + 3 * (2 * block + frozen_block) + checkpoints,
        "host": 4 * p + 3 * (2 * block + frozen_block) + 4 * sg * (4 + 3 * 3) + 4 * block,
        "storage (host SSDs)": 2 * job.streamed + job.frozen_itemsize * job.frozen
        + (12 * p if system == "a" else job.state_bytes * p if system in ("b", "c") else 0),
    }
    if system in ("d", "e"):
        needs["storage (per device)"] = 12 * p / max(hw.devices, 1)
    return needs


def describe(predictions: list[Prediction], job: Job) -> str:
    base = next((x for x in predictions if x.system == "a"), None)
    lines = [
        "| system | predicted s/iteration | tokens/s | vs (a) | bottleneck | host link B/param | disk GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in predictions:
        ratio = f"{base.seconds / x.seconds:.2f}x" if base else "-"
        lines.append(
            f"| ({x.system}) {NAMES[x.system]} | {x.seconds:.2f} | {job.tokens / x.seconds:,.0f} | {ratio} | "
            f"{x.bottleneck} | {x.host_link_bytes / job.model_params:.1f} | {x.disk_bytes / GB:.1f} |"
        )
    return "\n".join(lines)
