"""A performance model of systems (a)-(e) on any hardware: what ``smartinf-plan`` prints and docs/ validates.

Per iteration of P parameters (P_s of them streamed), T tokens in M micro-batches, mixed-precision Adam:

    storage      R = min(ssds x read, host link),  W = min(ssds x write, host link)   (RAID-0 behind one link)
    compute      c x P x T / (gpus x FLOP/s)        c = 6, or 8 where the block forward is recomputed
    params       2 B x P_s read in forward and in backward: x M (horizontal) or x 1 (vertical); a frozen base's
                 F streamed parameters likewise, at their own itemsize, with no step (LoRA: P is the adapters)
    host step    12 B/param read, 12 + 2 B/param written (master, m, v; new 16-bit params), CPU Adam alongside
    smart step   8 B/param over the host link (fp32 gradient out, fp32 parameter back; SmartComp: ~0.06 + 4),
                 16 B read + 12 B written per param inside each device, P / k params per device
    iteration    (a):        compute + params + step                           (ZeRO-Infinity: phases in turn)
                 (b):        max(compute, params) + step                       (prefetch hides one of the two)
                 (c)-(e):    max(disk total, max(compute, params) + step - hidden)
                             hidden = min(step, forward) : the step overlaps the next forward (overlap = 1)

The storage devices are shared: under (c)-(e) all disk traffic of an iteration must also fit in it. The model has
no fudge factors; docs/benchmarks.md compares it with smartinf-bench on this machine and says where it errs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_smartinf.bench.systems import NAMES
from lightning_smartinf.errors import ConfigError

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


def predict(system: str, job: Job, hw: Hardware, keep: float = 0.01, vertical: bool | None = None) -> Prediction:
    """``vertical`` overrides the system's schedule (Smart-Infinity's own runs are horizontal)."""
    p, t, m = job.params, job.tokens, job.micro_batches
    read = min(hw.ssds * hw.ssd_read, hw.host_link) * GB
    write = min(hw.ssds * hw.ssd_write, hw.host_link) * GB
    mixed = min(hw.ssds * hw.ssd_mixed, hw.host_link) * GB

    def disk_time(r: float, w: float) -> float:
        return (r + w) / mixed if mixed else r / read + w / write

    flops = hw.gpus * hw.tflops * 1e12
    compute = (6 if system == "a" else 8) * job.model_params * t / flops
    vertical = system in ("c", "d", "e") if vertical is None else vertical
    streamed = job.params if system == "a" else job.streamed  # ZeRO-3 swaps the embeddings too
    param_bytes = 2 * (2 * streamed + job.frozen_itemsize * job.frozen) * (1 if vertical else m)
    params_io = disk_time(param_bytes, 0.0)
    if system in ("a", "b", "c"):
        state = 12 * p if system == "a" else job.state_bytes * p
        step_read, step_write = state, state + 2 * p
        step_io, host_update = disk_time(step_read, step_write), p / (hw.host_update * 1e9)
        step = max(step_io, host_update)
        host_link = param_bytes + step_read + step_write
        disk_read, disk_write = param_bytes + step_read, step_write
        parts = {"compute": compute, "params_io": params_io, "step_io": step_io, "host_update": host_update}
    else:
        grads = (keep * (4 + 2) if system == "e" else 4) * p
        wire = grads + 4 * p  # gradients out, fp32 parameters back
        k = max(hw.devices, 1)
        internal = 28 * p / k / (hw.device_internal * GB)
        if hw.shared_disk:  # the devices' "internal" traffic (state; gradients come from host memory) is the disk's
            internal = disk_time(12 * p, 12 * p)
        update = p / k / (hw.device_update * 1e9)
        params_write = 2 * p / write
        step = max(wire / (hw.host_link * GB), internal, update) + params_write
        host_link = param_bytes + wire + 2 * p
        disk_read = param_bytes + (12 * p if hw.shared_disk else 0)
        disk_write = 2 * p + (12 * p if hw.shared_disk else 0)
        parts = {"compute": compute, "params_io": params_io, "host_link": wire / (hw.host_link * GB),
                 "device_internal": internal, "device_update": update, "params_write": params_write}  # fmt: skip
    forward_backward = max(compute, params_io) if hw.compute_io_overlap else compute + params_io
    if vertical:
        hidden = min(step, compute / 4) if hw.compute_io_overlap else 0.0  # the step overlaps the next forward
        disk_total = disk_time(disk_read, disk_write)
        seconds = max(disk_total, forward_backward + step - hidden)
        parts["step_hidden"] = hidden
    elif system == "a":  # ZeRO-Infinity sits near the sum of its phases (docs/benchmarks.md)
        seconds = compute + params_io + step
    else:
        seconds = forward_backward + step
    bottleneck = max((v, k) for k, v in parts.items() if k != "step_hidden")[1]
    return Prediction(system, seconds, parts, bottleneck, host_link, disk_read + disk_write)


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
