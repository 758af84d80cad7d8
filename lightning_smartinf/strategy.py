"""``Trainer(strategy="smart_infinity")``: a thin Lightning strategy that hands the model to the offload engine.

Config comes in as one keyword per component (``offload=``, ``update=``, ``compression=``, ``schedule=``), each a
dict or its dataclass from ``lightning_smartinf.config``, the same keys as the Hydra groups. The strategy builds
the engine in ``setup``, swaps in ``SmartInfinityPrecision`` (so backward, clipping and the step go through the
engine) and saves checkpoints as directories holding the offloaded state.
"""

from __future__ import annotations

import atexit
import io
import logging
import shutil
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
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_smartinf.checkpoint.files import fsync_directory
from lightning_smartinf.checkpoint.manifest import (
    ENGINE_STATE,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    CheckpointWriter,
    Manifest,
    verify_checkpoint,
)
from lightning_smartinf.checkpoint.shards import parse_size
from lightning_smartinf.config import (
    CompressionConfig,
    OffloadConfig,
    ScheduleConfig,
    UpdateConfig,
    check_combination,
    coerce,
)
from lightning_smartinf.engine.engine import OffloadEngine
from lightning_smartinf.engine.export import export_live
from lightning_smartinf.engine.planning import block_flops, memory_budget, update_rate, workload_of
from lightning_smartinf.engine.snapshot import engine_nbytes, load_engine_state, save_engine_state
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.meta import meta_parameters
from lightning_smartinf.monitor import SmartInfinityMonitor
from lightning_smartinf.precision import SmartInfinityPrecision
from lightning_smartinf.schedule.parked import ParkedVertical
from lightning_smartinf.schedule.planner import Plan, measure_machine, plan
from lightning_smartinf.schedule.vertical import CheckpointTiers, VerticalSchedule, check_protocol, has_protocol
from lightning_smartinf.storage.space import human_bytes

log = logging.getLogger(__name__)


