"""``python -m smartinf_tools.gpu_report OUT``: docs/gpu.md from what ``scripts/gpu_check.sh`` left in OUT
(the environment, the GPU-marked tests' outcome, smartinf-bench's table)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def tests_line(log: Path) -> str:
    """pytest's final summary line (``3 passed in 4.2s``), or why there is none."""
    if not log.is_file():
        return "not run"
    lines = [line for line in log.read_text().splitlines() if re.search(r"\b(passed|failed|skipped|error)", line)]
    return lines[-1].strip("= ") if lines else "no summary (see gpu_tests.log)"


RUNNING = """## Running it

The GPU machine has torch (CUDA), Lightning and transformers, and reaches no package index. Here, once:

```bash
echo /.whl/ >> .git/info/exclude
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
  hydra-core omegaconf antlr4-python3-runtime pyopencl pocl-binary-distribution platformdirs pytools siphash24
pip wheel --no-deps -w .whl deepspeed==0.19.8        # pure Python; its ops compile on first use there
```

Then the device tool runs `scripts/gpu_check.sh` with `.whl` carried (results under `$OUT`, this page rewritten).
Without a GPU, `scripts/gpu_check.sh --dry-run` runs every step on the CPU at a tiny size (under a minute) and
writes the report to `$OUT/gpu.md`: what this page shows until a session is lent a GPU.
"""


def report(out: Path, tests_status: int, dry_run: bool) -> str:
    env = json.loads((out / "environment.json").read_text()) if (out / "environment.json").is_file() else {}
    table = out / "bench" / "benchmarks.md"
    lines = [
        "# GPU checks (scripts/gpu_check.sh)",
        "",
        "A dry run on the CPU: every step ran at a tiny size; no GPU figures." if dry_run else
        "Measured on a lent GPU machine by `scripts/gpu_check.sh`.",
        "",
        "## Environment",
        "",
        *[f"- {key}: {value}" for key, value in env.items()],
        "",
        "## GPU-marked tests (`tests/test_gpu.py`)",
        "",
        f"{tests_line(out / 'gpu_tests.log')} (exit status {tests_status})",
        "",
        "## smartinf-bench",
        "",
        table.read_text().strip() if table.is_file() else "not run (see bench.log)",
        "",
        RUNNING,
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpu_report", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tests-status", type=int, default=0)
    parser.add_argument("--dry-run", type=int, default=0)
    args = parser.parse_args(argv)
    print(report(args.out, args.tests_status, bool(args.dry_run)))


if __name__ == "__main__":
    main()
