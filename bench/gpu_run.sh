#!/usr/bin/env bash
# The whole GPU proof in one command, for a bare H100/H200 machine (the device tool):
#   build the extension (MAX_JOBS=16, sm_90a), run the full test suite with CUDA, run the CUDA tests
#   under compute-sanitizer (memcheck, racecheck), run every benchmark (copy bandwidth measured in
#   the same run), and write logs + JSON into OUT_DIR (default: $OUT, else bench/results).
# Usage: bash bench/gpu_run.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench/results}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} GPTFAST_KERNELS_REQUIRE_CUDA=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT_DIR/gpu.txt"

echo "== build"
start=$(date +%s)
"$PY" setup.py -q build_ext --inplace 2>&1 | tail -20 || { echo "build failed"; exit 1; }
echo "build took $(( $(date +%s) - start )) s"
"$PY" -m gptfast_kernels info | tee -a "$OUT_DIR/gpu.txt"

echo "== tests (CUDA)"
"$PY" -m pytest python_tests -q -x -p no:cacheprovider 2>&1 | tee "$OUT_DIR/tests.log" | tail -25

echo "== compute-sanitizer"
bash scripts/sanitize.sh 2>&1 | tee "$OUT_DIR/sanitizer.log" | tail -15

echo "== benchmarks"
"$PY" -m bench.run --out "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.log" | tail -80
