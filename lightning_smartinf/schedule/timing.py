"""The one model of iteration time: what ``schedule=auto`` plans with and what ``smartinf-plan`` predicts with.

An iteration of the streamed blocks' forward and backward, beside the disk traffic of the 16-bit parameters (and of
the graphs kept on storage), then the optimizer step, part of which hides behind the next forward:

    forward      = 2 x block parameters (trainable and frozen) x tokens / FLOP/s
    compute      = (4 - k - s) x forward + 3 x resident forward
                   (forward, the backward's recompute unless a share k of the graphs is kept in memory or s on
                   storage, backward at twice a forward; resident layers: measured, never recomputed)
    params_io    = 2 x streamed 16-bit bytes x (1 vertical, M horizontal) at the disk's read speed
    graphs_io    = s x blocks x one block's graph bytes, written and read back
    step         = max(step I/O, the update's terms)      host update:  params / update rate
                                                          near-storage: max(link, device I/O, device update)
                                                                        then the 16-bit parameters written back
    hidden       = min(overlap x step, forward + resident forward)     (0 where compute and I/O share the cores)
    iteration    = max(fb + step - hidden, all of the iteration's disk bytes at the disk's speeds)
                   fb = max(compute, params_io + graphs_io), or their sum where compute and I/O share the cores
    phases in turn (ZeRO-Infinity): compute + params_io + step

Disk time is reads at the read speed plus writes at the write speed, or, where the machine gives the rate training
sustains for both together (``Machine.disk_mixed``), their sum at that rate. ``schedule/planner.py`` searches this
model for the best micro-batches, overlap and graph placement; ``bench/model.py`` describes systems (a)-(e) in its
terms for ``smartinf-plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

INF = float("inf")


@dataclass
class Machine:
    """Measured speeds and limits (``planner.measure_machine``), or a description of hardware we do not have
    (``smartinf-plan --hardware``). Bytes and bytes/s."""

    flops: float
    """Training FLOP/s of all training devices together."""
    disk_read: float
    """Storage to host memory (several SSDs behind one link: the smaller of their sum and the link)."""
    disk_write: float
    update_params_per_s: float
    """The host's optimizer update."""
    device_memory: int
    host_memory: int
    activation_memory: int = 0
    """Bytes kept forward graphs may take (on a CPU device, what ``offload.host_memory_budget`` leaves)."""
    graph_storage: int = 0
    """Bytes of disk kept graphs and activation checkpoints may take (free space under the state directory, less a
    margin)."""
    disk_mixed: float = 0.0
    """Reads and writes together as training sustains them (0: read time plus write time at the two speeds)."""
    compute_io_overlap: bool = True
    """Compute runs beside the I/O (a GPU computes while the CPU drives the disks); False on a CPU-only machine,
    where the cores that compute are the ones that copy, hash and submit the I/O."""
    host_link: float = INF
    """The one link between host memory and the near-storage devices (a PCIe switch's upstream port)."""
    devices: int = 0
    """Near-storage devices (SmartUpdate)."""
    device_internal: float = INF
    """Each device's own SSD to accelerator bandwidth."""
    device_update: float = INF
    """Each device's optimizer update, parameters/s."""
    shared_disk: bool = False
    """The devices' state lives on the host's disk (PoCL devices on this machine): their I/O is the disk's."""

    def disk_seconds(self, read: float, write: float) -> float:
        return (read + write) / self.disk_mixed if self.disk_mixed else read / self.disk_read + write / self.disk_write


@dataclass
class Workload:
    params: int
    """Trainable parameters: each has a gradient and is stepped."""
    streamed_param_bytes: int
    """16-bit bytes one pass over the streamed blocks reads from storage (a frozen base's included)."""
    step_read_bytes: int
    """The step's reads from the host's storage (host update: gradients, master and state on disk)."""
    step_write_bytes: int
    """The step's writes to the host's storage (master and state, the new 16-bit parameters)."""
    tokens_per_batch: int
    batch_size: int
    checkpoint_bytes_per_sample: int
    """Hidden-state bytes of one sequence summed over all block boundaries."""
    blocks: int = 0
    """Streamed blocks (each recomputed in backward unless its graph is kept)."""
    kept_block_bytes: int = 0
    """Bytes one streamed block's kept forward graph holds over the whole batch (0: unknown, keep none)."""
    resident_params: int = 0
    """Parameters outside the streamed blocks (embeddings, head, norms), timed apart in ``resident_forward_s``."""
    resident_forward_s: float = 0.0
    """Seconds of one forward of the resident layers and the loss over the whole batch, measured: a vocabulary-wide
    head runs at its own rate, not a block's (0 with ``resident_params=0``: every parameter at the block rate)."""
    frozen_params: int = 0
    """Parameters the forward computes with but never steps (a LoRA base)."""
    near_storage: bool = False
    """The update runs on the near-storage devices (SmartUpdate): the step's terms are theirs."""
    link_bytes: int = 0
    """Near-storage: bytes over the host link in the step (gradients out, fp32 parameters back)."""
    device_read_bytes: int = 0
    """Near-storage: bytes the devices read from their own SSDs in the step (state, and gradients staged there)."""
    device_write_bytes: int = 0


