"""The Hydra schema of ``smartinf-train``: the strategy's component configs plus model, data, optimizer, trainer.

Registered in Hydra's ConfigStore so a bad key or a wrong type fails at compose time, naming the key. Recipes
(``recipes/*.yaml``) are registered as the ``recipe`` group; each is a ``_global_`` package deriving from
``gpt_tiny``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_smartinf.config import CompressionConfig, OffloadConfig, ScheduleConfig, UpdateConfig
from lightning_smartinf.models.gpt import GPTConfig
from lightning_smartinf.resources import asset_dir


@dataclass
class DataConfig:
    path: str | None = None
    """Text file or directory to train on; null means this Python's standard library source."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    val_percent: int = 5
    """Share of files (by path hash) held out for validation."""
    train_samples: int = 1_000_000
    """Windows drawn per epoch."""
    val_samples: int = 64
    """Windows in the validation set."""
    num_workers: int = 0
    """DataLoader workers."""
    tokenizer: str | None = None
    """A local directory holding a Hugging Face tokenizer (tokenizer.json ...); null: bytes (ids 0-255). With
    model=hf the model's own directory is the default."""
    cache_dir: str | None = None
    """Where tokenized corpora are cached (memory-mapped token files); null: .smartinf_cache beside the data."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw, adam, sgd (momentum 0.9) or adagrad."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    """Linear LR warmup over this many optimizer steps."""


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: int = 1
    """Processes (one device each) per node; more than one trains data parallel (docs/data_parallel.md)."""
    num_nodes: int = 1
    precision: str = "bf16-mixed"
    max_steps: int = 200
    val_check_interval: int = 100
    limit_val_batches: int = 8
    log_every_n_steps: int = 5
    gradient_clip_val: float = 1.0
    accumulate_grad_batches: int = 1
    seed: int = 1234
    output_dir: str = "smartinf_runs"
    """Logs, the checkpoint and the plot go to a timestamped directory under this one."""
    save_final: bool = True
    """Save a checkpoint as training ends (it needs as much disk as the offloaded state; checked before training)."""
    checkpoint_every_n_steps: int = 0
    """Also checkpoint every this many steps (keeping the newest); 0: only at the end."""
    resume: str | None = None
    """A checkpoint to resume from, or a directory of them (its newest complete one is taken)."""
    trace: str | None = None
    """Write a Chrome/Perfetto trace of ``trace_iterations`` iterations (from the third) to this path and log where
    the time went (docs/trace.md); relative paths land in the run's directory."""
    trace_iterations: int = 2


@dataclass
class ModelConfig(GPTConfig):
    """Which model (the shipped GPT, or a Hugging Face architecture), its shape, and where its starting weights
    come from (the model is always built on meta and initialized block by block into storage, so host memory does
    not grow with its size)."""

    kind: str = "gpt"
    """gpt (the shipped GPT, shaped by the fields above) or hf (a transformers causal LM: model=hf)."""
    path: str | None = None
    """model=hf: a local save_pretrained directory (config.json, safetensors weights, tokenizer files) to start
    from; the fine-tuned model is written back in the same layout. Nothing is downloaded."""
    config: dict[str, Any] = field(default_factory=dict)
    """model=hf without a path (training from scratch, e.g. recipe=llama3_8b): the architecture's Hugging Face
    config, model_type first (any key can be overridden: model.config.num_hidden_layers=4); with a path, its
    config.json is used and this is ignored."""
    init_from: str | None = None
    """Pretrained weights: a .safetensors file or a save_pretrained-style directory (e.g. a smartinf-export of an
    earlier run); null: GPT's own init. model=hf takes them from model.path."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in ("gpt", "hf"):
            raise ValueError(f"model.kind={self.kind!r} is not one of gpt, hf")

    def shape(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})


@dataclass
class PeftSettings:
    """Adapters over a frozen base (``peft=lora``, with ``model=hf model.path=DIR``): PEFT's LoRA, the base's weights
    streaming read-only from storage (docs/models.md)."""

    kind: str = "none"
    """none, or lora."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is alpha / r x B A)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (the attention projections of Llama, Qwen, Mistral)."""
    merge: bool = False
    """Also write the merged model (adapters folded into the base, merge_and_unload's result) as a save_pretrained
    directory, streamed block by block; ``model: PATH`` then names it, the adapter directory is written beside."""

    def __post_init__(self) -> None:
        if self.kind not in ("none", "lora"):
            raise ValueError(f"peft.kind={self.kind!r} is not one of none, lora")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    peft: PeftSettings = field(default_factory=PeftSettings)
    recipe_name: str = "gpt_tiny"


def register_configs() -> None:
    """Store the schema and every recipe in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="smartinf_schema", node=TrainConfig)
    for path in sorted(asset_dir("recipes").glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
