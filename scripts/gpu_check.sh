#!/usr/bin/env bash
# The GPU checks, as one prepared script for a session that is lent a GPU machine (docs/gpu.md):
#   1. the environment: torch's CUDA build, the device, the packages the project needs (carried wheels in .whl/);
#   2. the GPU-marked tests (tests/test_gpu.py: device copies, page-locked staging, fp32 equality on the GPU);
#   3. smartinf-bench on a recipe sized to the GPU, (a) DeepSpeed ZeRO-Infinity against (b) and (c);
#   4. a report, docs/gpu.md (with --dry-run: $OUT/gpu.md), from what ran.
#
#   scripts/gpu_check.sh              # on the GPU machine (the device tool runs it; results under $OUT)
#   scripts/gpu_check.sh --dry-run    # anywhere, on the CPU: every step at a tiny size, the report to $OUT
#
# The GPU machine reaches no package index: build the wheels here first (pure-Python ones, and DeepSpeed's, which
# compiles its ops on first use there): see docs/gpu.md, "Running it".
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
log() { echo "[gpu_check] $*" | tee -a "$OUT/gpu_check.log"; }

if [[ -d .whl ]] && (( ! DRY )); then
  log "installing the carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=${PYTHONPATH:-}:$PWD
fi

log "1. environment"
OUT=$OUT $PY - <<'EOF'
import json, os, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for name in ("lightning", "deepspeed", "hydra", "pyopencl"):
    try:
        info[name] = __import__(name).__version__
    except ImportError as err:
        info[name] = f"missing ({err})"
open(os.path.join(os.environ["OUT"], "environment.json"), "w").write(json.dumps(info))
print(json.dumps(info))
EOF
if (( ! DRY )) && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  log "no CUDA device visible: run with --dry-run on a machine without one"; exit 2
fi

log "2. GPU-marked tests"
set +e
$PY -m pytest tests/test_gpu.py -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/gpu_tests.log"
TESTS=${PIPESTATUS[0]}
set -e

log "3. smartinf-bench"
if (( DRY )); then
  BENCH=(--recipe gpt_tiny --layers 2 --seq 32 --micro-batches 2 --steps 1 --systems b c --accelerator cpu)
else
  # 24 x 1024 (GPT-350M shapes), sequence 1024, 8 micro-batches: a few seconds of GPU compute per iteration
  BENCH=(--recipe gpt_350m --seq 1024 --micro-batch 4 --micro-batches 8 --steps 3 --reps 2 --systems a b c
         --accelerator cuda)
fi
$PY -m lightning_smartinf.cli.bench "${BENCH[@]}" --out "$OUT/bench" --nvme-path "${NVME:-/tmp/smartinf_gpu_state}" \
  2>&1 | tail -n 40 | tee "$OUT/bench.log"

log "4. report"
REPORT=docs/gpu.md
(( DRY )) && REPORT=$OUT/gpu.md
$PY -m smartinf_tools.gpu_report "$OUT" --tests-status "$TESTS" --dry-run "$DRY" > "$REPORT"
log "wrote $REPORT"
exit "$TESTS"