def step_terms(work: Workload, machine: Machine) -> dict[str, float]:
    """The optimizer step's terms in seconds; the step takes their largest (``step_seconds``)."""
    io = machine.disk_seconds(work.step_read_bytes, work.step_write_bytes)
    if not work.near_storage:
        return {"step_io": io, "host_update": work.params / machine.update_params_per_s}
    k = max(machine.devices, 1)
    if machine.shared_disk:  # the devices' own reads and writes are the host disk's
        internal = machine.disk_seconds(work.device_read_bytes, work.device_write_bytes)
    else:
        internal = (work.device_read_bytes + work.device_write_bytes) / k / machine.device_internal
    return {"host_link": work.link_bytes / machine.host_link, "device_internal": internal,
            "device_update": work.params / k / machine.device_update, "params_write": io}  # fmt: skip


def step_seconds(terms: dict[str, float]) -> float:
    """Near-storage: the devices' update, then the parameters written back; host: I/O beside the update."""
    if "params_write" in terms:
        return max(terms["host_link"], terms["device_internal"], terms["device_update"]) + terms["params_write"]
    return max(terms.values())


def param_read_bytes(work: Workload, vertical: bool, micro_batches: int) -> float:
    """16-bit bytes read for the streamed blocks in forward and backward: once a pass (vertical), or once a
    micro-batch (horizontal)."""
    return 2 * work.streamed_param_bytes * (1 if vertical else micro_batches)


def disk_bytes(work: Workload, machine: Machine, vertical: bool, micro_batches: int,
               spill: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(read, written) bytes of the host's disk in one iteration: parameters, graphs kept on storage (a share
    ``spill`` of the blocks), the step's own, and the near-storage devices' where they share the disk."""
    graphs = spill * work.blocks * work.kept_block_bytes
    read = param_read_bytes(work, vertical, micro_batches) + graphs + work.step_read_bytes
    written = graphs + work.step_write_bytes
    if machine.shared_disk:
        read, written = read + work.device_read_bytes, written + work.device_write_bytes
    return read, written


def predict(work: Workload, machine: Machine, vertical: bool, micro_batches: int, overlap: float,
            keep: float = 0.0, spill: float = 0.0, in_turn: bool = False) -> dict[str, float]:  # fmt: skip
    """Predicted seconds per iteration (``total``) and its parts. ``keep``: the share of blocks whose graphs are kept
    in memory; ``spill``: on storage; ``in_turn``: the phases run one after another (ZeRO-Infinity)."""
    block_params = work.params + work.frozen_params - work.resident_params
    forward = 2.0 * block_params * work.tokens_per_batch / machine.flops
    compute = (4.0 - keep - spill) * forward + 3.0 * work.resident_forward_s
    params_io = machine.disk_seconds(param_read_bytes(work, vertical, micro_batches), 0)
    graph_bytes = spill * work.blocks * work.kept_block_bytes
    graphs_io = machine.disk_seconds(graph_bytes, graph_bytes)
    terms = step_terms(work, machine)
    step = step_seconds(terms)
    disk = params_io + graphs_io
    hidden = min(overlap * step, forward + work.resident_forward_s) if machine.compute_io_overlap else 0.0
    forward_backward = max(compute, disk) if machine.compute_io_overlap else compute + disk
    disk_total = machine.disk_seconds(*disk_bytes(work, machine, vertical, micro_batches, spill))
    if in_turn:
        total = compute + disk + step
    else:  # the disk serves one request at a time: all its bytes bound the iteration too
        total = max(forward_backward + step - hidden, disk_total)
    return {"compute": compute, "params_io": params_io, "graphs_io": graphs_io, **terms, "step": step,
            "step_hidden": hidden, "disk": disk_total, "total": total}  # fmt: skip
