"""A callback that shows what the offload engine is doing: tokens/s and link traffic, every step, and a summary.

The strategy adds it to the Trainer on set-up, so ``Trainer(strategy="smart_infinity")`` users see throughput and
bytes moved in the progress bar and in every logger, and get a per-kind traffic table when fitting ends. The
progress bar shows this rank's figures; with several ranks the summary sums tokens and bytes over all of them and
lists each rank's host-link bytes.

Where each step's time goes is logged beside them (``trace.Phases`` on the training thread): ``t_storage``, seconds
waiting on storage reads; ``t_update``, the optimizer step where it was not hidden (run in line, or waited for by
the next forward); ``t_compute``, the rest (forward, backward, recompute, and what Lightning and the data loader
take). ``host_read_MB`` / ``host_write_MB`` are the step's bytes each way over the host link (on a CPU device: to
and from storage). The summary sums both: what went to the disk and what waiting on it cost.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_smartinf import trace
from lightning_smartinf.core import HOST_LINK

EXPOSED_UPDATE = ("step", "update-wait")


def count_tokens(module: pl.LightningModule, batch: Any) -> int:
    """Tokens trained in ``batch``: the module's ``tokens_in_batch`` if it has one, else the batch's elements."""
    custom = getattr(module, "tokens_in_batch", None)
    if callable(custom):
        return int(custom(batch))
    first = batch[0] if isinstance(batch, list | tuple) else batch
    return int(first.numel()) if isinstance(first, torch.Tensor) else 0


class SmartInfinityMonitor(Callback):
    def __init__(self) -> None:
        self.tokens = 0
        self.step_tokens = 0
        self.started = 0.0
        self.step_started = 0.0
        self.last_bytes = 0
        self.last_read = 0
        self.start_bytes = 0
        self.start_step = 0
        self.last_global_step = 0
        self.phases: trace.Phases | None = None
        self.last_phases: dict[str, float] = {}
        self.summary: dict[str, Any] = {}

    @staticmethod
    def _engine(trainer: pl.Trainer) -> Any:
        return getattr(trainer.strategy, "engine", None)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = self.step_started = time.perf_counter()
        engine = self._engine(trainer)
        self.last_bytes = self.start_bytes = engine.counters.total(link=HOST_LINK) if engine else 0
        self.last_read = engine.counters.total(link=HOST_LINK, direction="read") if engine else 0
        self.start_step = engine.step_count if engine else 0  # non-zero after a resume
        self.last_global_step = trainer.global_step
        self.phases = trace.count_phases()
        self.last_phases = {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = count_tokens(pl_module, batch)
        self.tokens += tokens
        self.step_tokens += tokens
        engine = self._engine(trainer)
        if engine is None or trainer.global_step == self.last_global_step:  # mid-accumulation: no step yet
            return
        self.last_global_step = trainer.global_step
        now = time.perf_counter()
        elapsed = max(now - self.step_started, 1e-9)
        host = engine.counters.total(link=HOST_LINK)
        read = engine.counters.total(link=HOST_LINK, direction="read")
        metrics = {
            "tok_s": self.step_tokens / elapsed,
            "host_GBps": (host - self.last_bytes) / elapsed / 1e9,
            "host_GB": host / 1e9,
        }
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log_dict(self._split(elapsed), on_step=True, on_epoch=False)
        written = (host - read) - (self.last_bytes - self.last_read)
        moved = {"host_read_MB": (read - self.last_read) / 1e6, "host_write_MB": written / 1e6}
        pl_module.log_dict(moved, on_step=True, on_epoch=False)
        self.step_started, self.step_tokens, self.last_bytes, self.last_read = now, 0, host, read

    def _split(self, elapsed: float) -> dict[str, float]:
        """This step's seconds: waiting on storage, exposed update, and the rest (compute)."""
        totals = dict(self.phases.totals) if self.phases is not None else {}
        delta = {k: v - self.last_phases.get(k, 0.0) for k, v in totals.items()}
        self.last_phases = totals
        storage = delta.get("wait", 0.0)
        update = sum(delta.get(k, 0.0) for k in EXPOSED_UPDATE)
        return {"t_storage": storage, "t_update": update, "t_compute": max(elapsed - storage - update, 0.0)}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trace.stop_phases()
        engine = self._engine(trainer)
        if engine is None:
            return
        seconds = time.perf_counter() - self.started
        phases = dict(self.phases.totals) if self.phases is not None else {}
        storage = phases.get("wait", 0.0)
        update = sum(phases.get(k, 0.0) for k in EXPOSED_UPDATE)
        steps = engine.step_count - self.start_step
        params = engine.layout.num_params
        mine = {"tokens": self.tokens, "table": engine.counters.table(),
                HOST_LINK: engine.counters.total(link=HOST_LINK) - self.start_bytes}  # fmt: skip
        ranks = [mine]
        if trainer.world_size > 1 and dist.is_initialized():  # every rank runs this hook: a collective is safe
            ranks = [{}] * trainer.world_size
            dist.all_gather_object(ranks, mine)
        table = _sum_tables([r["table"] for r in ranks])
        tokens = sum(r["tokens"] for r in ranks)
        self.summary = {
            "seconds": seconds,
            "ranks": len(ranks),
            "tokens": tokens,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "optimizer_steps": steps,
            "resumed_at_step": self.start_step,
            "resumed_from_ranks": getattr(trainer.strategy, "resumed_from_ranks", None),
            "params": params,
            "storage_backend": engine.backend.name,
            "updater": engine.updater.name if engine.updater else None,
            "engine_host_buffers_MiB": engine.host_memory_bytes / 2**20,
            "host_memory_placement": engine.placement.describe(engine.layout, engine.frozen_layout),
            "compression": engine.compressor.summary() if engine.compressor is not None else None,
            "traffic_bytes": table,
            "traffic_bytes_per_rank": [r["table"] for r in ranks],
            "host_link_bytes_per_param_per_step": sum(r[HOST_LINK] for r in ranks) / params / max(steps, 1),
            "host_link_bytes_per_rank": [r[HOST_LINK] for r in ranks],
            "time_s": {"compute": max(seconds - storage - update, 0.0), "storage": storage, "update": update},
        }
        if trainer.is_global_zero:
            print(format_summary(self.summary))


