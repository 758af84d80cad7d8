"""``Trainer(strategy="smart_infinity")``: a thin Lightning strategy that hands the model to the offload engine.

Config comes in as one keyword per component (``offload=``, ``update=``, ``compression=``, ``schedule=``), each a
dict or its dataclass from ``lightning_smartinf.config``, the same keys as the Hydra groups. The strategy builds
the engine in ``setup``, swaps in ``SmartInfinityPrecision`` (so backward, clipping and the step go through the
engine) and saves checkpoints as directories holding the offloaded state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_smartinf.checkpoint import protocol
from lightning_smartinf.checkpoint.background import BackgroundSaves
from lightning_smartinf.checkpoint.manifest import TRAINER_STATE, Manifest
from lightning_smartinf.checkpoint.shards import parse_size
from lightning_smartinf.checkpoint.trainer_state import dumps
from lightning_smartinf.checkpoint.trainer_state import load as load_trainer_state
from lightning_smartinf.config import (
    CompressionConfig,
    OffloadConfig,
    ScheduleConfig,
    UpdateConfig,
    strategy_groups,
)
from lightning_smartinf.engine.engine import OffloadEngine
from lightning_smartinf.engine.export import export_live
from lightning_smartinf.engine.meta import meta_parameters
from lightning_smartinf.engine.planning import plan_parked, plan_schedule, vertical_schedule
from lightning_smartinf.engine.snapshot import (
    load_engine_state,
    module_state,
    refuse_unmappable,
    take_snapshot,
    write_snapshot,
)
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.lightning import internals
from lightning_smartinf.lightning.monitor import SmartInfinityMonitor
from lightning_smartinf.lightning.precision import SmartInfinityPrecision
from lightning_smartinf.lightning.processes import ProcessStrategy
from lightning_smartinf.schedule.parked import ParkedVertical, split_batch
from lightning_smartinf.schedule.planner import Plan
from lightning_smartinf.schedule.vertical import VerticalSchedule, has_protocol
from lightning_smartinf.schedule.window import AccumulationWindow, Call, concat_batches
from lightning_smartinf.storage.space import human_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveRecord:
    """The last checkpoint this strategy wrote: where, how big, how long its writing took, and how long training
    waited for it (all of it for a save in the foreground, the snapshot only for one in the background)."""

    path: Path
    nbytes: int
    seconds: float
    stalled: float


class SmartInfinityStrategy(ProcessStrategy):
    """SSD-offloaded training of one model, on one device or data parallel over many processes (docs/engine.md,
    docs/data_parallel.md): with ``devices=N, num_nodes=K`` each rank owns 1/(N*K) of every block's state."""

    strategy_name = "smart_infinity"

    def __init__(
        self,
        offload: OffloadConfig | dict[str, Any] | None = None,
        update: UpdateConfig | dict[str, Any] | None = None,
        compression: CompressionConfig | dict[str, Any] | None = None,
        schedule: ScheduleConfig | dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        precision_plugin: Precision | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        init_from: str | Path | None = None,
    ) -> None:
        super().__init__(process_group_backend, timeout, accelerator=accelerator, precision_plugin=precision_plugin,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment)  # fmt: skip
        self.offload, self.update, self.compression, self.schedule = strategy_groups(offload, update, compression,
                                                                                    schedule)  # fmt: skip
        self.init_from = init_from
        """Pretrained weights to start from: a .safetensors file or a save_pretrained directory (sharded or not),
        read tensor by tensor into storage at set-up (``engine/pretrained.py``)."""
        self.engine: OffloadEngine | None = None
        self._resume_from: Manifest | None = None
        self._module_state: dict[str, Any] | None = None
        """The checkpoint's module state, read before set-up and restored with the engine's at its end."""
        self.resumed_from_ranks: int | None = None
        """How many ranks wrote the checkpoint this run resumed from (None: not resumed)."""
        self.last_save: SaveRecord | None = None
        self.saves = BackgroundSaves()
        """Checkpoints being written behind training (``offload.async_save``); waited for at teardown."""
        self._save_group: Any = None
        self._fitting = False
        self._failed = False
        """The stage ended in an exception (``on_exception``): its teardown reads nothing back from storage."""
        self.vertical: VerticalSchedule | ParkedVertical | None = None
        self.plan: Plan | None = None
        self.window: AccumulationWindow | None = None
        """``accumulate_grad_batches`` > 1 under the vertical schedule: the window's batches run as one pass."""
        self._kind = self.schedule.kind
        self._split = 1
        """Micro-batches each DataLoader batch is split into under the vertical schedule."""
        self._trainer: pl.Trainer | None = None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: parameters on the meta device, given values block by block
        at set-up (``engine/materialize.py``); otherwise as Lightning builds them."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_parameters(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model()``: the model is built with meta parameters, as under FSDP."""
        with meta_parameters():
            yield

    @override
    def model_to_device(self) -> None:
        """Nothing: the engine places the resident parameters and streams the rest."""

    # -- set-up ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = SmartInfinityPrecision(str(self.precision_plugin.precision), self.root_device.type)
        self.precision_plugin = precision
        self._trainer = trainer
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self._failed = False
        if self._fitting and self.offload.async_save and self.is_distributed and self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")  # the background saves' collectives, apart
        if self.engine is not None and self._fitting and self.engine.optimizer is None:
            # an engine built for evaluation: fit needs one with the optimizer, over the parameters the module holds
            # once the weights are back (so before the optimizer is made)
            self.engine.weights.keep_in_module()
            self.close()
        if self._fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(
                    f"smart_infinity drives exactly one optimizer; configure_optimizers returned {len(self.optimizers)}"
                )
        if self.engine is not None and (changed := self.engine.weights.changed_status()):
            self._rebuild_for(changed)
        if self.engine is not None:
            self.engine.weights.take()
        if self.engine is None:
            optimizer = self.optimizers[0] if self.optimizers else None
            if self.is_distributed:
                self._sync_initial_weights()
            self.engine = OffloadEngine(
                self.model, optimizer, self.offload, self.update, self.root_device, precision.param_dtype,
                loss_scaling=precision.precision == "16-mixed", compression=self.compression,
                overlap=self.schedule.overlap, rank=self.global_rank, world=self.world_size,
                init_from=self.init_from, ranks_per_host=self.num_processes, check=self._resumable,
            )  # fmt: skip
            log.info(
                "smart_infinity: %d params in %d blocks, %d subgroups; storage %s; update %s; host buffers %.1f MiB",
                self.engine.layout.num_params, len(self.engine.layout.streamed), len(self.engine.layout.subgroups),
                self.engine.backend.name, self.engine.updater.name if self.engine.updater else "none",
                self.engine.host_memory_bytes / 2**20,
            )  # fmt: skip
        precision.engine = self.engine
        self._restore()
        self._choose_schedule(trainer)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, SmartInfinityMonitor) for cb in callbacks):
            callbacks.append(SmartInfinityMonitor())

    def _rebuild_for(self, changed: list[str]) -> None:
        """``requires_grad`` changed between stages (it is read at set-up): the engine is built anew from the weights
        the last stage handed back to the module, which must hold them."""
        assert self.engine is not None
        if self.engine.weights.given != "module":
            raise ConfigError(
                f"requires_grad of {changed[0]} ({len(changed)} parameter(s)) changed since set-up, and the trained "
                "weights are on storage only (offload.return_weights gave meta tensors): export them with "
                "strategy.export(DIR) and start a new run from that directory (init_from) with the new settings"
            )
        log.info("smart_infinity: requires_grad of %s (%d parameter(s)) changed since set-up: building the engine "
                 "anew from the module's weights", changed[0], len(changed))  # fmt: skip
        self.close()

    def _choose_schedule(self, trainer: pl.Trainer) -> None:
        """The schedule of this stage: ``auto`` (the default) is planned at the first training batch; with
        ``accumulate_grad_batches`` > 1 a vertical schedule runs each window of batches as one pass."""
        module = self.lightning_module
        assert module is not None
        self.vertical, self.window, self._kind = None, None, self.schedule.kind
        if self._kind == "auto" and not module.automatic_optimization:
            log.info("schedule=auto: manual optimization runs each training_step as written (horizontal)")
            self._kind = "horizontal"
        if self._kind == "vertical":
            self.vertical = self._schedule(self.schedule)
        if self._fitting and self._kind != "horizontal" and trainer.accumulate_grad_batches > 1:
            self.window = AccumulationWindow(trainer.accumulate_grad_batches)

    def _auto_schedule(self, calls: list[Call]) -> VerticalSchedule | ParkedVertical:
        """Plan the vertical schedule for this pass's batches from short measurements of this machine. A window
        of accumulated batches keeps each batch as one micro-batch (the size the user chose to fit memory)."""
        assert self.engine is not None and self.lightning_module is not None and self._trainer is not None
        module, context = self.lightning_module, self.precision_plugin.forward_context
        batch = concat_batches([c.args[0] for c in calls])
        window, protocol = self.window is not None, has_protocol(module)
        if protocol:
            measured = plan_schedule(self.engine, module.vertical_pre, module.vertical_loss, batch,  # type: ignore[arg-type]
                                     context, [len(calls)] if window else None)  # fmt: skip
        else:
            measured = plan_parked(self.engine, batch, len(calls))
        chosen = self.broadcast(measured)  # rank 0's plan for every rank: one schedule, one result
        for line in [chosen.describe(), *chosen.reasons()]:
            log.info(line)
        self.plan = chosen
        settings = replace(self.schedule, kind="vertical", micro_batches=1 if window else chosen.micro_batches,
                           overlap=chosen.overlap, checkpoint_host=chosen.checkpoint_host,
                           checkpoint_nvme=chosen.checkpoint_nvme, keep_activations=chosen.keep_activations,
                           spill_activations=chosen.spill_activations)
        return self._schedule(settings, None if protocol else chosen.keep_bytes)

    def _schedule(self, s: ScheduleConfig, keep_bytes: int | None = None) -> VerticalSchedule | ParkedVertical:
        """The vertical schedule ``s`` asks for (engine/planning.py), each batch split into ``s.micro_batches``."""
        assert self.engine is not None and self.lightning_module is not None and self._trainer is not None
        trainer = self._trainer
        clipping = bool(trainer.gradient_clip_val) or self.engine.scaler is not None
        self._split = s.micro_batches
        return vertical_schedule(self.engine, self.lightning_module, s, trainer.accumulate_grad_batches, clipping,
                                 self.root_device, keep_bytes)  # fmt: skip

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.resumed_from_ranks is not None and self._trainer is not None:
            internals.mark_saved(self._trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.saves.check()  # a background save that failed stops training here, naming the checkpoint
        calls = [Call(args, kwargs)]
        if self.window is not None:
            self.window.hold(args, kwargs)
            assert self._trainer is not None
            if internals.accumulating(self._trainer):  # no optimizer step after this batch
                # held for the end of its window: no loss yet (a placeholder zero) and no backward of its own
                assert isinstance(self.precision_plugin, SmartInfinityPrecision)
                self.precision_plugin.skip_next_backward()
                return torch.zeros((), device=self.root_device)
            calls = self.window.take()
        if self._kind == "auto" and self.vertical is None:
            self.vertical = self._auto_schedule(calls)
        if self.vertical is None:
            return super().training_step(*args, **kwargs)
        return self._run_vertical(calls)

    def _run_vertical(self, calls: list[Call]) -> torch.Tensor:
        """One vertical pass (forward, backward) over ``calls``' batches, each split into ``_split`` micro-batches;
        each loss is divided as Lightning divides it under accumulation."""
        assert self.engine is not None and self.lightning_module is not None and self.vertical is not None
        precision = self.precision_plugin
        assert isinstance(precision, SmartInfinityPrecision)
        module = self.lightning_module
        divisor = self._split * (self.window.accumulate if self.window is not None else 1)
        micros = [(micro, c) for c in calls for micro in split_batch(c.args[0], self._split)]
        if isinstance(self.vertical, ParkedVertical):
            steps = [lambda mb=mb, c=c: module.training_step(mb, *c.args[1:], **c.kwargs) for mb, c in micros]
            loss = self.vertical.run_calls(steps, precision.train_step_context, divisor)
        else:
            with precision.train_step_context():
                loss = self.vertical.run_micros(module, [mb for mb, _ in micros], divisor)  # type: ignore[arg-type]
            module.log("train_loss", loss, prog_bar=True)
        precision.skip_next_backward()
        self.engine.count_micro_batch()
        return loss

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A storage failure (an I/O error, wrong bytes read back) ends the stage: its teardown must not read the
        weights back from that storage (the module gets meta tensors; the last checkpoint holds the state)."""
        self._failed = self._failed or isinstance(exception, OSError)

    @override
    def teardown(self) -> None:
        """End of a stage: the trained weights go back into the module (``offload.return_weights``, see
        ``engine/handback.py``); the engine stays, so validate/test/predict after fit reuse its state.
        ``close()`` ends it."""
        self._fitting = False
        self.saves.wait()
        if self.engine is not None:  # after a failure the storage may not serve the weights: meta tensors, loudly
            self.engine.weights.give("meta" if self._failed else self.offload.return_weights)
        # Lightning's own teardown, less its two moves to the CPU (the module, the optimizer's state): the module's
        # parameters are where the hand-back put them (or meta), and the optimizer state lives in the engine.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's buffers and the frozen parameters outside the streamed blocks: the engine's trained weights
        are its fp32 masters, saved as files in the checkpoint. The streamed blocks' frozen parameters are not saved:
        they never change, and a resume takes them from the model's init route again (``init_from``)."""
        assert self.lightning_module is not None and self.engine is not None
        return module_state(self.engine, self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        """Write ``filepath`` as a checkpoint directory (Lightning's trainer state plus the engine's offloaded
        state) that appears under that name only once complete: see ``checkpoint/protocol.py``. During fit (with
        ``offload.async_save``) only the snapshot is taken here and the writing goes on behind training."""
        engine = self.engine
        assert engine is not None
        started = time.perf_counter()
        self.saves.check()
        snapshot = take_snapshot(engine)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        checkpoint = {**checkpoint, internals.ELASTIC: internals.batching(self.world_size, accumulate)}
        trainer_state, step, path = dumps(checkpoint), checkpoint.get("global_step", 0), Path(filepath)
        background = self._fitting and self.offload.async_save
        fenced_before = engine.fence.waited_s

        def write() -> None:
            try:
                manifest, seconds = protocol.save(
                    path, trainer_state, step, snapshot.nbytes,
                    lambda writer, prefix: write_snapshot(snapshot, writer, prefix), self.global_rank,
                    self.world_size, self._save_group if background else None,
                )  # fmt: skip
            finally:
                snapshot.hold.close()
            if manifest is None:
                return
            if background:  # the snapshot, then the next step's waits for subgroups not yet copied
                stalled = stall + engine.fence.waited_s - fenced_before
            else:
                stalled = time.perf_counter() - started
            self.last_save = SaveRecord(manifest.path, manifest.nbytes, seconds, stalled)
            log.info(
                "smart_infinity: checkpoint %s, %s in %.2f s (%.2f s/GB%s); training waited %.2f s for it",
                manifest.path, human_bytes(manifest.nbytes), seconds, seconds / max(manifest.nbytes / 1e9, 1e-9),
                ", in the background" if background else "", stalled,
            )  # fmt: skip

        stall = time.perf_counter() - started
        if background:
            self.saves.save(f"save of {path}", write)
        else:
            write()

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if not self.is_global_zero:
            return
        if self._fitting and self.offload.async_save:
            self.saves.remove(f"checkpoint {filepath}", lambda: protocol.remove(Path(filepath)))
        else:
            self.saves.wait()
            protocol.remove(Path(filepath))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """False: Lightning reads the checkpoint before set-up, so set-up can refuse one it cannot restore before it
        writes anything; the engine's state is restored at the end of set-up (``_restore``)."""
        return False

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint's files, then read the trainer state; the engine state follows in
        ``load_model_state_dict``."""
        self.saves.wait()  # restoring rewrites the state files a save in the background may still be copying
        self._resume_from = protocol.open_checkpoint(Path(checkpoint_path), self.global_rank, self.world_size)
        state = load_trainer_state(self._resume_from.path / TRAINER_STATE)
        assert self.lightning_module is not None
        internals.recount(state, self.world_size, self.lightning_module.trainer.accumulate_grad_batches)
        return state

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Before set-up: kept for ``_restore``, which restores it with the engine's state once the engine exists."""
        self._module_state = checkpoint["state_dict"]

    def _resumable(self, signature: dict[str, Any]) -> None:
        """Set-up's check, before the engine writes anything: the checkpoint being resumed can be restored onto it."""
        if self._resume_from is not None and self._module_state is not None:
            try:
                refuse_unmappable(self._resume_from, signature)
            except ConfigError:
                self._module_state = None  # refused: nothing of it is restored later
                raise

    def _restore(self) -> None:
        """The checkpoint read before set-up, restored into the engine and the module."""
        if self._module_state is None:
            return
        assert self.engine is not None and self._resume_from is not None and self.lightning_module is not None
        started = time.perf_counter()
        self.resumed_from_ranks = load_engine_state(self.engine, self._resume_from)
        log.info("smart_infinity: restored the offloaded state in %.2f s", time.perf_counter() - started)
        self.lightning_module.load_state_dict(self._module_state, strict=False)
        self._module_state = None

    def close(self) -> None:
        """Stop the engine's I/O threads and give the module back its blocks' original ``forward``."""
        self.saves.wait()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- the API users see ----------------------------------------------------------------------------------------
    @property
    def mid_accumulation(self) -> bool:
        """Batches since the last optimizer step: gradients accumulated, or batches held for the window's pass (a
        checkpoint now would lose them)."""
        held = self.window is not None and bool(self.window.held)
        return held or (self.engine is not None and self.engine.micro_batches > 0)

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes moved so far, ``{"link/direction": {kind: bytes}}`` (see ``TrafficCounters``)."""
        return self.engine.counters.table() if self.engine else {}

    def export(self, out: str | Path, dtype: str = "fp32", strip_prefix: str = "",
               max_shard_size: str | int = "2GB", merge_adapters: bool = False) -> list[Path]:  # fmt: skip
        """Write the trained weights as safetensors, one block at a time from the engine's masters (bounded
        memory, whatever the model's size): a ``.safetensors`` file, or a directory in ``save_pretrained``'s
        layout (shards and an index). ``strip_prefix="model."`` names them as the HF model inside the module
        (save its ``config.json`` beside them and ``from_pretrained`` loads the directory). ``merge_adapters``:
        PEFT LoRA adapters merged into their base weights, block by block, named as ``merge_and_unload`` names the
        merged model. Returns the files."""
        assert self.engine is not None, "the engine exists from setup until close()"
        return export_live(self.engine, Path(out), dtype, parse_size(max_shard_size), strip_prefix,
                           write=self.is_global_zero, merge_adapters=merge_adapters)  # fmt: skip

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master by name (reads all master state from storage)."""
        assert self.engine is not None, "the engine exists between setup and teardown"
        return self.engine.master_state_dict()
