#!/usr/bin/env bash
# One-step set-up on a fresh machine: torch, the test/runtime dependencies, and this package
# built in place with its C++ and (when nvcc is found) CUDA kernels. Idempotent: a second run
# builds nothing when the sources, torch and the build switches are unchanged (scripts/build_stamp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PYTHON" -m pip install -q ninja "transformers>=5.8,<6" numpy "pytest>=8" "hypothesis>=6" scipy

if [ -x "$CUDA_HOME/bin/nvcc" ]; then
  # nvcc is here: the CUDA kernels must build, or set-up fails loudly (no silent CPU-only build).
  export GPTFAST_KERNELS_REQUIRE_CUDA=${GPTFAST_KERNELS_REQUIRE_CUDA:-1}
  export PATH="$CUDA_HOME/bin:$PATH"
else
  echo "setup: no nvcc at $CUDA_HOME; building the CPU kernels only" >&2
fi
# A run after a checked build skips it when nothing the extension depends on changed
# (scripts/build_stamp.sh) and this checkout is the installed package; the check below runs either way.
# The stamp also holds the checked extension's own digest, so one built otherwise since is rebuilt.
STAMP=gptfast_kernels/.build_stamp
EXTENSION=gptfast_kernels/_C.abi3.so
stamp=$(PYTHON="$PYTHON" bash scripts/build_stamp.sh)
built() { echo "$stamp extension=$(sha256sum "$EXTENSION" | cut -c1-16)"; }
installed_here() {
  [ "$(cd / && "$PYTHON" -c "import gptfast_kernels, os; print(os.path.realpath(os.path.dirname(gptfast_kernels.__file__)))" 2>/dev/null)" \
    = "$(realpath gptfast_kernels)" ]
}
if [ -f "$EXTENSION" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$(built)" ] && installed_here; then
  echo "setup: the extension was built from these sources with this torch already (scripts/build_stamp.sh); not rebuilding"
  export GPTFAST_SETUP_BUILT=0
else
  rm -f "$STAMP"
  # --no-build-isolation: the extension must be compiled against the torch installed above.
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" -m pip install -q --no-build-isolation -e .
  export GPTFAST_SETUP_BUILT=1
fi

"$PYTHON" - <<'PY'
import os, sys
from gptfast_kernels import _extension
if not _extension.extension_loaded():
    sys.exit(f"setup: gptfast_kernels._C failed to load: {_extension.EXTENSION_ERROR}")
if os.environ.get("GPTFAST_KERNELS_REQUIRE_CUDA") == "1":
    missing = _extension.ops_without_kernel("CUDA")
    if missing:
        sys.exit(f"setup: the extension loaded but has no CUDA kernels for {missing}")
    how = "compiled, linked and" if os.environ["GPTFAST_SETUP_BUILT"] == "1" else "(an earlier build's)"
    print(f"setup: CUDA kernels {how} registered for", list(_extension._OPS_WITH_KERNELS))
PY
built > "$STAMP"
