"""What the schedule planner needs to know about an engine's workload and this machine's update speed."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from lightning_smartinf.config import ScheduleConfig
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.schedule.kept import activation_bytes
from lightning_smartinf.schedule.parked import ParkedVertical
from lightning_smartinf.schedule.planner import Plan, kept_share, measure_machine, plan, spilled_share
from lightning_smartinf.schedule.timing import Machine, Workload, predict
from lightning_smartinf.schedule.vertical import CheckpointTiers, VerticalSchedule, has_protocol
from lightning_smartinf.schedule.window import tokens_of
from lightning_smartinf.update import quant8
from lightning_smartinf.update.optimizers import torch_update
from lightning_smartinf.update.smart import SmartUpdater

if TYPE_CHECKING:
    from lightning_smartinf.engine.engine import OffloadEngine

log = logging.getLogger(__name__)


def workload_of(engine: OffloadEngine, batch: Any, checkpoint_bytes_per_sample: int,
                kept_block_bytes: int = 0, resident_forward_s: float = 0.0) -> Workload:  # fmt: skip
    """Bytes and tokens of one iteration on ``batch`` (a (b, t+1) token tensor, any (b, ...) tensor, or a dict of
    them). The disk bytes leave out what ``offload.host_memory_budget`` (or ``offload.params=cpu``,
    ``offload.grads=cpu``) placed in host memory."""
    params = engine.layout.num_params
    placed = sum(sg.numel for sg in engine.layout.subgroups if sg.key in engine.placement.params)
    streamed_on_disk = sum(b.numel for b in engine.layout.streamed) - placed if engine.cfg.params == "nvme" else 0
    streamed = streamed_on_disk * engine.itemsize
    states = len(engine.rule.states) if engine.rule else 0
    local = engine.layout.local_numel  # the elements this rank steps (all of them on one process)
    state_bytes = sum((4 + states * quant8.bytes_per_element(sg.precision)) * sg.numel
                      for sg in engine.layout.subgroups) / max(local, 1)  # master and optimizer state, per element
    grads_on_disk = engine.cfg.grads == "nvme" and not engine.placement.grads
    grad_read = 4 * local if grads_on_disk else 0
    params_write = engine.itemsize * (local - placed) if engine.cfg.params == "nvme" else 0
    near = isinstance(engine.updater, SmartUpdater)
    link = device_read = device_write = 0
    if near:  # gradients out, fp32 parameters back over the link; the devices read gradient and state, write state
        state = round(state_bytes * local)
        ratio = 1.0 if engine.compressor is None else engine.compressor.summary()["wire_ratio"]
        grads = round(4 * local * ratio)
        link, device_read, device_write = grads + 4 * local, grads + state, state
        step_read, step_write = 0, params_write
    else:  # gradient, master and state in; master and state out; 16-bit params out
        on_disk = local - sum(sg.numel for sg in engine.layout.subgroups if sg.key in engine.placement.state)
        state = round(state_bytes * on_disk)
        step_read = grad_read + state
        step_write = state + params_write
    if isinstance(batch, torch.Tensor):
        sequences = batch.shape[0]
        tokens = sequences * max(batch.shape[1] - 1, 1) if batch.dim() > 1 else sequences
    else:
        sequences, tokens = tokens_of(batch)
    resident = engine.layout.resident.numel if resident_forward_s else 0  # else timed at the block rate
    frozen = engine.frozen_layout.num_params - (engine.frozen_layout.resident.numel if resident_forward_s else 0)
    return Workload(params, streamed, step_read, step_write, tokens, sequences, checkpoint_bytes_per_sample,
                    blocks=len(engine.layout.streamed), kept_block_bytes=kept_block_bytes, resident_params=resident,
                    resident_forward_s=resident_forward_s, frozen_params=frozen,
                    near_storage=near, link_bytes=link, device_read_bytes=device_read,
                    device_write_bytes=device_write)  # fmt: skip


def update_rate(engine: OffloadEngine, numel: int = 1 << 21) -> float:
    """Parameters per second of the optimizer math on this host (a short in-memory probe)."""
    if engine.rule is None or engine.optimizer is None:
        return float("inf")
    master, grad = torch.randn(numel), torch.randn(numel)
    state = {s.kind: torch.zeros(numel) for s in engine.rule.states}
    hyper = {k: v for k, v in engine.optimizer.param_groups[0].items() if k != "params"}
    torch_update(engine.rule, master, grad, state, hyper, 1)
    start = time.perf_counter()
    torch_update(engine.rule, master, grad, state, hyper, 2)
    return numel / (time.perf_counter() - start)


def block_flops(engine: OffloadEngine, hidden: torch.Tensor) -> float:
    """FLOP/s this model's first streamed block reaches on ``hidden`` (a batch's hidden states): 2 x its parameters x
    tokens over the best of two timed forwards. Real blocks (attention, norms, small matmuls) run well below a large
    matmul's rate, and the planner's compute term should see the rate the model gets."""
    if not engine.layout.streamed:
        return float("inf")
    for streamer in engine.streamers:
        streamer.fetch(1)
    try:
        seconds = float("inf")
        with torch.no_grad():
            for _ in range(2):
                start = time.perf_counter()
                engine.block_forwards[0](hidden)
                if hidden.device.type == "cuda":
                    torch.cuda.synchronize(hidden.device)
                seconds = min(seconds, time.perf_counter() - start)
    finally:
        for streamer in engine.streamers:
            streamer.release(1)
    tokens = hidden.numel() // hidden.shape[-1]
    return 2.0 * first_block_numel(engine) * tokens / seconds


def kept_block_bytes(engine: OffloadEngine, hidden: torch.Tensor) -> int:
    """Bytes the first streamed block's kept forward graph holds on ``hidden`` (the whole batch's hidden states)."""
    if not engine.layout.streamed:
        return 0
    for streamer in engine.streamers:
        streamer.fetch(1)
    try:
        return activation_bytes(engine.block_forwards[0], hidden, engine.block_parameters(1))
    finally:
        for streamer in engine.streamers:
            streamer.release(1)


def activation_memory(engine: OffloadEngine) -> int:
    """Bytes kept forward graphs may take: on a CPU device, what ``offload.host_memory_budget`` leaves after its
    placement (the budget comes first to parameters, gradients and optimizer state, which save disk traffic, then
    to graphs, which save compute); on a GPU, the share of free device memory the schedule's checkpoints also draw
    from."""
    if engine.device.type == "cuda":
        return memory_budget(engine.device)
    return max(0, engine.placement.budget - engine.placement.nbytes)


def memory_budget(device: torch.device, share: float = 0.25) -> int:
    """Bytes the schedule may use for activation checkpoints on ``device``: a share of what is free now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * share)
    return int(psutil.virtual_memory().available * share)


