"""``L.Fabric(strategy="smart_infinity")``: the same offload engine behind Lightning Fabric's loop (litgpt's, yours).

Fabric leaves the loop to the user: ``fabric.setup(model, optimizer)`` builds the engine here (parameters and
optimizer state to storage), the model's forward streams its blocks, ``fabric.backward(loss)`` hands the loss to the
engine (gradients leave block by block into its store), ``fabric.clip_gradients(model, optimizer, max_norm=...)``
returns the global norm and clips the next step, and ``optimizer.step()`` runs the engine's step (the torch
optimizer keeps only its hyper-parameters: an LR scheduler works as usual). ``fabric.save`` / ``fabric.load`` write
and read the same crash-safe checkpoint directories as the Trainer strategy; ``fabric.init_module(empty_init=True)``
builds the model on meta, given values block by block at set-up.

The loop is the user's, so blocks run in its order (horizontal); the optimizer step runs behind the next forward
(``schedule.overlap``, 1.0 unless set), each block waiting for its own update. One process per device, started by
Fabric's launcher, for data parallelism as under the Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf.checkpoint import protocol
from lightning_smartinf.checkpoint.manifest import TRAINER_STATE
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
from lightning_smartinf.engine.meta import meta_parameters
from lightning_smartinf.engine.snapshot import load_engine_state, module_state, take_snapshot, write_snapshot
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.lightning.internals import FabricSubprocessLauncher, sync_ddp
from lightning_smartinf.lightning.precision import PARAM_DTYPES
from lightning_smartinf.lightning.ranks import Ranks

log = logging.getLogger(__name__)

ENGINE = "smart_infinity engine"
"""What a checkpoint's trainer state holds in place of the model's weights and the optimizer's state (they are the
engine's files beside it)."""


