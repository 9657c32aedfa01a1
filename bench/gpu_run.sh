#!/usr/bin/env bash
# The GPU proof, for a bare H100/H200 machine (the device tool), in stages that each end well inside
# the tool's 10-minute limit per command, so they can be spread over calls:
#
#   bash bench/gpu_run.sh OUT_DIR [STAGE ...]        (default: every stage, in this order)
#
#   build        the extension in place (MAX_JOBS=16, sm_90a); skipped when a prebuilt one that
#                loads with CUDA kernels for this torch, built from the same csrc/ and setup.py, is
#                carried in .gpu_build/ (scripts/build_for_gpu_machine.sh makes it on a machine
#                without a GPU)
#   tests        the whole suite with CUDA (TESTS="paths/options" for part of it, TESTS_K="a -k
#                expression") -> tests.log
#   sanitize     compute-sanitizer memcheck + racecheck, CUDA op tests   -> sanitizer.log
#   kernels      microbenchmarks of the four ops + copy bandwidth   -> <device>_<date>_<commit>_<benches>.json
#                then bench/check_auto.py: where backend="auto" picks the slower kernel
#   int8-kernels the CUDA int8 op's other kernels (GPTFAST_INT8_CUDA_KERNEL), against the default
#                kernels' figures from `kernels`: M = 1 on tensor cores instead of the FMA GEMV
#                (-> ..._int8_linear_one_row.json), and 4-16 rows on the FMA GEMV instead of
#                tensor cores (-> ..._int8_linear_multi_row.json)
#   int8-gemv    the one-row CUDA GEMV's shapes (GPTFAST_INT8_GEMV: unroll depth, features per warp;
#                GPTFAST_INT8_CUDA_KERNEL=fma, so every layer takes them) and one row on tensor
#                cores, each in a process of its own, over a decode step's
#                layers back to back in a CUDA graph (--cases layers,one_row) -> ..._int8_gemv.json
#   pdl          programmatic dependent launches: the default (the CUDA int8 kernels' launches
#                programmatic, the Triton decode attention's not) against GPTFAST_CUDA_PDL=0 (none)
#                and GPTFAST_CUDA_PDL=1 (both), each in a process of its own: a decode step's linears
#                and attention calls in a graph (-> ..._int8_linear-kv_cache_attention_layers-step.json,
#                ..._layers_nopdl.json, ..._layers_pdl.json; the default's rows include "read_floor_*",
#                a kernel that only reads the same bytes: bench/read_floor.py, the Triton decode
#                with its fused combine, "ours_triton_fused_combine*", and the `step` rows: a whole
#                Llama-3-8B decode step's 129 int8 projections at batch 1 / 8 / 32, fused as the
#                patched model runs them), and `generate` batch 1 at the default,
#                with none and with both (-> ..._generate_batch1.json, ..._nopdl.json, ..._pdl.json;
#                rows' tokens_digest equal when the launch choices change no token)
#   pdl-inductor `generate` batch 1 with every kernel of the compiled step programmatic: ours
#                (GPTFAST_CUDA_PDL=1) and inductor's (TORCHINDUCTOR_ENABLE_PDL=1, torch's option)
#                -> ..._generate_batch1_pdl_inductorpdl.json (its tokens_digest against pdl's)
#   tiles        Triton int8 tile sweep, 2-64 rows (bench_int8_tiles) -> ..._int8_tiles.json
#   kv-tiles     Triton decode launch-constant sweep (bench_kv_tiles; KV_TILES_QUICK=1: its quick cases)
#                                                                     -> ..._kv_tiles.json
#   profile      Nsight Compute on one call of each kernel (bench/profile_kernels.py) -> ncu.txt
#   generate     end to end, Llama-3-8B shapes, batch 1               -> ..._generate_batch1.json
#   breakdown    where that decode step's time goes (profiled CUDA-graph replays, batch 1 and 8, 4k
#                context): int8 projections, attention, other kernels, idle -> ..._step_breakdown.json
#   generate-batched   the same at batch 8 and 32                     -> ..._generate_batch32-batch8.json
#   generate-small     the same for Qwen2.5-0.5B's shapes, batch 1: a step short enough that the
#                host's per-step work may set the pace (host_fraction near 1) -> ..._generate_small.json
#   generate-mla the same for multi-head latent attention, DeepSeek-V2-Lite's attention, batch 1 and 8
#                                                                     -> ..._generate_mla.json
#   generate-llama4    the same for Llama 4 (4 of Llama-4-Scout's layers), batch 1 and 8
#                                                                     -> ..._generate_llama4.json
#   generate-mamba2    the same for Mamba-2 2.7B's shapes (attention-free), batch 1 and 8
#                                                                     -> ..._generate_mamba2.json
#   speculative  rounds/s at B = 1 / 8 / 32, 8B-shape target + 4-layer draft -> ..._speculative_rounds.json
#   speculative-hybrid a hybrid's verification forward with its state rollback (Qwen3.5-9B layout,
#                Mamba-2 2.7B's, LFM2-1.2B's and Mamba-2.8B's shapes; compiled) against decode steps
#                                                   -> ..._speculative_hybrid-lfm2-mamba-mamba2.json
#   speculative-assistant   a Gemma 4 assistant drafting for a Gemma 4 target (random weights),
#                B = 1 / 8, against transformers' assisted generation -> ..._speculative_assistant.json
#   continuous   ContinuousBatcher against generate over static batches, and SpeculativeBatcher
#                (prompt lookup) against prompt_lookup_generate over them; 32 requests of mixed
#                lengths, Llama-3.2-1B shapes, compiled                -> ..._continuous.json
#   speculative-demo   the demo's trained models end to end           -> ..._speculative_demo.json
#                (carry .demo_cache to skip the demo's training)
#   compiled-step      the demo's models, compiled `generate` and `speculative_generate`, their steps
#                without dynamo's guards on the modules (the default) against every guard: the
#                host's per-call work between graph replays   -> ..._compiled_step.json (carry .demo_cache)
#
# Every stage runs (a failing one does not stop the next) while the time budget lasts; the exit
# code says whether all passed.
# Logs of the bench stages go to bench.log. The device tool brings back 8 files at most (past that,
# the JSON results are packed into results_json.tar.gz at the end): one call
# per group of stages. Seen on an H100 (2026-11-23): tests 140 s (8 workers), sanitize about 4 min,
# kernels 130 s, generate 85 s, generate-batched 215 s, speculative 250 s; so e.g.
# "tests sanitize", "kernels tiles", "kv-tiles profile generate", "generate-batched speculative",
# "speculative-demo".
# GPTFAST_COMMIT names the measured commit where .git is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench/results}}
shift || true
STAGES=${*:-build tests sanitize kernels int8-kernels pdl pdl-inductor tiles kv-tiles profile generate breakdown generate-batched generate-small generate-mla generate-llama4 generate-mamba2 speculative speculative-hybrid speculative-assistant continuous speculative-demo compiled-step}
case " $STAGES " in *" build "*) ;; *) STAGES="build $STAGES" ;; esac  # every other stage needs it
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} GPTFAST_KERNELS_REQUIRE_CUDA=1
export GPTFAST_COMMIT=${GPTFAST_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ "$GPTFAST_COMMIT" != unknown ] || echo "warning: no git and no GPTFAST_COMMIT: the results will not name their commit"
PY=${PYTHON:-python3}
# Seconds for the whole call (the device tool stops a command at 600 s): each stage gets what is left,
# so a slow or hung stage is stopped in time for its logs and partial results to come back.
BUDGET=${BUDGET:-570}
failed=()

