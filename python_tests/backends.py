"""Which (backend, device) pairs a test can run here, each skip saying why not."""

import importlib.util
import os

import pytest
import torch

from gptfast_kernels import _extension

_HAS_GPU = torch.cuda.is_available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _has_triton_kernel(op: str) -> bool:
    return (_extension.triton_available()
            and importlib.util.find_spec(f"gptfast_kernels.triton.{op}") is not None)


def kernel_backends(op: str) -> list:
    """pytest params of (backend, device) for every non-reference implementation of ``op``."""
    has_triton = _has_triton_kernel(op)
    return [
        pytest.param("cpu", "cpu", id="cpu",
                     marks=pytest.mark.skipif(not _extension.has_kernel(op, "CPU"),
                                              reason="extension not built (no CPU kernel)")),
        pytest.param("triton", "cpu", id="triton-interpreter",
                     marks=pytest.mark.skipif(not (has_triton and _interpreting()),
                                              reason="Triton interpreter off (a GPU is present) or no Triton kernel")),
        pytest.param("cuda", "cuda", id="cuda",
                     marks=pytest.mark.skipif(not (_HAS_GPU and _extension.has_kernel(op, "CUDA")),
                                              reason="requires CUDA and an extension built with CUDA")),
        pytest.param("triton", "cuda", id="triton-cuda",
                     marks=pytest.mark.skipif(not (_HAS_GPU and has_triton and not _interpreting()),
                                              reason="requires CUDA and Triton")),
    ]


requires_cuda = pytest.mark.skipif(not _HAS_GPU, reason="requires CUDA")


def cpu_builds() -> list[str]:
    """The CPU kernels' instruction sets this CPU runs, best first (csrc/cpu_isa.cpp)."""
    return list(torch.ops.gptfast_kernels._cpu_isas())


def skip_unless_cpu_build(isa: str) -> None:
    if isa not in cpu_builds():
        pytest.skip(f"this CPU does not run the {isa} build")


def with_cpu_build(isa: str, fn):
    """fn() with the CPU kernels on instruction set ``isa``, the previous choice restored after."""
    before = torch.ops.gptfast_kernels._cpu_isa(isa)
    try:
        return fn()
    finally:
        torch.ops.gptfast_kernels._cpu_isa(before)


def with_threads(count: int, fn):
    """fn() with ``count`` intra-op threads, the previous count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
