"""smartinf-train end to end: trains, validates, checkpoints, plots and reports where everything went."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def test_default_run_shortened(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "lightning_smartinf.cli.train", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2", f"trainer.output_dir={tmp_path / 'runs'}",
        f"offload.nvme_path={tmp_path / 'state'}", "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=4",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "smart_infinity summary" in done.stdout and "validation loss:" in done.stdout
    summary_path = next((tmp_path / "runs").glob("*/summary.json"))
    summary = json.loads(summary_path.read_text())
    assert summary["summary"]["optimizer_steps"] == 6
    assert Path(summary["plot"]).stat().st_size > 10_000
    assert (Path(summary["checkpoint"]) / "manifest.json").is_file()
    assert summary["val_loss"] < 5.6  # below uniform over bytes (ln 256 = 5.55) after 6 steps
    # the default budget (auto) holds the tiny model's gradients and state in RAM, and the summary says so
    placed = summary["summary"]["host_memory_placement"]
    assert re.search(r"gradients in RAM, .* of (\d+) of \1 subgroups in RAM", placed), placed
    assert "memory:  host memory budget" in done.stdout
    # what the traffic cost: the run's time split as the plot splits it, and the bytes each logged step moved
    assert re.search(r"time: +compute [\d.]+ s \(\d+%\), waiting on storage [\d.]+ s", done.stdout), done.stdout
    assert set(summary["summary"]["time_s"]) == {"compute", "storage", "update"}
    assert "host_read_MB" in (summary_path.parent / "logs" / "metrics.csv").read_text().splitlines()[0]

    periodic = summary_path.parent / "checkpoints"  # step 4 (kept) and the final step 6
    resume = [*cmd[:3], "trainer.max_steps=8", "trainer.limit_val_batches=2", *cmd[7:],
              f"trainer.output_dir={tmp_path / 'resumed'}", f"trainer.resume={periodic}"]  # fmt: skip
    done = subprocess.run(resume, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout + done.stderr and "step6.ckpt" in done.stdout + done.stderr
    resumed = json.loads(next((tmp_path / "resumed").glob("*/summary.json")).read_text())
    assert resumed["summary"]["optimizer_steps"] == 2 and Path(resumed["checkpoint"]).name == "step8.ckpt"


def test_a_run_too_short_to_log_finishes_and_says_why_it_has_no_plot(tmp_path: Path) -> None:
    """Fewer steps than trainer.log_every_n_steps and no validation: no metrics.csv, which used to fail the run after
    training (its checkpoint written) with a FileNotFoundError."""
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", "trainer.max_steps=2", "trainer.limit_val_batches=0",
           f"trainer.output_dir={tmp_path / 'runs'}", f"offload.nvme_path={tmp_path / 'state'}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validation loss: none (no validation batches)" in done.stdout
    assert "plot:            none (nothing logged: fewer steps than trainer.log_every_n_steps=5)" in done.stdout
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["plot"] is None and summary["val_loss"] is None and Path(summary["checkpoint"]).is_dir()


def test_unknown_recipe_is_a_hydra_error(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", "recipe=gpt_9000b"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0 and "gpt_9000b" in done.stderr


def test_two_ranks_train_checkpoint_and_resume_on_one(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "lightning_smartinf.cli.train", "trainer.devices=2", "trainer.max_steps=4",
        "trainer.limit_val_batches=2", "data.batch_size=4", f"offload.nvme_path={tmp_path / 'state'}",
    ]  # fmt: skip
    done = subprocess.run([*cmd, f"trainer.output_dir={tmp_path / 'runs'}"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("validation loss:") == 1 and "summed over 2 ranks" in done.stdout
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["summary"]["ranks"] == 2 and summary["summary"]["tokens"] == 4 * 2 * 4 * 128
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in (Path(summary["checkpoint"]) / "offload").iterdir()) == ["rank0", "rank1"]

    # on one rank, accumulating the other rank's batch: the state re-cut from both ranks' files
    resume = [*cmd[:3], "trainer.devices=1", "trainer.accumulate_grad_batches=2", "trainer.max_steps=6",
              "trainer.checkpoint_every_n_steps=2", *cmd[5:],
              f"trainer.output_dir={tmp_path / 'resumed'}", f"trainer.resume={summary['checkpoint']}"]  # fmt: skip
    done = subprocess.run(resume, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from a checkpoint of 2 rank(s), re-partitioned onto 1" in done.stdout + done.stderr
    # the first batch of the first window ends at step 4 still: not saved again there, mid-accumulation
    assert not re.search(r"smart_infinity: checkpoint \S*step4\.ckpt,", done.stdout + done.stderr)
    resumed = json.loads(next((tmp_path / "resumed").glob("*/summary.json")).read_text())
    assert resumed["summary"]["optimizer_steps"] == 2 and Path(resumed["checkpoint"]).name == "step6.ckpt"


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path: Path) -> None:
    """As a scheduler preempts: SIGTERM once training runs; the run checkpoints at the next step, exits 143 naming
    the checkpoint, and trainer.resume continues from it."""
    import signal
    import time

    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "lightning_smartinf.cli.train", "trainer.max_steps=100000",
           "trainer.val_check_interval=100000", f"trainer.output_dir={runs}", f"offload.nvme_path={tmp_path / 'state'}",
           "trainer.log_every_n_steps=1"]  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.monotonic() + 300
        while not list(runs.glob("*/logs/metrics.csv")) and time.monotonic() < deadline:  # a few steps logged
            time.sleep(0.5)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]
    saved = list(runs.glob("*/checkpoints/step*.ckpt"))
    assert len(saved) == 1 and (saved[0] / "manifest.json").is_file()
    assert f"SIGTERM: saved {saved[0]}" in out
    step = int(saved[0].name.removeprefix("step").removesuffix(".ckpt"))
    resume = [*cmd[:3], f"trainer.max_steps={step + 2}", *cmd[4:], f"trainer.resume={saved[0]}"]
    resume[resume.index(f"trainer.output_dir={runs}")] = f"trainer.output_dir={tmp_path / 'resumed'}"
    done = subprocess.run(resume, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads(next((tmp_path / "resumed").glob("*/summary.json")).read_text())
    assert resumed["summary"]["optimizer_steps"] == 2