# Every timeout below sends its signal, then KILL after KILL_AFTER s to a process whose handler never
# runs (stuck in C: a synchronize on a hung kernel); time_left keeps that margin and 5 s for the logs.
KILL_AFTER=10
time_left() {  # seconds of the budget a command started now may take
  echo $((BUDGET - SECONDS - KILL_AFTER - 5))
}

has_cuda_kernels() {
  "$PY" - <<'PY' 2>/dev/null
import sys
from gptfast_kernels import _extension
sys.exit(0 if _extension.extension_loaded() and not _extension.ops_without_kernel("CUDA") else 1)
PY
}

stage_build() {
  if [ -f .gpu_build/_C.abi3.so ] && [ ! -f gptfast_kernels/_C.abi3.so ] &&
     [ "$(cat .gpu_build/SOURCES 2>/dev/null)" != "$(bash scripts/sources_digest.sh)" ]; then
    echo "the prebuilt extension in .gpu_build was built from other sources than csrc/ here" \
         "($(cat .gpu_build/SOURCES 2>/dev/null) there, $(bash scripts/sources_digest.sh) here; locale ${LC_ALL:-${LANG:-unset}}); building"
  elif [ -f .gpu_build/_C.abi3.so ] && [ ! -f gptfast_kernels/_C.abi3.so ]; then
    cp .gpu_build/_C.abi3.so gptfast_kernels/_C.abi3.so
    if has_cuda_kernels; then echo "using the prebuilt extension from .gpu_build ($(cat .gpu_build/BUILD_INFO 2>/dev/null))"; return 0; fi
    echo "the prebuilt extension does not load here: $("$PY" -c 'from gptfast_kernels import _extension as e; print(e.EXTENSION_ERROR or e.ops_without_kernel("CUDA"))' 2>&1 | tail -1); building"
    rm -f gptfast_kernels/_C.abi3.so
  fi
  if has_cuda_kernels; then echo "extension already built"; return 0; fi
  # The system compiler first, not the image's CXX / CC (/opt/gcc on the H200 image, 2026-11-28):
  # the extension that one linked held a static copy of libstdc++ even with setup.py's -lstdc++,
  # and crashed formatting any number in an error message. Should the system compiler fail (not
  # yet tried there: it may be too old for torch or nvcc), the image's builds an extension that
  # works but for those messages: better than none.
  local cxx=${GPU_CXX:-$(command -v g++ || echo "${CXX:-c++}")} cc=${GPU_CC:-$(command -v gcc || echo "${CC:-cc}")}
  build_with "$cxx" "$cc"
  if ! has_cuda_kernels && [ -n "${CXX:-}" ] && [ "$CXX" != "$cxx" ]; then
    echo "no working extension from $cxx; building with the image's compiler, $CXX"
    build_with "$CXX" "${CC:-cc}"
  fi
  if command -v readelf > /dev/null && ! readelf -d gptfast_kernels/_C.abi3.so | grep -q "libstdc++"; then
    echo "warning: the extension does not list libstdc++.so (a static copy: its error messages may crash)"
  fi
  has_cuda_kernels
}

