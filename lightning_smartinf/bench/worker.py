"""One system of ``smartinf-bench`` in its own process: ``python -m lightning_smartinf.bench.worker SPEC OUT``.

A fresh process per run keeps DeepSpeed's global state, the distributed group, the page cache pressure and the
peak-memory reading of one system from leaking into another's. Every system is timed the same way: wall time
between consecutive optimizer steps after the warm-up, and the disk's own byte counters (``/proc/diskstats``) over
the same steps. ``compute`` is not a system but the bound's compute term, measured the same way, with the update
of the whole model timed alone beside it.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from lightning_smartinf.bench.systems import Workload, deepspeed_config, strategy_settings
from lightning_smartinf.ecosystem import hf
from lightning_smartinf.extras import require
from lightning_smartinf.models.gpt import GPT, GPTConfig, GPTModule
from lightning_smartinf.ops import use_environment_extensions_dir


def llama_config(w: Workload) -> Any:
    """A transformers Llama of the workload's GPT shape: the same hidden size, layers and heads, an MLP 8/3 as wide
    (rounded to 64) so that a block holds as many parameters as a GPT block."""
    d, m = w.model["n_embd"], w.model
    shape = {"vocab_size": m["vocab_size"], "hidden_size": d, "intermediate_size": round(8 * d / 3 / 64) * 64,
             "num_hidden_layers": m["n_layer"], "num_attention_heads": m["n_head"]}  # fmt: skip
    return hf.load_config(None, {"model_type": "llama", **shape, "max_position_embeddings": max(w.seq_len, 16),
                                 "tie_word_embeddings": False})  # fmt: skip


class _Logits(torch.nn.Module):
    """A transformers causal LM as ``tokens -> logits``, as GPT is called."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def build_model(w: Workload) -> torch.nn.Module:
    """The workload's model, called ``model(tokens) -> logits``."""
    if w.family == "llama":
        return _Logits(hf.build_model(llama_config(w)))
    return GPT(GPTConfig(**w.model))


def disk_of(path: Path) -> str | None:
    """The block device (as /proc/diskstats names it) holding ``path``, or None where it cannot be told."""
    dev = os.stat(path).st_dev
    sys_path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    return sys_path.resolve().name if sys_path.exists() else None


@dataclass
class Sample:
    time: float
    read: int
    written: int


def sample(disk: str | None) -> Sample:
    counters = psutil.disk_io_counters(perdisk=True).get(disk) if disk else None
    return Sample(time.perf_counter(), counters.read_bytes if counters else 0, counters.write_bytes if counters else 0)


def summarize(samples: list[Sample], warmup: int, w: Workload, extra: dict[str, Any]) -> dict[str, Any]:
    timed = samples[warmup:]  # samples[0] is taken before the first step
    steps = len(timed) - 1
    deltas = [b.time - a.time for a, b in zip(timed, timed[1:], strict=False)]
    seconds = statistics.median(deltas)
    return {
        "seconds_per_step": seconds,
        "step_seconds": deltas,
        "tokens_per_s": w.tokens_per_step / seconds,
        "disk_read_per_step": (timed[-1].read - timed[0].read) / steps,
        "disk_write_per_step": (timed[-1].written - timed[0].written) / steps,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **extra,
    }


