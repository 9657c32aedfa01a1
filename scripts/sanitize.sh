#!/usr/bin/env bash
# Runs the CUDA kernel tests under compute-sanitizer: memcheck (out-of-bounds / misaligned accesses)
# and racecheck (shared-memory races). Needs a GPU and a CUDA build; prints one verdict per tool
# and, for a tool that reports anything, each distinct report with a count. The full reports go to
# $SANITIZER_LOG_DIR/<tool>.log (default /tmp). TOOLS="racecheck" runs one tool.
set -uo pipefail
cd "$(dirname "$0")/.."
SANITIZER=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
command -v compute-sanitizer >/dev/null && SANITIZER=compute-sanitizer
LOG_DIR=${SANITIZER_LOG_DIR:-/tmp}
# Only the CUDA-backend op tests at small sizes: the sanitizer slows kernels down ~100x.
SELECT=${SELECT:-"cuda and not triton and not llama"}  # the Llama-size cases would take hours
status=0
for tool in ${TOOLS:-memcheck racecheck}; do
  echo "== compute-sanitizer --tool $tool"
  log="$LOG_DIR/$tool.log"
  "$SANITIZER" --tool "$tool" --error-exitcode 99 --target-processes all --print-limit 200 \
      python3 -m pytest python_tests/ops -q -x -k "$SELECT" -p no:cacheprovider > "$log" 2>&1
  rc=$?
  tail -n 3 "$log"
  if [ "$rc" -eq 0 ]; then
    echo "$tool: clean"
  else
    echo "$tool: REPORTS (exit $rc); distinct reports, then the first in full ($log):"
    grep -E "^========= +(Error|Warning|Race|Invalid|Program hit)" "$log" | sort | uniq -c | sort -rn | head -20
    grep -m1 -A25 -E "^========= +(Error|Warning|Invalid)" "$log"
    status=1
  fi
done
exit $status
