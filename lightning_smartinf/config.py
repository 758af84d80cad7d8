"""One dataclass per strategy component. Each is a Hydra config group (conf/<group>/) and a strategy keyword.

``SmartInfinityStrategy(offload={"nvme_path": p})`` and ``smartinf-train offload.nvme_path=p`` build the same
``OffloadConfig``. Cross-field rules live in ``__post_init__`` and name the keys they check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, cast

from lightning_smartinf.errors import ConfigError

_PLACES = ("nvme", "cpu")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _check_positive(key: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")


@dataclass
class OffloadConfig:
    """Where fp32 master/optimizer state, 16-bit params and gradients live, and how they stream."""

    nvme_path: Any = "smartinf_state"
    """Directory for offloaded state files (an NVMe mount for speed), created if missing; or a list of directories
    (one per disk) that the subgroups' files are striped over. ``{rank}`` in a path is replaced by the process's
    rank (data parallel; without it each rank uses ``PATH/rank{r}``)."""
    params: str = "nvme"
    """Home of the 16-bit block parameters between uses: ``nvme`` (files) or ``cpu`` (host RAM)."""
    grads: str = "nvme"
    """Where fp32 gradients accumulate between backward and the step: ``nvme`` or ``cpu``."""
    subgroup_size: int = 16_777_216
    """Elements per subgroup: the unit of the streamed optimizer step (rounded up to 2048)."""
    prefetch: int = 1
    """Blocks whose parameters are read ahead of the block running now."""
    step_lookahead: int = 1
    """Subgroups whose state is read ahead during the optimizer step."""
    io_backend: str = "auto"
    """``auto`` (DeepSpeed aio where it loads, else threads), ``aio`` or ``threads``."""
    io_threads: int = 4
    """Concurrent requests (worker threads, each with its own aio handle)."""
    aio_intra_op_parallelism: int = 1
    """DeepSpeed aio threads per request (its ``intra_op_parallelism``)."""
    aio_block_size: int = 1_048_576
    """DeepSpeed aio block size in bytes."""
    aio_queue_depth: int = 32
    """DeepSpeed aio queue depth."""
    check_free_space: bool = True
    """Refuse to start when nvme_path has less free space than the planned state."""
    verify_io: bool = True
    """A checksum (XXH3-64, storage/checksum.py) of every state file written, checked when the run reads it back; a
    failed read or write (an I/O error, wrong bytes) is retried once, then an error naming the file
    (storage/store.py). ``false`` saves the sums' CPU time."""
    async_save: bool = True
    """Checkpoints saved during fit are written in the background while training goes on (the next step waits only
    at a subgroup whose state is not yet copied); ``false``: training waits for each save."""
    state_precision: str = "fp32"
    """Of the optimizer state (Adam's moments, SGD's momentum, Adagrad's sum): ``fp32``, or ``8bit``, block-wise
    quantized (update/quant8.py): about 1 byte an element instead of 4, so a step moves about 6 B/param of master and
    Adam state each way instead of 12. The fp32 master weights stay fp32. With ``update=host``."""
    min_8bit_size: int = 4096
    """With ``state_precision=8bit``: a parameter of fewer elements keeps fp32 state (bitsandbytes' ``min_8bit_size``:
    biases and norms cost little, and their quantization blocks would mix with a neighbour's scale)."""
    fp32_embedding_state: bool = True
    """With ``state_precision=8bit``: the weights of ``nn.Embedding`` modules keep fp32 state (bitsandbytes'
    ``StableEmbedding``). A rare token's row has a second moment far below its block's largest; in 8 bits it rounds
    to zero while its first moment does not, and Adam then steps it by about m / eps (docs/state_precision.md)."""
    host_memory_budget: str = "auto"
    """Host memory the engine may fill with what would otherwise cross the disk, placed by value per byte
    (engine/placement.py): the streamed blocks' 16-bit parameters first (read by every forward and backward, written
    by every step), then the fp32 gradients, then the master and optimizer state of the first subgroups (each one in
    RAM saves 24 B/param of disk traffic per Adam step), then kept forward graphs. ``auto`` (the
    default): half of the host memory available at set-up (shared by the ranks on the host), less what the engine
    holds whatever the budget (its buffer pools, resident set and set-up's working set); a size (``8GB``,
    ``512MB``); or ``0``: everything on storage."""
    return_weights: str = "auto"
    """What the module's parameters hold between stages (after fit, validate, test, predict): ``module``, the trained
    values in their original dtypes (host memory: the model's size); ``meta``, meta tensors that fail on any use,
    the values staying in the state (export them); ``auto``, ``module`` when they fit in half the free host memory."""

    def __post_init__(self) -> None:
        _check_choice("offload.params", self.params, _PLACES)
        _check_choice("offload.grads", self.grads, _PLACES)
        _check_choice("offload.io_backend", self.io_backend, ("auto", "aio", "threads"))
        _check_choice("offload.return_weights", self.return_weights, ("auto", "module", "meta"))
        _check_choice("offload.state_precision", self.state_precision, ("fp32", "8bit"))
        if self.host_memory_budget != "auto":
            parse_bytes("offload.host_memory_budget", self.host_memory_budget)
        _check_positive("offload.subgroup_size", self.subgroup_size, 2048)
        _check_positive("offload.min_8bit_size", self.min_8bit_size, 0)
        _check_positive("offload.prefetch", self.prefetch, 0)
        _check_positive("offload.step_lookahead", self.step_lookahead, 0)
        _check_positive("offload.io_threads", self.io_threads)
        _check_positive("offload.aio_intra_op_parallelism", self.aio_intra_op_parallelism)
        paths = state_paths(self.nvme_path)
        if len(set(paths)) != len(paths):
            raise ConfigError(f"offload.nvme_path lists a directory twice: {paths}; give each disk once")

    @property
    def paths(self) -> list[str]:
        """``nvme_path`` as a list of directories (one entry without striping)."""
        return state_paths(self.nvme_path)


