#!/usr/bin/env bash
# Runs the CUDA kernel tests under compute-sanitizer: memcheck (out-of-bounds / misaligned accesses)
# and racecheck (shared-memory races). Needs a GPU and a CUDA build; prints one verdict per tool.
set -uo pipefail
cd "$(dirname "$0")/.."
SANITIZER=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
command -v compute-sanitizer >/dev/null && SANITIZER=compute-sanitizer
# Only the CUDA-backend op tests at small sizes: the sanitizer slows kernels down ~100x.
SELECT=${SELECT:-"cuda and not triton and not llama"}  # the Llama-size cases would take hours
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  if "$SANITIZER" --tool "$tool" --error-exitcode 99 --target-processes all \
      python3 -m pytest python_tests/ops -q -x -k "$SELECT" -p no:cacheprovider 2>&1 | tail -8; then
    echo "$tool: clean"
  else
    echo "$tool: ERRORS (exit ${PIPESTATUS[0]})"; status=1
  fi
done
exit $status