build_with() {  # CXX CC: the extension in place, with those compilers, in the time left
  local start=$SECONDS left=$(time_left)
  if [ "$left" -lt 30 ]; then echo "no time left to build with $1"; return 1; fi
  echo "building with $1 / $2"
  CXX=$1 CC=$2 timeout -k "$KILL_AFTER" "$left" "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v "WARNING: Location" | tail -20
  echo "build took $((SECONDS - start)) s (rc ${PIPESTATUS[0]})"
}

# The GPU-relevant tests first (op kernels, then the stack on CUDA), the rest (which CI also runs
# without a GPU) last, each part with the time left, so a tight budget loses the least telling part.
stage_tests() {
  local parts=("python_tests/ops" "python_tests/generation/test_cuda.py"
               "python_tests --ignore=python_tests/ops --ignore=python_tests/generation/test_cuda.py")
  [ -n "${TESTS:-}" ] && parts=("$TESTS")
  local status=0 part left extra="" select=()
  # TESTS_K: a pytest -k expression over every part (e.g. the CUDA / Triton-on-GPU cases alone)
  [ -n "${TESTS_K:-}" ] && select=(-k "$TESTS_K")
  # TEST_WORKERS (default 8) share the GPU (pytest-xdist, in the device image); a hung test fails alone
  "$PY" -c "import xdist" 2>/dev/null && extra="-n ${TEST_WORKERS:-8}"
  # TEST_TIMEOUT (default 120 s): a hung test fails alone, well inside a stage's budget
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra="$extra --timeout ${TEST_TIMEOUT:-120}"
  for part in "${parts[@]}"; do
    left=$(time_left)
    if [ "$left" -lt 20 ]; then echo "tests: no time left for $part" | tee -a "$OUT_DIR/tests.log"; status=1; continue; fi
    echo "== pytest $part" | tee -a "$OUT_DIR/tests.log"
    # shellcheck disable=SC2086  (a part may hold several paths / options)
    # (SIGINT: pytest stopped by the budget still prints which tests failed; TERM lost the summary)
    timeout -s INT -k "$KILL_AFTER" "$left" "$PY" -m pytest $part "${select[@]}" $extra -q -p no:cacheprovider -rfE 2>&1 | tee -a "$OUT_DIR/tests.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  return $status
}