def parse_bytes(key: str, text: Any) -> int:
    """``"8GB"``, ``"512MB"``, ``"64KB"``, ``"1000"`` or an int, as bytes (decimal units, as disks are sold)."""
    value = str(text).strip().upper()
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if value.endswith(unit):
            value, factor = value[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        number = float(value) * factor
    except ValueError:
        number = -1.0
    if number < 0:
        raise ConfigError(f"{key}={text!r} is not a size: give bytes or a number with KB, MB, GB or TB (or auto)")
    return int(number)


def state_paths(value: Any) -> list[str]:
    """``offload.nvme_path`` (a directory or a list of them) as a non-empty list of non-empty strings."""
    paths = [value] if isinstance(value, str | Path) else list(value) if isinstance(value, Sequence) else None
    if not paths or not all(isinstance(p, str | Path) and str(p) for p in paths):
        raise ConfigError(
            f"offload.nvme_path={value!r}: give a directory for the offloaded state, or a list of directories "
            "(one per disk), e.g. offload.nvme_path=[/mnt/nvme0/run,/mnt/nvme1/run]"
        )
    return [str(p) for p in paths]


@dataclass
class UpdateConfig:
    """Where the optimizer update runs."""

    backend: str = "host"
    """``host``: on the CPU, state streamed from storage through host memory (ZeRO-Infinity). ``smart``: on
    near-storage OpenCL devices that keep the state in their own directories (Smart-Infinity's SmartUpdate)."""
    host_adam: str = "auto"
    """Adam/AdamW kernel for the host update: ``deepspeed`` (its CPU Adam op), ``torch``, or ``auto``."""
    devices: Any = 1
    """``smart``: a count (the first N devices of PoCL), or a list of {platform, device, path, binary}."""
    wire: str = "fp32"
    """``smart``: dtype of gradients sent and parameters returned: ``fp32`` (8 B/param) or ``16bit`` (4 B/param,
    the training precision's 16-bit type; mixed precision only)."""

    def __post_init__(self) -> None:
        _check_choice("update.backend", self.backend, ("host", "smart"))
        _check_choice("update.host_adam", self.host_adam, ("auto", "deepspeed", "torch"))
        _check_choice("update.wire", self.wire, ("fp32", "16bit"))
        if isinstance(self.devices, int):
            _check_positive("update.devices", self.devices)
        elif isinstance(self.devices, list | tuple) or hasattr(self.devices, "__iter__"):
            if not list(self.devices):
                raise ConfigError("update.devices is an empty list: give a count or at least one device entry")
        else:
            raise ConfigError(f"update.devices={self.devices!r}: give a count or a list of {{platform, device, path}}")


def check_combination(offload: OffloadConfig, update: UpdateConfig, compression: CompressionConfig) -> None:
    """Rules across groups, checked when the strategy is built."""
    if compression.kind != "none":
        if update.backend != "smart":
            raise ConfigError(
                f"compression.kind={compression.kind} needs update.backend=smart: the gradient is decompressed on the "
                "near-storage device that updates it (the host update reads dense gradients)"
            )
        if offload.grads != "cpu":
            raise ConfigError(
                f"compression.kind={compression.kind} selects from the accumulated gradient on the training side "
                "before it crosses the host link: set offload.grads=cpu"
            )
        if update.wire != "fp32":
            raise ConfigError(
                f"compression.kind={compression.kind} sends its own 16-bit values (compression.value_dtype) and "
                "decompresses into fp32 on the device: use update.wire=fp32"
            )
    if update.backend == "smart" and update.wire == "16bit" and offload.grads == "nvme":
        raise ConfigError(
            "update.wire=16bit sends gradients as 16-bit from host memory; with offload.grads=nvme they are written "
            "as fp32 straight into the owning device's directory instead: use offload.grads=cpu or update.wire=fp32"
        )


@dataclass
class CompressionConfig:
    """Gradient compression between the training device and the updater (SmartComp)."""

    kind: str = "none"
    """``none``: gradients travel dense. ``topk``: the largest ``keep`` fraction per block travels as int32
    indices + 16-bit values and is decompressed on the near-storage device (needs update=smart)."""
    keep: float = 0.01
    """Fraction of each block's elements sent, in (0, 1]."""
    block: int = 4096
    """Elements per selection block."""
    error_feedback: bool = False
    """Keep what was not sent on the training side and add it back before the next selection."""
    catch_up: bool = False
    """Adam/AdamW with error feedback: the device updates only the elements it receives, each by the steps it
    missed, from the mean gradient and mean square of its wait (the sums of squares travel too: 8 B per kept element
    instead of 6). Unsent elements keep their moments; docs/compression.md."""
    warmup_steps: int = 0
    """Optimizer steps that send dense gradients before compression starts."""
    value_dtype: str = "bf16"
    """16-bit type of the values on the wire: ``bf16`` or ``fp16``."""
    residual_budget_mb: float = 1024.0
    """Error-feedback residual (with catch-up, also the sums of squares) kept fp32 in training-device memory up to
    this many MiB; the rest in 16-bit host RAM."""

    def __post_init__(self) -> None:
        _check_choice("compression.kind", self.kind, ("none", "topk"))
        _check_choice("compression.value_dtype", self.value_dtype, ("bf16", "fp16"))
        if not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"compression.keep={self.keep} must be in (0, 1]: the fraction of elements sent")
        _check_positive("compression.block", self.block)
        _check_positive("compression.warmup_steps", self.warmup_steps, 0)
        if self.residual_budget_mb < 0:
            raise ConfigError(f"compression.residual_budget_mb={self.residual_budget_mb} must be >= 0")
        if self.catch_up and not self.error_feedback:
            raise ConfigError(
                "compression.catch_up=true needs compression.error_feedback=true: the device catches an element up "
                "from the gradient it accumulated while unsent, which error feedback keeps"
            )


