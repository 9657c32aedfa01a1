"""Builds the one compiled extension, ``gptfast_kernels._C``.

C++ (CPU) sources in csrc/ are always compiled. CUDA sources in csrc/cuda/ are compiled whenever
torch was built with CUDA and nvcc is found; no GPU is needed to build them.

Environment switches:
  GPTFAST_KERNELS_SKIP_CUDA=1   skip the CUDA sources (fast local CPU-only build)
  GPTFAST_KERNELS_REQUIRE_CUDA=1  fail the build instead of silently skipping CUDA (CI sets it)
  TORCH_CUDA_ARCH_LIST          target architectures; default "8.0;9.0a" (A100, H100/H200)
  MAX_JOBS                      parallel compile jobs (ninja)
"""

import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def _check_cuda_archs(arch_list: str) -> None:
    """The kernels use sm_80 instructions (cp.async, bf16 mma.sync): an older target would build
    code that traps when a newer GPU JIT-compiles its PTX, so it is refused here."""
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        name = arch.split("+")[0]
        try:
            too_old = float(name.rstrip("af")) < 8.0
        except ValueError:  # a named architecture, as torch names them
            too_old = name in ("Kepler", "Maxwell", "Pascal", "Volta", "Turing")
        if too_old:
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST={arch_list!r}: gptfast_kernels' CUDA kernels need compute "
                               f"capability 8.0 or newer (A100, H100, ...), got {arch!r}")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _cuda_build_reason():
    """Returns None when CUDA sources should be built, else why not."""
    if _flag("GPTFAST_KERNELS_SKIP_CUDA"):
        return "GPTFAST_KERNELS_SKIP_CUDA is set"
    if torch.version.cuda is None:
        return "this torch was built without CUDA"
    if CUDA_HOME is None:
        return "nvcc was not found (set CUDA_HOME)"
    return None


def _link_args() -> list[str]:
    """libstdc++ linked as the shared library torch itself loads. Linked statically, the extension
    holds a second copy of its streams beside the one torch loaded, and every error message that
    formats a number (TORCH_CHECK's) broke: with g++ -static-libstdc++ here the numbers came out
    empty; the extension an H200 image's compiler (/opt/gcc) linked listed no libstdc++.so and
    segfaulted there. Named before the compiler's own libraries, the shared one resolves every
    symbol first: that mends -static-libstdc++ (checked here), but an extension that image's
    compiler linked with it still crashed (why is not established), so bench/gpu_run.sh builds
    with the system g++ there."""
    return ["-Wl,-Bdynamic", "-lstdc++"] if sys.platform.startswith("linux") else []


def _extension():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # the compiler fuses no multiply-add on its own (the CPU attention kernel writes its fused ones
    # explicitly): its AVX2 and AVX-512 builds (csrc/cpu/) then give the same bits, and a query row
    # the same result in any work item
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    skip_reason = _cuda_build_reason()
    if skip_reason is not None:
        if _flag("GPTFAST_KERNELS_REQUIRE_CUDA"):
            raise RuntimeError(f"GPTFAST_KERNELS_REQUIRE_CUDA=1 but CUDA cannot be built: {skip_reason}")
        print(f"gptfast_kernels: building CPU kernels only ({skip_reason})")
        return CppExtension(
            "gptfast_kernels._C",
            cpp_sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=_link_args(),
            py_limited_api=True,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    _check_cuda_archs(os.environ["TORCH_CUDA_ARCH_LIST"])
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    print(f"gptfast_kernels: building CPU + CUDA kernels for {os.environ['TORCH_CUDA_ARCH_LIST']}")
    return CUDAExtension(
        "gptfast_kernels._C",
        cpp_sources + cuda_sources,
        extra_compile_args={
            "cxx": cxx_flags + ["-DGPTFAST_WITH_CUDA"],
            "nvcc": ["-O3", "--use_fast_math", "-lineinfo", "-DGPTFAST_WITH_CUDA",
                     "--expt-relaxed-constexpr"],
        },
        extra_link_args=_link_args(),
        py_limited_api=True,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
