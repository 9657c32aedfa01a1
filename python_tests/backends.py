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
