#!/usr/bin/env bash
# Builds the extension for the device tool's GPU machines on this GPU-less machine, so a GPU call
# spends no device time compiling: the same Python (3.12) and torch (2.11.0+cu130) as that
# machine's image (see the device tool's KINDS.md), sm_90a only. The result lands in .gpu_build/
# (git-ignored); pass ".gpu_build" in the run's carry and bench/gpu_run.sh uses it when it loads.
#   bash scripts/build_for_gpu_machine.sh        (about 5 min: a venv download, then nvcc)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# The first Python 3.12 that runs (a pyenv shim may exist and still fail)
if [ -z "${PYTHON312:-}" ]; then
  for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3 /usr/bin/python3.12; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
      PYTHON312=$candidate; break
    fi
  done
fi
TORCH_VERSION=${GPU_TORCH_VERSION:-2.11.0}
VENV=${GPU_VENV:-/tmp/gptfast_gpu_venv}
[ -n "${PYTHON312:-}" ] || { echo "no Python 3.12 found (set PYTHON312)"; exit 1; }
if ! "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
  "$PYTHON312" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" ninja setuptools numpy
fi
WORK=$(mktemp -d)
git ls-files -z | xargs -0 -I{} cp --parents {} "$WORK"  # the tracked sources, nothing built
cd "$WORK"
# the digest of the sources this build compiles, which bench/gpu_run.sh compares with the tree it
# runs on before it uses the build (taken from the copy: the tree may change while nvcc runs)
bash scripts/sources_digest.sh > SOURCES
# GPTFAST_PORTABLE_GLIBC (csrc/module.cpp): no glibc newer than torch's own 2.28 asked for. (CFLAGS
# replaces Python's own compile flags, so they are passed along.)
PY_CFLAGS=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_config_var('CFLAGS') or '')")
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PATH=${CUDA_HOME:-/usr/local/cuda}/bin:$PATH MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  CFLAGS="$PY_CFLAGS ${CFLAGS:-} -DGPTFAST_PORTABLE_GLIBC" TORCH_CUDA_ARCH_LIST=9.0a GPTFAST_KERNELS_REQUIRE_CUDA=1 \
  "$VENV/bin/python" setup.py -q build_ext --inplace
newest_glibc_of() { objdump -T "$1" | grep -o "GLIBC_[0-9.]*" | sort -Vu | tail -1; }  # a shared object's
newest_glibc=$(newest_glibc_of gptfast_kernels/_C.abi3.so)
torch_glibc=$(newest_glibc_of "$("$VENV/bin/python" -c \
  "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))")")
if [ "$(printf '%s\n' "$newest_glibc" "$torch_glibc" | sort -V | tail -1)" != "$torch_glibc" ]; then
  echo "warning: the build asks for $newest_glibc, torch only for $torch_glibc: it may not load on the GPU machine"
fi
mkdir -p "$ROOT/.gpu_build"
cp gptfast_kernels/_C.abi3.so "$ROOT/.gpu_build/_C.abi3.so"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'sm_90a', end=' ')" > "$ROOT/.gpu_build/BUILD_INFO"
(cd "$ROOT" && git rev-parse --short HEAD) >> "$ROOT/.gpu_build/BUILD_INFO"
mv "$WORK/SOURCES" "$ROOT/.gpu_build/SOURCES"
rm -rf "$WORK"
echo "built $(du -h "$ROOT/.gpu_build/_C.abi3.so" | cut -f1) for the GPU machine: $(cat "$ROOT/.gpu_build/BUILD_INFO")"