@dataclass
class ScheduleConfig:
    """Order in which blocks and micro-batches run."""

    kind: str = "auto"
    """``auto`` (the default): vertical, with micro-batches, overlap, kept graphs and checkpoint placement chosen by
    the roofline planner from short measurements at the first batch (schedule/planner.py; the plan and its reasons
    are logged); any module, manual optimization excepted (it runs horizontal). ``vertical``: all micro-batches
    through one block before the next (GreedySnake), with the keys below as given. ``horizontal``: each batch runs
    through the whole model (ZeRO-Infinity's order). Under ``auto`` and ``vertical``, ``accumulate_grad_batches=A``
    runs each window of A batches as one vertical pass (schedule/window.py)."""
    micro_batches: int = 1
    """``vertical``: micro-batches the DataLoader batch is split into (the batch size must divide by it)."""
    checkpoint_host: float = 0.0
    """``vertical``: fraction of each boundary's micro-batch checkpoints kept in host memory."""
    checkpoint_nvme: float = 0.0
    """``vertical``: fraction kept on storage (under offload.nvme_path); the rest stays on the device."""
    overlap: float = 0.0
    """Share of the optimizer step (by elements, in forward order) that may still run while the next forward
    pass starts; each block waits for its own update before it runs. 0: the step completes before fit goes on."""
    eager_update: bool = False
    """``vertical``: start each block's update as soon as its gradient is final, during backward. Needs no
    gradient clipping and no fp16 loss scaling (both need the global gradient norm before any update)."""
    keep_activations: float = 0.0
    """``vertical`` with ``vertical_pre``/``vertical_loss``: share of the blocks (the last ones) whose forward graph
    is kept for backward instead of recomputed (GreedySnake): a quarter less compute for them, at the cost of their
    activations in memory (schedule/kept.py)."""
    spill_activations: float = 0.0
    """``vertical`` with ``vertical_pre``/``vertical_loss``: share of the blocks (those before the ones
    ``keep_activations`` keeps) whose forward graph is kept on storage instead of recomputed: written under
    offload.nvme_path as the forward makes it and read back one block ahead of backward (schedule/spill.py).
    Modules without the protocol keep on storage every graph the memory does not hold when it is above 0."""

    def __post_init__(self) -> None:
        _check_choice("schedule.kind", self.kind, ("horizontal", "vertical", "auto"))
        _check_positive("schedule.micro_batches", self.micro_batches)
        for key in ("checkpoint_host", "checkpoint_nvme", "overlap", "keep_activations", "spill_activations"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"schedule.{key}={getattr(self, key)} must be a fraction in [0, 1]")
        if self.checkpoint_host + self.checkpoint_nvme > 1.0:
            raise ConfigError("schedule.checkpoint_host + schedule.checkpoint_nvme must not exceed 1")