def _destroy_process_group() -> None:
    """At exit, before the interpreter tears down: a gloo process group left alive ends the process in
    std::terminate ("terminate called without an active exception") when its threads are destroyed unjoined."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class SaveRecord:
    """The last checkpoint this strategy wrote: where, how big, and how long training waited for it."""

    path: Path
    nbytes: int
    seconds: float


class SmartInfinityStrategy(ParallelStrategy):
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
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
        )  # fmt: skip
        self.offload = coerce(OffloadConfig, offload, "offload")
        self.update = coerce(UpdateConfig, update, "update")
        self.compression = coerce(CompressionConfig, compression, "compression")
        self.schedule = coerce(ScheduleConfig, schedule, "schedule")
        check_combination(self.offload, self.update, self.compression)
        self.init_from = init_from
        """Pretrained weights to start from: a .safetensors file or a save_pretrained directory (sharded or not),
        read tensor by tensor into storage at set-up (``engine/pretrained.py``)."""
        self.engine: OffloadEngine | None = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._resume_from: Manifest | None = None
        self.last_save: SaveRecord | None = None
        self.vertical: VerticalSchedule | ParkedVertical | None = None
        self.plan: Plan | None = None
        self._trainer: pl.Trainer | None = None

    # -- devices -----------------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank] if self.parallel_devices else torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """More than one rank: Lightning then gives each rank its share of the data (a DistributedSampler)."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        """One process per device, started the way DDP starts them (or by torchrun / SLURM, which Lightning's
        cluster environments detect)."""
        if self.is_distributed:
            assert self.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed and not _distributed_is_initialized():
            self.set_world_ranks()
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
            atexit.register(_destroy_process_group)

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

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]  # type: ignore[no-any-return]

    def _sync_initial_weights(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP does), whatever each seeded."""
        assert self.model is not None
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if not tensor.is_meta:  # meta ones get values block by block in the engine, rank 0's on every rank
                dist.broadcast(tensor.data, 0)

    # -- set-up ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = SmartInfinityPrecision(str(self.precision_plugin.precision), self.root_device.type)
        self.precision_plugin = precision
        self._trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(
                    f"smart_infinity drives exactly one optimizer; configure_optimizers returned {len(self.optimizers)}"
                )
        if self.engine is not None and self.optimizers and self.engine.optimizer is None:
            self.engine.weights.keep_in_module()  # an engine built for evaluation: fit needs one with the optimizer
            self.close()
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
                init_from=self.init_from,
            )  # fmt: skip
            log.info(
                "smart_infinity: %d params in %d blocks, %d subgroups; storage %s; update %s; host buffers %.1f MiB",
                self.engine.layout.num_params, len(self.engine.layout.streamed), len(self.engine.layout.subgroups),
                self.engine.backend.name, self.engine.updater.name if self.engine.updater else "none",
                self.engine.host_memory_bytes / 2**20,
            )  # fmt: skip
        precision.engine = self.engine
        self.vertical = self._vertical_schedule(trainer, self.schedule) if self.schedule.kind == "vertical" else None
        if self.schedule.kind == "auto":
            check_protocol(self.lightning_module)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, SmartInfinityMonitor) for cb in callbacks):
            callbacks.append(SmartInfinityMonitor())

    def _vertical_schedule(self, trainer: pl.Trainer, s: ScheduleConfig) -> VerticalSchedule | ParkedVertical:
        """The explicit protocol's schedule where the module has ``vertical_pre``/``vertical_loss`` (the fast path:
        checkpoints may go to host memory or storage), else its own training_step parked at every block."""
        assert self.engine is not None
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "schedule=vertical accumulates over schedule.micro_batches inside each batch: leave "
                f"accumulate_grad_batches at 1 (got {trainer.accumulate_grad_batches})"
            )
        self.engine.configure_step(overlap=s.overlap)
        if s.eager_update and (trainer.gradient_clip_val or self.engine.scaler is not None):
            raise ConfigError(
                "schedule.eager_update starts block updates before backward ends, so it cannot honour "
                "gradient_clip_val or fp16 loss scaling (both need the global gradient norm first): turn one off"
            )
        if not has_protocol(self.lightning_module):
            return ParkedVertical(self.engine, s.micro_batches, s.eager_update)
        tiers = CheckpointTiers(s.micro_batches, s.checkpoint_host, s.checkpoint_nvme, self.engine.disk,
                                self.engine.counters, self.root_device)  # fmt: skip
        return VerticalSchedule(self.engine, s.micro_batches, tiers, s.eager_update, s.keep_activations)

    def _auto_schedule(self, batch: torch.Tensor) -> VerticalSchedule | ParkedVertical:
        """Plan the vertical schedule for this batch from short measurements of this machine."""
        assert self.engine is not None and self.lightning_module is not None
        with torch.no_grad(), self.precision_plugin.forward_context():
            hidden = self.lightning_module.vertical_pre(batch)  # type: ignore[operator]
            flops = block_flops(self.engine, hidden)
        boundaries = len(self.engine.layout.streamed) + 1
        sample_bytes = hidden[0].numel() * hidden.element_size() * boundaries
        work = workload_of(self.engine, batch, sample_bytes)
        machine = measure_machine(self.root_device, self.engine.root, self.engine.backend,
                                  update_rate(self.engine), self.engine.param_dtype,
                                  memory_budget(self.root_device), memory_budget(torch.device("cpu")))  # fmt: skip
        log.info("schedule=auto: the model's blocks run at %.3g TFLOP/s here (a 2048^3 matmul: %.3g)",
                 flops / 1e12, machine.flops / 1e12)  # fmt: skip
        machine = replace(machine, flops=min(flops, machine.flops))
        chosen = self.broadcast(plan(work, machine))  # rank 0's plan for every rank: one schedule, one result
        log.info(chosen.describe())
        self.plan = chosen
        settings = replace(self.schedule, kind="vertical", micro_batches=chosen.micro_batches, overlap=chosen.overlap,
                           checkpoint_host=chosen.checkpoint_host, checkpoint_nvme=chosen.checkpoint_nvme)
        assert self._trainer is not None
        return self._vertical_schedule(self._trainer, settings)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.schedule.kind == "auto" and self.vertical is None:
            self.vertical = self._auto_schedule(args[0])
        if self.vertical is None:
            return super().training_step(*args, **kwargs)
        assert self.engine is not None and self.lightning_module is not None
        precision = self.precision_plugin
        assert isinstance(precision, SmartInfinityPrecision)
        module = self.lightning_module
        if isinstance(self.vertical, ParkedVertical):
            loss = self.vertical.run(lambda micro: module.training_step(micro, *args[1:], **kwargs), args[0],
                                     precision.train_step_context)  # fmt: skip
        else:
            with precision.train_step_context():
                loss = self.vertical.run(module, args[0])  # type: ignore[arg-type]
            module.log("train_loss", loss, prog_bar=True)
        precision.backward_done = True  # Lightning's backward call that follows has nothing left to do
        self.engine.count_micro_batch()
        return loss

    @override
    def teardown(self) -> None:
        """End of a stage: the trained weights go back into the module (``offload.return_weights``, see
        ``engine/handback.py``); the engine stays, so validate/test/predict after fit reuse its state.
        ``close()`` ends it."""
        if self.engine is not None:
            self.engine.weights.give(self.offload.return_weights)
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's buffers and frozen parameters: the engine's weights are its fp32 masters, saved as files in
        the checkpoint."""
        module = self.lightning_module
        assert module is not None and self.engine is not None
        owned = {id(slot.param) for block in self.engine.layout.blocks for slot in block.slots}
        weights = {name for name, p in module.named_parameters(remove_duplicate=False) if id(p) in owned}
        return {k: v for k, v in module.state_dict().items() if k not in weights}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Write ``filepath`` as a checkpoint directory (Lightning's trainer state plus the engine's offloaded
        state) that appears under that name only once complete: see ``checkpoint/manifest.py``."""
        assert self.engine is not None
        self.engine.wait_step()
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        trainer_state = buffer.getvalue()
        if self.is_distributed:
            manifest, seconds = self._save_partitioned(Path(filepath), trainer_state, checkpoint.get("global_step", 0))
            if manifest is None:
                return
        else:
            nbytes = engine_nbytes(self.engine) + len(trainer_state)
            with CheckpointWriter(Path(filepath), nbytes) as writer:
                writer.write(TRAINER_STATE, trainer_state)
                engine = save_engine_state(self.engine, writer, ENGINE_STATE)
                manifest = writer.publish({"engine": engine, "global_step": checkpoint.get("global_step", 0)})
            seconds = writer.seconds
        self.last_save = SaveRecord(manifest.path, manifest.nbytes, seconds)
        log.info(
            "smart_infinity: checkpoint %s, %s in %.2f s (%.2f s/GB)", manifest.path, human_bytes(manifest.nbytes),
            seconds, seconds / max(manifest.nbytes / 1e9, 1e-9),
        )  # fmt: skip

    def _save_partitioned(self, target: Path, trainer_state: bytes, step: int) -> tuple[Manifest | None, float]:
        """Every rank writes its slices under ``offload/rank{r}`` of rank 0's staging directory; rank 0 adds the
        trainer state and publishes once all ranks' files are durable (a shared filesystem, as DeepSpeed assumes).
        A failure on any rank fails the save on every rank and leaves the previous checkpoint in place."""
        assert self.engine is not None
        started = time.perf_counter()
        sizes: list[int] = [0] * self.world_size
        dist.all_gather_object(sizes, engine_nbytes(self.engine))
        writer: CheckpointWriter | None = None
        opened: tuple[Path | None, str | None] = (None, None)
        if self.is_global_zero:
            try:
                writer = CheckpointWriter(target, sum(sizes) + len(trainer_state))
                opened = (writer.staging, None)
            except Exception as err:  # noqa: BLE001 - reported on every rank below
                opened = (None, f"{type(err).__name__}: {err}")
        staging, failure = self.broadcast(opened)
        if staging is None:
            raise CheckpointError(f"rank 0 could not start checkpoint {target}: {failure}")
        part = writer or CheckpointWriter(target, sizes[self.global_rank], staging=staging)
        result: tuple[Any, Any, str | None] = (None, None, None)
        try:
            meta = save_engine_state(self.engine, part, f"{ENGINE_STATE}/rank{self.global_rank}")
            result = (part.finish(), meta, None)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            result = (None, None, f"rank {self.global_rank}: {type(err).__name__}: {err}")
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, result)
        failures = [r[2] for r in results if r[2] is not None]
        with part:
            if failures:
                kept = "; the previous one is kept"
                raise CheckpointError(f"checkpoint {target} not written{kept}: {'; '.join(failures)}")
            manifest = None
            if writer is not None:
                writer.write(TRAINER_STATE, trainer_state)
                for files, _, _ in results[1:]:
                    writer.add(files)
                meta = {"ranks": [r[1] for r in results], "world_size": self.world_size, "global_step": step}
                manifest = writer.publish(meta)
        self.barrier()  # the checkpoint exists for every rank once save_checkpoint returns
        return manifest, time.perf_counter() - started

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Unpublish first (drop the manifest), then delete: a kill halfway leaves no half checkpoint that looks
        complete."""
        if not self.is_global_zero:
            return
        path = Path(filepath)
        (path / MANIFEST).unlink(missing_ok=True)
        if path.is_dir():
            fsync_directory(path)
        shutil.rmtree(path, ignore_errors=True)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify every file of the checkpoint against its manifest, then read the trainer state; the engine state
        follows in ``load_model_state_dict``."""
        started = time.perf_counter()
        mine, others = f"{ENGINE_STATE}/rank{self.global_rank}/", f"{ENGINE_STATE}/rank"
        manifest = verify_checkpoint(  # each rank hashes the shared files and its own slice, not the others'
            Path(checkpoint_path), lambda relative: relative.startswith(mine) or not relative.startswith(others)
        )
        part = "this rank's slice and the shared files" if self.is_distributed else f"{len(manifest.files)} files"
        log.info(
            "smart_infinity: verified %s of %s (%s in all) in %.2f s", part, manifest.path,
            human_bytes(manifest.nbytes), time.perf_counter() - started,
        )  # fmt: skip
        saved_world = manifest.meta.get("world_size", 1)
        if saved_world != self.world_size:
            raise ConfigError(
                f"checkpoint {manifest.path} holds the state of {saved_world} rank(s), partitioned for that many; "
                f"this run has {self.world_size}: resume with devices x num_nodes = {saved_world}"
            )
        self._resume_from = manifest
        return torch.load(manifest.path / TRAINER_STATE, weights_only=False)  # type: ignore[no-any-return]

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.engine is not None and self._resume_from is not None and self.lightning_module is not None
        started = time.perf_counter()
        manifest = self._resume_from
        if self.is_distributed:
            prefix, meta = f"{ENGINE_STATE}/rank{self.global_rank}", manifest.meta["ranks"][self.global_rank]
        else:
            prefix, meta = ENGINE_STATE, manifest.meta["engine"]
        load_engine_state(self.engine, manifest, prefix, meta)
        log.info("smart_infinity: restored the offloaded state in %.2f s", time.perf_counter() - started)
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=False)

    def close(self) -> None:
        """Stop the engine's I/O threads and give the module back its blocks' original ``forward``."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- the API users see ----------------------------------------------------------------------------------------
    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes moved so far, ``{"link/direction": {kind: bytes}}`` (see ``TrafficCounters``)."""
        return self.engine.counters.table() if self.engine else {}

    def export(self, out: str | Path, dtype: str = "fp32", strip_prefix: str = "",
               max_shard_size: str | int = "2GB") -> list[Path]:  # fmt: skip
        """Write the trained weights as safetensors, one block at a time from the engine's masters (bounded
        memory, whatever the model's size): a ``.safetensors`` file, or a directory in ``save_pretrained``'s
        layout (shards and an index). ``strip_prefix="model."`` names them as the HF model inside the module
        (save its ``config.json`` beside them and ``from_pretrained`` loads the directory). Returns the files."""
        assert self.engine is not None, "the engine exists from setup until close()"
        return export_live(self.engine, Path(out), dtype, parse_size(max_shard_size), strip_prefix,
                           write=self.is_global_zero)  # fmt: skip

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master by name (reads all master state from storage)."""
        assert self.engine is not None, "the engine exists between setup and teardown"
        return self.engine.master_state_dict()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="SSD-offloaded training (smart_infinity)")
        strategy_registry.register(
            "smart_infinity_cpu_params",
            cls,
            description="smart_infinity with 16-bit params and gradients in host RAM",
            offload={"params": "cpu", "grads": "cpu"},
        )