class SmartInfinityFabricStrategy(Ranks, ParallelStrategy):
    """SSD-offloaded training under Fabric, on one device or data parallel over many processes. Keywords as the
    Trainer strategy's (``offload=``, ``update=``, ``compression=``, ``schedule=``, ``init_from=``)."""

    strategy_name = "smart_infinity"

    def __init__(
        self,
        offload: OffloadConfig | dict[str, Any] | None = None,
        update: UpdateConfig | dict[str, Any] | None = None,
        compression: CompressionConfig | dict[str, Any] | None = None,
        schedule: ScheduleConfig | dict[str, Any] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        init_from: str | Path | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision)  # fmt: skip
        self.offload, self.update, self.compression, self.schedule = strategy_groups(offload, update, compression,
                                                                                    schedule)  # fmt: skip
        if self.schedule.kind == "vertical":
            raise ConfigError(
                "schedule=vertical runs the Trainer's training_step block by block; under Fabric the loop is yours, "
                "so blocks run in its order: leave schedule at auto (or horizontal)"
            )
        self.init_from = init_from
        self._init_ranks(process_group_backend, timeout)
        self.engine: OffloadEngine | None = None
        self.module: Module | None = None
        self.optimizer: Optimizer | None = None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = FabricSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self.join_process_group()

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None,
                   reduce_op: ReduceOp | str | None = "mean") -> Tensor:  # fmt: skip
        return sync_ddp(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    # -- the model -----------------------------------------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: parameters on meta, given values block by block at set-up
        (the model's own init route, or ``init_from``'s weights); otherwise as Fabric builds them."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(meta_parameters())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: Module) -> None:
        """Nothing: the engine places the resident parameters and streams the rest."""

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:  # fmt: skip
        if len(optimizers) != 1:
            raise ConfigError(f"smart_infinity drives exactly one optimizer; fabric.setup got {len(optimizers)}")
        self._build(module, optimizers[0])
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        raise ConfigError(
            "smart_infinity builds its engine from the model and its optimizer together: call "
            "fabric.setup(model, optimizer) (not setup_module, then setup_optimizers)"
        )

    def _build(self, module: Module, optimizer: Optimizer) -> None:
        if self.engine is not None:
            raise ConfigError("smart_infinity trains one model per strategy: fabric.setup was called twice")
        name = str(self.precision.precision)
        if name not in PARAM_DTYPES:
            raise ConfigError(f"smart_infinity supports precision {', '.join(PARAM_DTYPES)}; "
                              f"Fabric(precision={name!r}) is not one of them")  # fmt: skip
        overlap = 1.0 if self.schedule.kind == "auto" else self.schedule.overlap
        self.engine = OffloadEngine(
            module, optimizer, self.offload, self.update, self.root_device, PARAM_DTYPES[name],
            loss_scaling=name == "16-mixed", compression=self.compression, overlap=overlap, rank=self.global_rank,
            world=self.world_size, init_from=self.init_from, ranks_per_host=self.num_processes,
        )  # fmt: skip
        self.module, self.optimizer = module, optimizer
        log.info("smart_infinity (Fabric): %d params in %d blocks, %d subgroups; storage %s; update %s; the loop's "
                 "order (horizontal), step overlap %.2f", self.engine.layout.num_params,
                 len(self.engine.layout.streamed), len(self.engine.layout.subgroups), self.engine.backend.name,
                 self.engine.updater.name if self.engine.updater else "none", overlap)  # fmt: skip

    def _engine(self) -> OffloadEngine:
        if self.engine is None:
            raise RuntimeError("the smart_infinity engine is built by fabric.setup(model, optimizer)")
        return self.engine

    # -- the training step ------------------------------------------------------------------------------------------
    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """The engine's backward: the loss (scaled under fp16), the blocks' gradients into its store."""
        self._engine().backward(tensor)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The engine's step over every subgroup (the torch optimizer's hyper-parameters, as a scheduler left them);
        a clip set by ``clip_gradients`` applies to this step only."""
        engine = self._engine()
        result = engine.step()
        engine.configure_step(clip_norm=0.0)
        return result

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:  # fmt: skip
        """The global gradient norm now (unscaled); the coming step clips to ``max_norm`` as clip_grad_norm_ would."""
        if float(norm_type) != 2.0:
            raise ConfigError(f"smart_infinity clips by the L2 norm; clip_gradients(norm_type={norm_type}) is not it")
        engine = self._engine()
        norm = torch.as_tensor(engine.gradient_norm())
        if error_if_nonfinite and not bool(torch.isfinite(norm)) and engine.scaler is None:
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}: non-finite (clip_gradients with "
                               "error_if_nonfinite=True)")  # fmt: skip
        engine.configure_step(clip_norm=float(max_norm))
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise ConfigError("smart_infinity clips by the global norm only: use clip_gradients(max_norm=...)")

    @contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Generator[None, None, None]:
        """Nothing to skip: the engine reduces each block's gradient once, at the step's boundary of accumulation
        (every backward adds into its store)."""
        yield

    # -- checkpoints ---------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: str | Path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:  # fmt: skip
        """``fabric.save(path, state)``: a checkpoint directory (the engine's offloaded state, and the rest of
        ``state`` as plain data) that appears under ``path`` only once complete (``checkpoint/protocol.py``)."""
        engine = self._engine()
        rest = {name: self._saved(value) for name, value in state.items()}
        snapshot = take_snapshot(engine)
        try:
            protocol.save(Path(path), dumps(rest), engine.step_count, snapshot.nbytes,
                          lambda writer, prefix: write_snapshot(snapshot, writer, prefix), self.global_rank,
                          self.world_size)  # fmt: skip
        finally:
            snapshot.hold.close()

    def _saved(self, value: Any) -> Any:
        """A state entry as it is saved: the engine's module as its buffers and untrained parameters (the trained
        ones are the engine's files), its optimizer as its hyper-parameters; other stateful objects by state_dict."""
        if self.module is not None and value is self.module:
            return {ENGINE: module_state(self._engine(), value)}
        if self.optimizer is not None and value is self.optimizer:
            return {ENGINE: [{k: v for k, v in g.items() if k != "params"} for g in value.param_groups]}
        if hasattr(value, "state_dict") and callable(value.state_dict):
            return value.state_dict()
        return value

    @override
    def load_checkpoint(self, path: str | Path, state: Module | Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:  # fmt: skip
        """``fabric.load(path, state)``: verify the checkpoint, restore the engine's state, and the rest of ``state``
        in place; returns what ``state`` did not ask for."""
        engine = self._engine()
        manifest = protocol.open_checkpoint(Path(path), self.global_rank, self.world_size)
        saved = load_trainer_state(manifest.path / TRAINER_STATE)
        load_engine_state(engine, manifest)
        wanted = state if isinstance(state, dict) else {}
        missing = sorted(set(wanted) - set(saved))
        if strict and missing:
            raise KeyError(f"fabric.load: {path} holds no {missing}; it holds {sorted(saved)}")
        for name, value in list(wanted.items()):
            if name in saved:
                self._restore(wanted, name, value, saved.pop(name))
        return saved

    def _restore(self, state: dict[str, Any], name: str, target: Any, saved: Any) -> None:
        if self.module is not None and target is self.module:
            target.load_state_dict(saved[ENGINE], strict=False)
        elif self.optimizer is not None and target is self.optimizer:
            for group, hyper in zip(target.param_groups, saved[ENGINE], strict=True):
                group.update(hyper)
        elif hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(saved)
        else:
            state[name] = saved

    # -- the API users see ----------------------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """Every parameter's fp32 master by name (reads all master state from storage)."""
        return self._engine().master_state_dict()

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes moved so far, ``{"link/direction": {kind: bytes}}``."""
        return self.engine.counters.table() if self.engine else {}

    def close(self, return_weights: str | None = None) -> None:
        """End training: the trained weights back into the module (``offload.return_weights``: ``module``, ``meta``
        or ``auto``), the engine's threads stopped."""
        if self.engine is not None:
            self.engine.weights.give(return_weights or self.offload.return_weights)
            self.engine.close()
            self.engine = None

    @override
    def teardown(self) -> None:
        self.close()
        super().teardown()