T = TypeVar("T")


def coerce(cls: type[T], value: T | dict[str, Any] | None, group: str) -> T:
    """Accept a dataclass instance, a mapping of its fields (a dict or a DictConfig) or None (defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping) or hasattr(value, "items"):
        mapping = cast(Mapping[str, Any], value)
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(mapping.keys()) - known)
        if unknown:
            raise ConfigError(f"unknown {group} keys {unknown}; valid keys: {sorted(known)}")
        return cls(**dict(mapping.items()))
    raise TypeError(f"{group}= takes a dict or a {cls.__name__}, got {type(value).__name__}")


def strategy_groups(
    offload: OffloadConfig | dict[str, Any] | None, update: UpdateConfig | dict[str, Any] | None,
    compression: CompressionConfig | dict[str, Any] | None, schedule: ScheduleConfig | dict[str, Any] | None,
) -> tuple[OffloadConfig, UpdateConfig, CompressionConfig, ScheduleConfig]:  # fmt: skip
    """The four groups a strategy (the Trainer's or Fabric's) is built with, each coerced (``coerce``) and the rules
    across them checked (``check_combination``)."""
    groups = (coerce(OffloadConfig, offload, "offload"), coerce(UpdateConfig, update, "update"),
              coerce(CompressionConfig, compression, "compression"), coerce(ScheduleConfig, schedule, "schedule"))
    check_combination(*groups[:3])
    return groups
