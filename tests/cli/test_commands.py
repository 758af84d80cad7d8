"""The measurement commands run and print what docs/ quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_module(module: str, *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_traffic_table(tmp_path: Path) -> None:
    out = run_module("lightning_smartinf.cli.traffic", "--layers", "1", "--width", "64", "--devices", "2",
                     cwd=tmp_path)  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and "**" in line]
    totals = [row.split("**")[1] for row in rows]
    assert totals[:4] == ["32.00", "8.00", "8.00", "4.00"]
    assert 4.0 < float(totals[4]) < float(totals[5]) <= 4.1  # SmartComp, keep=0.01; with catch-up's squares


def test_kernel_bench_small(tmp_path: Path) -> None:
    out = run_module("lightning_smartinf.cli.kernel_bench", "--params", "100000", "--reps", "1",
                     "--json", str(tmp_path / "k.json"), cwd=tmp_path)  # fmt: skip
    assert "OpenCL / DeepSpeed throughput" in out and (tmp_path / "k.json").is_file()
    assert "host_adam_8bit (" in out and "host with 8-bit state / DeepSpeed (fp32 state) throughput" in out


def test_train_with_smart_update(tmp_path: Path) -> None:
    out = run_module("lightning_smartinf.cli.train", "update=smart", "update.devices=2", "trainer.max_steps=4",
                     "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                     f"trainer.output_dir={tmp_path / 'runs'}", f"offload.nvme_path={tmp_path / 'state'}",
                     cwd=tmp_path)  # fmt: skip
    assert "smart (2 OpenCL device(s)" in out and "device1/read" in out
    assert (tmp_path / "state" / "device1" / "master").is_dir()


def test_schedule_bench_small(tmp_path: Path) -> None:
    out = run_module("lightning_smartinf.cli.schedule_bench", "--layers", "2", "--width", "32", "--heads", "2",
                     "--vocab", "256", "--seq", "16", "--micro-batches", "2", "--steps", "1", "--warmup", "1",
                     "--modes", "vertical + overlap + eager", "--out", str(tmp_path / "out"),
                     "--nvme-path", str(tmp_path / "state"), "--ram-path", str(tmp_path / "ram"), "--probe-gb", "0.05",
                     cwd=tmp_path)  # fmt: skip
    row = next(line for line in out.splitlines() if line.startswith("| 2 | vertical + overlap + eager |"))
    assert len(row.split("|")) == 14 and row.endswith("% |")  # 12 columns, the last the share of the roofline
    assert (tmp_path / "out" / "schedule_bench.png").is_file() and not (tmp_path / "ram").exists()


def test_bench_against_deepspeed_small(tmp_path: Path) -> None:
    """The real DeepSpeed ZeRO-3 NVMe engine and ours on a tiny GPT: the table, plot and config appear."""
    out = run_module("lightning_smartinf.cli.bench", "--recipe", "gpt_tiny", "--layers", "2", "--seq", "32",
                     "--micro-batches", "2", "--steps", "1", "--systems", "a", "s", "--out", str(tmp_path / "out"),
                     "--nvme-path", str(tmp_path / "state"), cwd=tmp_path)  # fmt: skip
    assert "| (a) DeepSpeed ZeRO-Infinity |" in out
    row = next(line for line in out.splitlines() if line.startswith("| (s) smart_infinity, defaults |"))
    assert len(row.split("|")) == 15 and row.endswith("x |")  # 13 columns, the last the step over the bound
    assert "Compute (forward and backward" in out
    config = (tmp_path / "out" / "deepspeed_config.json").read_text()
    assert '"intra_op_parallelism": 2' in config and '"device": "nvme"' in config
    assert (tmp_path / "out" / "benchmarks.png").stat().st_size > 10_000


def test_plan_for_a_described_machine(tmp_path: Path) -> None:
    out = run_module("lightning_smartinf.cli.plan", "--recipe", "gpt_2_7b", "--hardware", "smart_infinity_a100",
                     "--seq", "1024", "--micro-batch", "16", "--micro-batches", "1", "--sweep-devices", "4",
                     "--plot", str(tmp_path / "sweep.png"), cwd=tmp_path)  # fmt: skip
    assert "| (d) + SmartUpdate |" in out and "recommended:" in out and "storage (per device)" in out
    assert "settings: smartinf-train recipe=gpt_2_7b offload.grads=cpu" in out
    assert (tmp_path / "sweep.png").is_file()


def test_plan_of_an_architecture_recipe_with_lora_streams_the_frozen_base(capsys) -> None:
    """llama3_70b counted on meta; with LoRA only the adapters have state, and the base's reads bound the step."""
    from lightning_smartinf.cli.plan import main as plan_main

    plan_main(["--recipe", "llama3_70b", "--hardware", "greedysnake_a100"])
    full = capsys.readouterr().out
    plan_main(["--recipe", "llama3_70b", "--hardware", "greedysnake_a100", "--lora-rank", "16"])
    lora = capsys.readouterr().out
    assert "llama3_70b: 70.55 B parameters" in full and "step_io" in full
    assert "65.5 M trainable adapters over a frozen base of 70.55 B" in lora and "peft=lora peft.r=16" in lora
    assert "| (c) + vertical + overlap |" in lora and "params_io" in lora


def test_plan_with_8bit_state_counts_the_parameters_that_keep_fp32_state(capsys) -> None:
    """gpt_350m: the embeddings ((50,304 + 1,024) x 1,024) and each layer's tensors under 4,096 elements (norms,
    the attention's and the MLP projection's biases: 9 x 1,024) keep fp32 state, as the run's layout stores them."""
    from lightning_smartinf.cli.plan import main as plan_main

    plan_main(["--recipe", "gpt_350m", "--hardware", "greedysnake_a100", "--state-precision", "8bit"])
    out = capsys.readouterr().out
    fp32 = (50_304 + 1_024) * 1_024 + 24 * 9 * 1_024 + 2 * 1_024
    share = fp32 / (24 * (12 * 1_024**2 + 13 * 1_024) + (50_304 + 1_024) * 1_024 + 2 * 1_024)
    per_param = 4 + 2 * (share * 4 + (1 - share) * (1 + 4 / 2048))
    assert f"8bit state: {per_param:.2f} B/param" in out and f"{share:.1%} of the parameters keep fp32" in out
    plan_main(["--recipe", "gpt_350m", "--hardware", "greedysnake_a100", "--state-precision", "8bit",
               "--min-8bit-size", "0", "--no-fp32-embedding-state"])  # fmt: skip
    out = capsys.readouterr().out
    assert "8bit state: 6.00 B/param" in out and "offload.min_8bit_size=0 offload.fp32_embedding_state=false" in out