stage_sanitize() {
  SANITIZER_LOG_DIR=$OUT_DIR timeout -k "$KILL_AFTER" "$STAGE_TIMEOUT" bash scripts/sanitize.sh 2>&1 | tee "$OUT_DIR/sanitizer.log" | tail -60
}

# Nsight Compute on one call of each kernel whose tuning is open (bench/profile_kernels.py): the
# full report in ncu.txt, the key lines of each kernel on screen. Clocks are left as they are.
stage_profile() {
  local ncu
  ncu=$(command -v ncu || echo "$CUDA_HOME/bin/ncu")
  timeout -k "$KILL_AFTER" "$STAGE_TIMEOUT" "$ncu" --clock-control none -k "regex:$("$PY" -m bench.profile_kernels --kernels)" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    "$PY" -m bench.profile_kernels > "$OUT_DIR/ncu.txt" 2>&1
  local rc=$?
  grep -E "^case:|^  [A-Za-z_].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Stall" \
    "$OUT_DIR/ncu.txt" | head -300
  return $rc
}

# One process per kernel choice (each is read once per process), their rows merged into one file.
# The GEMV's shapes run with GPTFAST_INT8_CUDA_KERNEL=fma: by default one row of a layer with K > N
# (4096 x 14336) goes to tensor cores, whatever GPTFAST_INT8_GEMV says. The untimed shapes first
# (u4s, u4p), then the default (u4f1) and tensor cores, then the shapes e9ab4ef timed.
stage_int8_gemv() {
  local tmp="$OUT_DIR/int8_gemv_parts" choice left status=0  # (in OUT_DIR: a run killed from outside keeps them)
  mkdir -p "$tmp"
  for choice in u4s u4p u4f1 tensor_core u8f1 u16f1 u4f2 u8f2; do
    left=$(time_left)
    if [ "$left" -lt 20 ]; then echo "int8-gemv: no time left for $choice and after"; status=1; break; fi
    if [ "$choice" = tensor_core ]; then set -- GPTFAST_INT8_CUDA_KERNEL=tensor_core
    else set -- GPTFAST_INT8_CUDA_KERNEL=fma GPTFAST_INT8_GEMV="$choice"; fi
    env "$@" timeout -k "$KILL_AFTER" "$left" "$PY" -m bench.run --ops int8_linear --cases layers,one_row \
      --out "$tmp/$choice.json" 2>&1 | tee -a "$OUT_DIR/bench.log" | grep "@graph"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  "$PY" - "$tmp" "$OUT_DIR" <<'PY'
import glob, json, os, re, sys
runs = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:  # (a process stopped while writing leaves a truncated file: the others' rows still count)
        runs.append(json.load(open(path)))
    except ValueError as error:
        print(f"skipped {os.path.basename(path)}: {error}")
if runs:
    meta = {k: v for k, v in runs[0]["meta"].items() if not k.startswith("GPTFAST_")}
    device = re.sub(r"[^A-Za-z0-9]+", "-", meta["device"]).strip("-").lower()
    out = os.path.join(sys.argv[2], f"{device}_{meta['date'][:10]}_{meta['commit']}_int8_gemv.json")
    json.dump({"meta": meta, "rows": [row for run in runs for row in run["rows"]]}, open(out, "w"), indent=1)
    print("wrote", out)
PY
  rm -rf "$tmp"
  return $status
}

bench() {  # bench <comma-separated benches> [bench.run options], in the budget's time left
  local ops=$1 left=$(time_left); shift
  if [ "$left" -lt 20 ]; then echo "bench $ops $*: no time left" | tee -a "$OUT_DIR/bench.log"; return 1; fi
  timeout -k "$KILL_AFTER" "$left" "$PY" -m bench.run --ops "$ops" --out-dir "$OUT_DIR" "$@" 2>&1 | tee -a "$OUT_DIR/bench.log" | tail -60
  return "${PIPESTATUS[0]}"
}