def run_deepspeed(w: Workload, disk: str | None) -> dict[str, Any]:
    deepspeed = require("deepspeed", "smartinf-bench's baseline (a), DeepSpeed ZeRO-Infinity")
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    use_environment_extensions_dir()  # DeepSpeed builds its ops in this environment's cache, as the engine does

    # a free port of its own: two runs on one machine must not meet in one TCPStore
    port = str(find_free_network_port())
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo" if w.accelerator == "cpu" else "nccl")
    config = deepspeed_config(w, w.nvme_path)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(w)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = sum(p.ds_numel for p in model.parameters())  # type: ignore[attr-defined]
    vocab = w.model["vocab_size"]
    data = torch.randint(0, vocab, (w.micro_batch, w.seq_len + 1), device=engine.device)
    samples = [sample(disk)]
    for _ in range(w.warmup + w.steps):
        for _ in range(w.micro_batches):
            logits = engine(data[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        samples.append(sample(disk))
    torch.distributed.destroy_process_group()  # gloo's threads end here, not in the interpreter's teardown
    return summarize(samples, w.warmup, w, {"params": params, "host_link_per_step": None, "device_link_per_step": None})


def run_smart_infinity(system: str, w: Workload, disk: str | None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.samples = [sample(disk)]

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == len(self.samples):  # an optimizer step ended with this batch
                self.samples.append(sample(disk))

    torch.manual_seed(0)
    if w.family == "llama":
        from lightning_smartinf.models.hf import HFCausalLM

        module: pl.LightningModule = HFCausalLM(llama_config(w), lr=1e-4)
    else:
        module = GPTModule(GPTConfig(**w.model), lr=1e-4)
    settings = strategy_settings(system, w, w.nvme_path)
    vertical = settings.get("schedule", {}).get("kind") == "vertical"  # (s): micro-batches the Lightning way
    batch = w.micro_batch * (w.micro_batches if vertical else 1)
    steps = w.warmup + w.steps
    data = torch.randint(0, w.model["vocab_size"], (w.micro_batch * w.micro_batches * steps, w.seq_len + 1))
    strategy = SmartInfinityStrategy(**settings)
    stamps = Stamps()
    trainer = pl.Trainer(
        strategy=strategy, accelerator=w.accelerator, devices=1, precision=w.precision, max_steps=steps,  # type: ignore[arg-type]
        accumulate_grad_batches=1 if vertical else w.micro_batches, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[stamps],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=batch))  # type: ignore[arg-type]
    engine = strategy.engine
    assert engine is not None
    engine.wait_step()
    counters = engine.counters
    device_links = sum(counters.total(link=link) for link in {k.link for k in counters.snapshot()} if link != "host")
    extra = {
        "params": engine.layout.num_params,
        "host_link_per_step": counters.total(link="host") / steps,
        "device_link_per_step": device_links / steps,
    }
    strategy.close()
    return summarize(stamps.samples, w.warmup, w, extra)


def update_seconds(model: torch.nn.Module) -> float:
    """One AdamW update of every parameter, fp32 masters and state in memory, with the host update's kernel
    (DeepSpeed's CPU Adam, as the engine's default; torch's where it does not load): the second of two steps."""
    params = [torch.nn.Parameter(p.detach().float().cpu().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        use_environment_extensions_dir()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    except Exception:  # noqa: BLE001 - the op did not build here: torch's AdamW stands in
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    optimizer.step()  # the first allocates the state
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def run_compute(w: Workload) -> dict[str, Any]:
    """The bound's compute term: plain PyTorch forward and backward of one optimizer step's micro-batches, the
    model in memory, nothing recomputed, no I/O and no optimizer (the work every system must do at the least);
    and, apart, one update of the model (on a CPU device the same cores run both, so the bound adds them).
    With 16-bit precision the weights are 16-bit already: autocast over fp32 weights would also cast every weight
    in every micro-batch's forward, work a system that keeps 16-bit copies does not do (12-19% of this step on
    GPT-350M shapes here), and the bound would be that much too loose."""
    torch.manual_seed(0)
    device = torch.device(w.accelerator)
    dtypes = {"bf16": torch.bfloat16, "16": torch.float16}
    dtype = next((d for prefix, d in dtypes.items() if w.precision.startswith(prefix)), None)
    model = build_model(w).to(device, dtype=dtype)
    vocab = w.model["vocab_size"]
    data = torch.randint(0, vocab, (w.micro_batch, w.seq_len + 1), device=device)
    times = []
    for _ in range(w.warmup + w.steps):
        start = time.perf_counter()
        for _ in range(w.micro_batches):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(data[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"seconds_per_step": statistics.median(times[w.warmup :]), "step_seconds": times[w.warmup :],
            "update_seconds": update_seconds(model)}  # fmt: skip


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    system, w = spec["system"], Workload(**spec["workload"])
    Path(w.nvme_path).mkdir(parents=True, exist_ok=True)
    disk = disk_of(Path(w.nvme_path))
    if system == "compute":
        result = run_compute(w)
    else:
        result = run_deepspeed(w, disk) if system == "a" else run_smart_infinity(system, w, disk)
    Path(sys.argv[2]).write_text(json.dumps({"system": system, **result}, indent=2))


if __name__ == "__main__":
    main()
