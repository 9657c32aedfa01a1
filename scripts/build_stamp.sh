#!/usr/bin/env bash
# One line naming everything the built extension depends on: the sources (csrc/ and setup.py, as
# sources_digest.sh hashes them), pyproject.toml, the Python and torch that build it, whether the CUDA
# kernels are required or skipped, the architectures asked for, and the nvcc that compiles them.
# scripts/setup.sh writes it beside the extension after a build it has checked, and builds again only
# when the line it computes differs (pip's editable install compiles everything in a fresh temporary
# directory each time: about 9 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
nvcc_version=none
if [ -x "$nvcc" ]; then nvcc_version=$("$nvcc" --version | tail -1 | tr -s ' ' '_'); fi
interpreter=$("$PYTHON" -c 'import sys, torch; print(f"python={sys.version.split()[0]} torch={torch.__version__}")')
echo "sources=$(bash scripts/sources_digest.sh) pyproject=$(sha256sum pyproject.toml | cut -c1-16)" \
     "$interpreter require_cuda=${GPTFAST_KERNELS_REQUIRE_CUDA:-0} skip_cuda=${GPTFAST_KERNELS_SKIP_CUDA:-0}" \
     "archs=${TORCH_CUDA_ARCH_LIST:-default} nvcc=$nvcc_version"