check_auto_latest() {  # bench/check_auto.py over the latest `kernels` file: where "auto" picks the slower kernel
  local latest
  latest=$(ls -t "$OUT_DIR"/*_int8_linear-int8_expert_linear-kv_cache_attention-verify_draft.json 2>/dev/null | head -1)
  [ -n "$latest" ] || { echo "check_auto: no kernels file"; return 1; }
  "$PY" -m bench.check_auto "$latest" | tee -a "$OUT_DIR/bench.log"
  return "${PIPESTATUS[0]}"
}

every() {  # every "command" ...: each run (one failing does not skip the rest); 0 when all passed
  local command status=0
  for command in "$@"; do eval "$command" || status=1; done
  return $status
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  echo "commit $GPTFAST_COMMIT"
  "$PY" -c "import torch, triton, transformers, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'triton', triton.__version__, 'transformers', transformers.__version__, 'pytest', pytest.__version__)"
} 2>&1 | tee -a "$OUT_DIR/gpu.txt"
# (without a GPU every stage "passed" on the CPU: the tests skipped, the benches measured nothing or the CPU)
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "torch sees no CUDA device: stopping" | tee -a "$OUT_DIR/gpu.txt"; exit 1
fi

for stage in $STAGES; do
  STAGE_TIMEOUT=$(time_left)
  if [ "$STAGE_TIMEOUT" -lt 30 ]; then
    echo "== $stage: skipped, only $((BUDGET - SECONDS)) s of the budget left" | tee -a "$OUT_DIR/gpu.txt"
    failed+=("$stage"); continue
  fi
  echo "== $stage ($(date -u +%T), at most $STAGE_TIMEOUT s)"
  start=$SECONDS
  case "$stage" in
    build) stage_build ;;
    tests) stage_tests ;;
    sanitize) stage_sanitize ;;
    kernels) every "bench int8_linear,int8_expert_linear,kv_cache_attention,verify_draft" \
                   "check_auto_latest" ;;
    int8-gemv) stage_int8_gemv ;;
    pdl) every "bench int8_linear,kv_cache_attention --cases layers,step" \
               "GPTFAST_CUDA_PDL=0 bench int8_linear,kv_cache_attention --cases layers" \
               "GPTFAST_CUDA_PDL=1 bench int8_linear,kv_cache_attention --cases layers" \
               "bench generate --cases batch1" \
               "GPTFAST_CUDA_PDL=0 bench generate --cases batch1" \
               "GPTFAST_CUDA_PDL=1 bench generate --cases batch1" ;;
    pdl-inductor) GPTFAST_CUDA_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1 bench generate --cases batch1 ;;
    int8-kernels) every "GPTFAST_INT8_CUDA_KERNEL=tensor_core bench int8_linear --cases one_row" \
                        "GPTFAST_INT8_CUDA_KERNEL=fma bench int8_linear --cases multi_row" ;;
    tiles) bench int8_tiles ;;
    kv-tiles) bench kv_tiles ${KV_TILES_QUICK:+--quick} ;;
    profile) stage_profile ;;
    generate) bench generate --cases batch1 ;;
    breakdown) bench step_breakdown ;;
    generate-batched) bench generate --cases batch8,batch32 ;;
    generate-small) bench generate --cases small ;;
    generate-mla) bench generate --cases mla ;;
    generate-llama4) bench generate --cases llama4 ;;
    generate-mamba2) bench generate --cases mamba2 ;;
    speculative) bench speculative --cases rounds ;;
    speculative-hybrid) bench speculative --cases hybrid,mamba2,lfm2,mamba ;;
    speculative-assistant) bench speculative --cases assistant ;;
    continuous) bench continuous ;;
    speculative-demo) bench speculative --cases demo ;;
    compiled-step) bench compiled_step ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  rc=$?
  echo "== $stage: rc $rc in $((SECONDS - start)) s" | tee -a "$OUT_DIR/gpu.txt"
  [ "$rc" -eq 0 ] || failed+=("$stage")
  if [ "$stage" = build ] && [ "$rc" -ne 0 ]; then echo "no extension: stopping"; exit 1; fi
done
# The device tool brings back 8 files at most (MAX_FILES): past that, the JSON results travel as
# one archive (tar xzf it into bench/results/).
files=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
jsons=$(cd "$OUT_DIR" && ls -- *.json 2>/dev/null)
if [ "$files" -gt "${MAX_FILES:-8}" ] && [ -n "$jsons" ]; then
  # shellcheck disable=SC2086  (file names without spaces, made by bench/run.py)
  (cd "$OUT_DIR" && tar czf results_json.tar.gz $jsons && rm -f $jsons) &&
    echo "$files files: the JSON results packed into $OUT_DIR/results_json.tar.gz" | tee -a "$OUT_DIR/gpu.txt"
fi
[ ${#failed[@]} -eq 0 ] || { echo "FAILED stages: ${failed[*]}"; exit 1; }