def resident_forward_seconds(vertical_pre: Callable[[torch.Tensor], torch.Tensor],
                             vertical_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             batch: torch.Tensor) -> float:  # fmt: skip
    """Seconds of the resident layers' forward and the loss over ``batch`` (the better of two): with a large
    vocabulary the head is a good share of the compute and runs at its own rate."""
    seconds = float("inf")
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            loss = vertical_loss(vertical_pre(batch), batch)
            if loss.device.type == "cuda":
                torch.cuda.synchronize(loss.device)
            seconds = min(seconds, time.perf_counter() - start)
    return seconds


def probe_size(work: Workload) -> int:
    """Bytes of the disk probe: 128 MiB, or an iteration's parameter and step traffic where that is smaller (at least
    4 MiB): a small model's plan needs no bigger probe than the traffic it predicts."""
    traffic = 2 * work.streamed_param_bytes + work.step_read_bytes + work.step_write_bytes
    return min(128 * 2**20, max(4 * 2**20, -(-traffic // 2**20) * 2**20))  # whole MiB: O_DIRECT-aligned requests


def measure(engine: OffloadEngine, work: Workload) -> Machine:
    """This machine's speeds and memory limits as the engine sees them (its device, its disk through its backend, its
    optimizer's update rate), the disk probe sized to ``work``."""
    machine = measure_machine(engine.device, engine.root, engine.backend, update_rate(engine), engine.param_dtype,
                              memory_budget(engine.device), memory_budget(torch.device("cpu")), probe_size(work))
    if isinstance(engine.updater, SmartUpdater):  # each device updates at the host's rate at most, on its directory
        machine.devices = len(engine.updater.devices)
        machine.device_update = machine.update_params_per_s
        machine.shared_disk = any(same_disk(d.directory, engine.root) for d in engine.updater.devices)
        if not machine.shared_disk:
            machine.device_internal = machine.disk_read
    return machine


def same_disk(path: Path, other: Path) -> bool:
    """Whether two directories lie on one file system (a near-storage device's state on the host's own disk, as
    PoCL devices keep it, shares the disk's bandwidth with everything else)."""
    return os.stat(path).st_dev == os.stat(other).st_dev


def plan_schedule(engine: OffloadEngine, vertical_pre: Callable[[torch.Tensor], torch.Tensor],
                  vertical_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: torch.Tensor,
                  forward_context: Callable[[], AbstractContextManager[Any]],
                  choices: list[int] | None = None) -> Plan:  # fmt: skip
    """``schedule=auto``: the vertical schedule for ``batch``, planned from short measurements of this machine, of
    the model's own blocks on the batch's hidden states and of its resident layers (``choices``: the micro-batch
    counts allowed; default the divisors of the batch)."""
    with torch.no_grad(), forward_context():
        hidden = vertical_pre(batch)
        flops = block_flops(engine, hidden)
        resident_s = resident_forward_seconds(vertical_pre, vertical_loss, batch)
    with forward_context():
        kept = kept_block_bytes(engine, hidden)
    boundaries = len(engine.layout.streamed) + 1
    work = workload_of(engine, batch, hidden[0].numel() * hidden.element_size() * boundaries, kept, resident_s)
    machine = measure(engine, work)
    machine.activation_memory = activation_memory(engine)
    machine.graph_storage = graph_storage(engine)
    log.info("schedule=auto: the model's blocks run at %.3g TFLOP/s here (a 2048^3 matmul: %.3g); the forward of "
             "its resident layers and loss takes %.3g s per batch", flops / 1e12, machine.flops / 1e12,
             resident_s)  # fmt: skip
    return plan(work, dataclasses.replace(machine, flops=min(flops, machine.flops)), choices=choices)


def plan_parked(engine: OffloadEngine, batch: Any, micro_batches: int) -> Plan:
    """``schedule=auto`` for a module without ``vertical_pre``/``vertical_loss`` (a Hugging Face or litgpt model):
    its blocks run only from inside its training_step, so compute is estimated at the matmul rate, and its kept
    graphs are estimated from the blocks' width (``estimated_graph_bytes``) and sized as they run, within the memory
    the host budget leaves (``Plan.keep_bytes``); those it does not hold go to storage where that is predicted
    faster than recomputing them."""
    work = workload_of(engine, batch, 0)
    work.kept_block_bytes = estimated_graph_bytes(engine, work.tokens_per_batch)
    machine = measure(engine, work)
    machine.activation_memory = keep_bytes = activation_memory(engine)
    machine.graph_storage = graph_storage(engine)
    keep = kept_share(work, machine)
    spill = spilled_share(work, machine, keep)
    parts = predict(work, machine, True, micro_batches, 1.0, keep, spill)
    overlap = 1.0 if parts["step"] else 0.0  # never slower: each block waits only for its own update
    return Plan(micro_batches, overlap, 0.0, 0.0, parts["total"], parts, keep_bytes=keep_bytes,
                spill_activations=spill, workload=work, machine=machine)  # fmt: skip


def estimated_graph_bytes(engine: OffloadEngine, tokens: int) -> int:
    """Bytes one streamed block's kept forward graph holds over ``tokens``, for a block that cannot run alone: a
    transformer block of width d has about 12 d^2 parameters and saves about 16 d activations per token (GPT-2's
    block measured by ``kept_block_bytes``: 16.0 d; Llama's is alike), in the parameters' dtype."""
    if not engine.layout.streamed:
        return 0
    return int(16 * math.sqrt(first_block_numel(engine) / 12) * engine.itemsize * tokens)


def first_block_numel(engine: OffloadEngine) -> int:
    """Parameters of the first streamed block, trainable and frozen (the blocks are alike)."""
    return engine.layout.blocks[1].numel + engine.frozen_layout.blocks[1].numel


def graph_storage(engine: OffloadEngine) -> int:
    """Disk bytes kept graphs may take: half the free space under the state directories (checkpoints and the
    state's own growth keep the rest)."""
    return sum(shutil.disk_usage(root).free for root in engine.disk.roots) // 2


def vertical_schedule(engine: OffloadEngine, module: Any, s: ScheduleConfig, accumulate: int, clipping: bool,
                      device: torch.device,
                      keep_bytes: int | None = None) -> VerticalSchedule | ParkedVertical:  # fmt: skip
    """The vertical schedule ``s`` describes for ``module``: the explicit protocol's where the module has
    ``vertical_pre``/``vertical_loss`` (the fast path: checkpoints may go to host memory or storage), else its own
    training_step parked at every block (its kept graphs: the ``keep_activations`` share of the blocks, or as many
    as ``keep_bytes`` holds). One pass takes at most ``s.micro_batches`` x ``accumulate`` micro-batches;
    ``clipping``: gradient clipping or fp16 loss scaling is on (both need the global norm before any update)."""
    engine.configure_step(overlap=s.overlap)
    if s.eager_update and clipping:
        raise ConfigError(
            "schedule.eager_update starts block updates before backward ends, so it cannot honour "
            "gradient_clip_val or fp16 loss scaling (both need the global gradient norm first): turn one off"
        )
    most = s.micro_batches * accumulate  # micro-batches of one pass at most
    if not has_protocol(module):
        rounds = round(s.keep_activations * len(engine.layout.streamed)) if keep_bytes is None else sys.maxsize
        return ParkedVertical(engine, most, s.eager_update, rounds, sys.maxsize if keep_bytes is None else keep_bytes,
                              spill=s.spill_activations > 0)  # fmt: skip
    tiers = CheckpointTiers(most, s.checkpoint_host, s.checkpoint_nvme, engine.disk, engine.counters, device)
    return VerticalSchedule(engine, most, tiers, s.eager_update, s.keep_activations, s.spill_activations)
