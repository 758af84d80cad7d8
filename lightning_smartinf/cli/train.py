"""``smartinf-train``: train a GPT recipe with the smart_infinity strategy, configured by Hydra.

    smartinf-train                                  # tiny recipe on CPU, state in ./smartinf_state
    smartinf-train recipe=gpt_350m offload.nvme_path=/mnt/nvme trainer.max_steps=100
    smartinf-train trainer.checkpoint_every_n_steps=50              # crash-safe checkpoints as it goes
    smartinf-train trainer.resume=smartinf_runs/DATE/TIME/checkpoints trainer.max_steps=400

On SIGTERM it saves a checkpoint at the next step and exits 143; trainer.resume continues from it.

It trains, validates, saves a checkpoint, writes a PNG of the loss and traffic curves, and prints where it all went.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lightning_smartinf import extras
from lightning_smartinf.checkpoint.manifest import MANIFEST, choose_checkpoint
from lightning_smartinf.cli.config import TrainConfig, register_configs
from lightning_smartinf.cli.models import choose_model
from lightning_smartinf.cli.plots import plot_run
from lightning_smartinf.cli.report import reporting
from lightning_smartinf.data.corpus import TextDataModule
from lightning_smartinf.data.tokenizer import ByteTokenizer
from lightning_smartinf.engine.snapshot import engine_nbytes
from lightning_smartinf.errors import ConfigError, MissingPathError, StorageError
from lightning_smartinf.lightning.monitor import SmartInfinityMonitor
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy
from lightning_smartinf.lightning.timeline import Trace
from lightning_smartinf.resources import asset_dir
from lightning_smartinf.storage.space import human_bytes

log = logging.getLogger("smartinf-train")
PREEMPTED = 143
"""Exit status after a SIGTERM (128 + 15, what a process killed by it reports): the run stopped early, on purpose."""


def build_trainer(cfg: TrainConfig, out_dir: Path,
                  init_from: str | None) -> tuple[pl.Trainer, SmartInfinityStrategy, SmartInfinityMonitor]:  # fmt: skip
    strategy = SmartInfinityStrategy(
        offload=cfg.offload, update=cfg.update, compression=cfg.compression, schedule=cfg.schedule,
        init_from=init_from,
    )  # fmt: skip
    monitor = SmartInfinityMonitor()
    t = cfg.trainer
    callbacks: list[pl.Callback] = [monitor, Preemption(out_dir / "checkpoints")]
    if t.checkpoint_every_n_steps:
        every = t.checkpoint_every_n_steps
        callbacks.append(ModelCheckpoint(out_dir / "checkpoints", "step{step}", every_n_train_steps=every,
                                         auto_insert_metric_name=False))  # fmt: skip
    if t.trace:
        callbacks.append(Trace(out_dir / t.trace, start=2, iterations=t.trace_iterations))
    if t.save_final:
        callbacks.append(FinalCheckpoint(out_dir / "checkpoints", keep=2 if t.checkpoint_every_n_steps else 1))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,  # type: ignore[arg-type]
        max_steps=t.max_steps,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        gradient_clip_val=t.gradient_clip_val or None,
        accumulate_grad_batches=t.accumulate_grad_batches,
        logger=CSVLogger(out_dir, name="logs", version=""),
        callbacks=callbacks,
        enable_checkpointing=bool(t.checkpoint_every_n_steps),
        use_distributed_sampler=False,  # TextDataModule's train loader shards itself, resumably
        default_root_dir=out_dir,
    )
    return trainer, strategy, monitor


class FinalCheckpoint(pl.Callback):
    """Save ``stepN.ckpt`` as training ends, while the fit loop (and its data loader's position) is still alive, so
    that resuming from it continues exactly where the run stopped."""

    def __init__(self, directory: Path, keep: int = 1) -> None:
        self.directory = directory
        self.keep = keep

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the first step: the checkpoints this run writes must fit on their disk."""
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        needed = engine_nbytes(engine) * self.keep
        probe = self.directory
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if needed > free:
            raise StorageError(
                f"the checkpoint at the end of training needs {human_bytes(needed)} under {self.directory} and "
                f"{human_bytes(free)} is free: free space, set trainer.output_dir to a larger disk, or turn the "
                "final checkpoint off with trainer.save_final=false"
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.directory / f"step{trainer.global_step}.ckpt", weights_only=False)


class Preemption(pl.Callback):
    """SIGTERM (SLURM and Kubernetes send it before a kill; Lightning stops at the next batch end) saves a
    checkpoint there, at a step boundary, and the run exits 143 (128 + SIGTERM) naming it, so a scheduler can
    requeue and ``trainer.resume`` continues exactly. Ctrl-C stops and says how to resume."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.saved: Path | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            log.warning("interrupted: resume from the newest checkpoint with trainer.resume=%s", self.directory)
            return
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.strategy.engine is None or trainer.strategy.mid_accumulation:  # type: ignore[attr-defined]
            log.warning("SIGTERM in the middle of gradient accumulation: no checkpoint could be saved")
            return
        self.saved = self.directory / f"step{trainer.global_step}.ckpt"
        trainer.save_checkpoint(self.saved, weights_only=False)
        log.warning("SIGTERM: saved %s; resume with trainer.resume=%s", self.saved, self.directory)


def resume_path(resume: str | None) -> Path | None:
    """``trainer.resume``: a checkpoint (which must be intact), or a directory of them, whose newest complete and
    intact checkpoint is taken; each newer one skipped is logged with the reason (docs/checkpoints.md)."""
    if resume is None:
        return None
    path = Path(resume).expanduser()
    if not path.exists():
        raise MissingPathError(f"trainer.resume={resume!r} does not exist: give a checkpoint or a directory of them")
    if not path.is_dir():
        raise MissingPathError(f"trainer.resume={resume!r} is a regular file; a checkpoint is a directory "
                               "(stepN.ckpt/ with a manifest.json), or give the directory that holds them")  # fmt: skip
    if (path / MANIFEST).is_file():
        return path
    found, skipped = choose_checkpoint(path)  # it logs each checkpoint it skips, and why
    if found is None:
        damaged = f" ({len(skipped)} damaged or unfinished, listed above)" if skipped else ""
        raise MissingPathError(f"trainer.resume={resume!r} holds no complete and intact smart_infinity checkpoint"
                               f"{damaged}")  # fmt: skip
    (log.warning if skipped else log.info)("resuming from %s", found.path)
    return found.path


def check_batch(cfg: TrainConfig) -> None:
    """A vertical schedule splits each batch into micro-batches: say so before set-up writes anything."""
    s, batch = cfg.schedule, cfg.data.batch_size
    if s.kind == "vertical" and batch % s.micro_batches:
        raise ConfigError(f"data.batch_size={batch} does not split into schedule.micro_batches={s.micro_batches}: "
                          "make the batch size a multiple of it")  # fmt: skip


def run(cfg: TrainConfig, out_dir: Path, explicit: frozenset[str] = frozenset()) -> dict[str, object] | None:
    """Train, validate, checkpoint and plot (and write a model=hf run's model back as a save_pretrained
    directory); return the paths and the summary (on rank 0; None on the others). ``explicit``: the keys set on
    the command line. Every input is checked, and the data tokenized, before set-up writes any state."""
    check_batch(cfg)
    resume = resume_path(cfg.trainer.resume)
    pl.seed_everything(cfg.trainer.seed, workers=True)
    spec = choose_model(cfg, explicit)
    d = cfg.data
    data = TextDataModule(d.path, d.seq_len, d.batch_size, d.val_percent, d.train_samples, d.val_samples,
                          d.num_workers, cfg.trainer.seed, spec.tokenizer, d.cache_dir)  # fmt: skip
    data.setup()
    trainer, strategy, monitor = build_trainer(cfg, out_dir, spec.init_from)
    with warnings.catch_warnings():  # Lightning warns of any strategy with a model_sharded_context; ours does both
        warnings.filterwarnings("ignore", "`trainer.init_module` cannot fully support")
        with trainer.init_module(empty_init=True):  # on meta: the engine initializes it block by block into storage
            module = spec.build()
    try:
        trainer.fit(module, datamodule=data, ckpt_path=resume)
    except SIGTERMException:
        strategy.close()
        raise SystemExit(PREEMPTED) from None
    checkpoint = out_dir / "checkpoints" / f"step{trainer.global_step}.ckpt" if cfg.trainer.save_final else None
    val = trainer.validate(module, datamodule=data, verbose=False)
    model_dir = spec.write_back(strategy, out_dir / "model") if spec.hf_config is not None else None
    metrics_csv = out_dir / "logs" / "metrics.csv"
    strategy.close()
    if not trainer.is_global_zero:  # rank 0 logs, plots and reports for the run
        return None
    logged = metrics_csv.is_file()  # a run shorter than trainer.log_every_n_steps, without validation, logs nothing
    plotting = logged and extras.available("matplotlib")
    plot = plot_run(metrics_csv, out_dir / "curves.png", f"{cfg.recipe_name}: smart_infinity") if plotting else None
    result: dict[str, object] = {
        "recipe": cfg.recipe_name,
        "val_loss": val[0].get("val_loss") if val else None,
        "token": "byte" if isinstance(spec.tokenizer, ByteTokenizer) else "token",
        "summary": monitor.summary,
        "checkpoint": str(checkpoint) if checkpoint is not None and checkpoint.exists() else None,
        "model": str(model_dir) if model_dir is not None else None,
        "metrics": str(metrics_csv) if logged else None,
        "plot": str(plot) if plot is not None else None,
        "no_plot": None if plot is not None or not logged else extras.missing("matplotlib", "the run's plot"),
        "state_dir": ", ".join(str(Path(p).resolve()) for p in cfg.offload.paths),
    }
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    return result


@hydra.main(version_base=None, config_path=str(asset_dir("conf")), config_name="config")
def _main(raw: DictConfig) -> None:
    with reporting("smartinf-train"):
        cfg: TrainConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        explicit = frozenset(o.split("=", 1)[0].lstrip("+~") for o in hydra_cfg.overrides.task)
        result = run(cfg, out_dir, explicit)
    if result is None:
        return
    val = result["val_loss"]
    unit = f"nats/{result['token']}"
    print(f"\nvalidation loss: {f'{val:.4f} {unit}' if val is not None else 'none (no validation batches)'}")
    why = "no training step ran" if cfg.trainer.save_final else "trainer.save_final=false"
    print(f"checkpoint:      {result['checkpoint'] or f'none written ({why})'}")
    if result["model"]:
        print(f"model: {result['model']}")  # on a line of its own: scripts read it
    print(f"offloaded state: {result['state_dir']}")
    nothing = f"none (nothing logged: fewer steps than trainer.log_every_n_steps={cfg.trainer.log_every_n_steps})"
    print(f"metrics:         {result['metrics'] or nothing}")
    no_plot = f"none ({result['no_plot']})" if result["no_plot"] else nothing
    print(f"plot:            {result['plot'] or no_plot}")
    print(f"summary:         {out_dir / 'summary.json'}")


def main() -> None:
    register_configs()
    _main()


if __name__ == "__main__":
    main()
