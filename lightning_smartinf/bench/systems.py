"""The systems ``smartinf-bench`` compares, and the DeepSpeed ZeRO-Infinity configuration it runs as the baseline.

(a) DeepSpeed ZeRO-Infinity: the real engine, ZeRO-3, parameters and optimizer state on NVMe, DeepSpeedCPUAdam.
(s) smart_infinity as a user runs it: every setting at its default but the state directory and the host memory
    budget, micro-batches the Lightning way (``accumulate_grad_batches``).
(q) (s) with its optimizer state stored in 8 bits (``offload.state_precision=8bit``, update/quant8.py).
(b) smart_infinity, horizontal schedule, host update: the same data flow as (a), our engine (gradients in host
    memory like DeepSpeed's; params and optimizer state on disk).
(c) + vertical schedule, optimizer-step overlap and kept activations (no recompute) (GreedySnake).
(v) (c) with its optimizer state stored in 8 bits: the step's disk bytes and CPU time in the overlapped schedule.
(d) + SmartUpdate on k near-storage devices (Smart-Infinity).
(e) + SmartComp, top-k 1% with error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEMS = ("a", "s", "q", "b", "c", "v", "d", "e")
NAMES = {
    "a": "DeepSpeed ZeRO-Infinity",
    "s": "smart_infinity, defaults",
    "q": "smart_infinity, defaults, 8-bit state",
    "b": "smart_infinity horizontal",
    "c": "+ vertical + overlap",
    "v": "+ vertical + overlap, 8-bit state",
    "d": "+ SmartUpdate",
    "e": "+ SmartComp",
}


@dataclass
class Workload:
    """What every system trains: the same model, tokens, global batch and precision, state on the same disk."""

    model: dict[str, Any]
    seq_len: int
    micro_batch: int
    micro_batches: int
    precision: str
    nvme_path: str
    devices: int = 2
    warmup: int = 1
    steps: int = 3
    subgroup_size: int = 1 << 24
    accelerator: str = "cpu"
    catch_up: bool = False
    """(e) runs SmartComp with ``compression.catch_up`` (docs/compression.md)."""
    keep_activations: float = 1.0
    """(c)-(e): ``schedule.keep_activations``, the share of blocks whose backward needs no recompute."""
    host_memory_budget: str = "auto"
    """(s)-(e): ``offload.host_memory_budget`` (optimizer state in RAM; their gradients are in RAM anyway), ``auto``
    as the engine's default; give a size to compare with DeepSpeed at a host memory of your choosing."""
    family: str = "gpt"
    """``gpt``: the shipped GPT (its vertical protocol); ``llama``: a transformers Llama of the same shape (hidden
    size, layers, heads; MLP width 8/3 of the hidden size, so a block holds as many parameters), trained through
    its own forward."""

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.micro_batches * self.seq_len


def deepspeed_config(w: Workload, nvme_path: str) -> dict[str, Any]:
    """ZeRO-3 with params and optimizer on NVMe, tuned as DeepSpeed's docs advise rather than left at defaults:
    aio ``intra_op_parallelism`` (the old ``thread_count`` key is ignored by current DeepSpeed), 1 MiB blocks,
    queue depth 32, overlapped events. Each swapped parameter tensor takes a whole buffer, so the buffers are sized
    to the largest tensor (the embedding) and counted to hold two blocks' four weight matrices plus the embedding
    in flight (DeepSpeed's default of 5 fails with "Not enough buffers" once prefetch runs ahead); optimizer state
    swapped in 4 buffers of one sub-group each; prefetch of a block's worth of parameters."""
    n_embd = w.model["n_embd"]
    largest = max(w.model["vocab_size"] * n_embd, 4 * n_embd * n_embd)
    bf16 = w.precision.startswith("bf16")
    return {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": w.micro_batches,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": w.precision.startswith("16")},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme", "nvme_path": nvme_path, "pin_memory": w.accelerator != "cpu",
                "buffer_count": 12, "buffer_size": largest, "max_in_cpu": 0,
            },
            "offload_optimizer": {
                "device": "nvme", "nvme_path": nvme_path, "pin_memory": w.accelerator != "cpu", "buffer_count": 4,
                "fast_init": False,
            },
            "sub_group_size": w.subgroup_size,
            "stage3_prefetch_bucket_size": 12 * n_embd * n_embd,
            "stage3_param_persistence_threshold": 10 * n_embd,
            "stage3_max_live_parameters": int(largest * 2),
            "stage3_max_reuse_distance": int(largest * 2),
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "aio": {
            "block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": False,
            "overlap_events": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "wall_clock_breakdown": False,
    }  # fmt: skip


def strategy_settings(system: str, w: Workload, nvme_path: str) -> dict[str, Any]:
    """The SmartInfinityStrategy keywords of systems (s)-(e)."""
    if system in ("s", "q"):
        precision = {"state_precision": "8bit"} if system == "q" else {}
        return {"offload": {"nvme_path": nvme_path, "host_memory_budget": w.host_memory_budget, **precision}}
    settings: dict[str, Any] = {  # fp32 gradients accumulate in host memory, as DeepSpeed's do
        "offload": {"nvme_path": nvme_path, "subgroup_size": w.subgroup_size, "grads": "cpu",
                    "host_memory_budget": w.host_memory_budget},
        "update": {"backend": "host"},
        "schedule": {"kind": "horizontal"},
    }
    if system == "v":
        settings["offload"]["state_precision"] = "8bit"
    if system in ("c", "v", "d", "e"):
        settings["schedule"] = {"kind": "vertical", "micro_batches": w.micro_batches, "overlap": 1.0,
                                "keep_activations": w.keep_activations}
    if system in ("d", "e"):
        settings["update"] = {"backend": "smart", "devices": w.devices}
    if system == "e":
        settings["compression"] = {"kind": "topk", "keep": 0.01, "error_feedback": True, "catch_up": w.catch_up}
    return settings