def _sum_tables(tables: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for table in tables:
        for link_dir, kinds in table.items():
            for kind, n in kinds.items():
                total.setdefault(link_dir, {})[kind] = total.get(link_dir, {}).get(kind, 0) + n
    return total


def _repartitioned(summary: dict[str, Any]) -> str:
    saved, ranks = summary.get("resumed_from_ranks"), summary.get("ranks", 1)
    return f" from a checkpoint of {saved} rank(s), re-partitioned onto {ranks}" if saved and saved != ranks else ""


def _time_line(summary: dict[str, Any]) -> str:
    """What the traffic cost rank 0's training thread: its wall time split as the plot's right panel splits it."""
    split, seconds = summary["time_s"], max(summary["seconds"], 1e-9)
    labels = {"compute": "compute", "storage": "waiting on storage", "update": "update not hidden"}
    parts = ", ".join(f"{label} {split[key]:.1f} s ({split[key] / seconds:.0%})" for key, label in labels.items())
    moved = sum(summary.get("host_link_bytes_per_rank", []))
    return f"  time:    {parts}; {moved / 2**30:.2f} GiB over the host link"


def format_summary(summary: dict[str, Any]) -> str:
    ranks = summary.get("ranks", 1)
    per_rank = summary.get("host_link_bytes_per_rank", [])
    lines = [
        "smart_infinity summary",
        f"  {summary['optimizer_steps']} steps, {summary['tokens']:,} tokens in {summary['seconds']:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s); {summary['params']:,} parameters",
        *([f"  resumed at step {summary['resumed_at_step']}{_repartitioned(summary)}"]
          if summary.get("resumed_at_step") else []),  # fmt: skip
        f"  storage: {summary['storage_backend']}",
        f"  update:  {summary['updater']}; engine host buffers {summary['engine_host_buffers_MiB']:.1f} MiB",
        *([f"  memory:  {summary['host_memory_placement']}"] if summary.get("host_memory_placement") else []),
        f"  host link: {summary['host_link_bytes_per_param_per_step']:.2f} B/param/step (the kinds below)"
        + (f", summed over {ranks} ranks" if ranks > 1 else ""),
        *([f"  per rank:  {', '.join(f'rank {r} {n / 2**20:.1f} MiB' for r, n in enumerate(per_rank))}"]
          if ranks > 1 else []),
        *([_time_line(summary)] if "time_s" in summary else []),
    ]  # fmt: skip
    for link_dir, kinds in summary["traffic_bytes"].items():
        parts = ", ".join(f"{kind} {n / 2**20:.1f} MiB" for kind, n in kinds.items())
        lines.append(f"  {link_dir:12s} {parts}")
    return "\n".join(lines)
