"""``smartinf-convergence``: validation loss of lossy settings against exact training, same seed and steps.

Trains the tiny recipe (or what the overrides after ``--`` choose) on the default corpus once per setting of a suite,
then writes a Markdown table and a PNG of the validation curves:

- ``compression`` (default): SmartUpdate, uncompressed; top-k keep=0.01 without and with error feedback; keep=0.05;
  keep=0.01 with error feedback and the devices' catch-up update;
- ``state``: the host update with everything on storage, optimizer state in fp32 and in 8 bits.

    smartinf-convergence --steps 300 --out docs/
    smartinf-convergence --suite state --steps 1000 --out docs/state_precision/
    smartinf-convergence --suite state --steps 200 --out docs/state_precision_350m/ -- recipe=gpt_350m \
        model.vocab_size=256 data.seq_len=32 data.batch_size=1 trainer.accumulate_grad_batches=8
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from lightning_smartinf import extras
from lightning_smartinf.cli.config import TrainConfig, register_configs  # noqa: E402
from lightning_smartinf.cli.train import run  # noqa: E402
from lightning_smartinf.resources import asset_dir  # noqa: E402

SETTINGS = {
    "uncompressed": [],
    "top-k keep=0.01": ["compression=topk", "compression.keep=0.01"],
    "top-k keep=0.01 + error feedback": [
        "compression=topk",
        "compression.keep=0.01",
        "compression.error_feedback=true",
    ],
    "top-k keep=0.05": ["compression=topk", "compression.keep=0.05"],
    "top-k keep=0.01 + error feedback + catch-up": [
        "compression=topk",
        "compression.keep=0.01",
        "compression.error_feedback=true",
        "compression.catch_up=true",
    ],
}


SUITES: dict[str, tuple[list[str], dict[str, list[str]], str]] = {
    "compression": (["update=smart", "update.devices=2", "offload.grads=cpu"], SETTINGS, "SmartComp"),
    "state": (["offload.host_memory_budget=0"], {"fp32 state": ["offload.state_precision=fp32"],
                                                 "8-bit state": ["offload.state_precision=8bit"]},
              "optimizer state precision"),
}
"""Per suite: the overrides of every run, the settings (the first is the exact one), the plot's subject."""


def compose_run(overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(str(asset_dir("conf")), version_base=None):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def val_curve(metrics_csv: Path) -> list[tuple[int, float]]:
    with metrics_csv.open() as f:
        return [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r.get("val_loss")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="compression")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="convergence")
    parser.add_argument("--work", default="smartinf_runs/convergence")
    parser.add_argument("overrides", nargs="*", help="smartinf-train overrides for every run (after --)")
    args = parser.parse_args()
    register_configs()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    base_overrides, settings, subject = SUITES[args.suite]
    results = {}
    for name, extra in settings.items():
        slug = re.sub(r"[^a-z0-9.]+", "_", name.replace("-", ""))  # "top-k keep=0.01 + ..." -> "topk_keep_0.01_..."
        overrides = [*base_overrides, f"trainer.max_steps={args.steps}",
                     f"trainer.val_check_interval={max(args.steps // 6, 1)}", "trainer.limit_val_batches=8",
                     f"offload.nvme_path={work / slug / 'state'}", *args.overrides, *extra]  # fmt: skip
        run_dir = work / slug
        run_dir.mkdir(parents=True, exist_ok=True)
        result = run(compose_run(overrides), run_dir)
        assert result is not None, "one process: it is rank 0"
        summary = result["summary"]
        assert isinstance(summary, dict)
        results[name] = {
            "val_loss": result["val_loss"],
            "curve": val_curve(Path(str(result["metrics"]))),
            "host_link_B_per_param_step": summary["host_link_bytes_per_param_per_step"],
            "overrides": extra,
        }
    exact = next(iter(settings))
    base = results[exact]["val_loss"]
    lines = [
        f"| setting | validation loss after {args.steps} steps | vs {exact} | overrides |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / base - 1):+.2f}% | "
                     f"`{' '.join(r['overrides']) or '-'}` |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    (out / "convergence.md").write_text(table + "\n")
    (out / "convergence.json").write_text(json.dumps(results, indent=2))
    plt = extras.pyplot("smartinf-convergence's plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        steps, losses = zip(*r["curve"], strict=True)
        ax.plot(steps, losses, "o-", label=name)
    recipe = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("recipe=")), "gpt_tiny")
    ax.set(xlabel="optimizer step", ylabel="validation loss (nats/byte)", title=f"{subject}: convergence, {recipe}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=100)
    print(f"wrote {out / 'convergence.md'} and {out / 'convergence.png'}")


if __name__ == "__main__":
    main()
