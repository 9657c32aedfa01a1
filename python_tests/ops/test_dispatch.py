"""backend="auto" picks, by shape, between the CUDA kernel and Triton on a GPU (the thresholds come
from H100 measurements in bench/results), and the compiled CPU kernel on a CPU."""

import pytest

from gptfast_kernels.ops.int8_linear import auto_backend as int8_auto
from gptfast_kernels.ops.kv_cache_attention import auto_backend as kv_auto

GPU = ["reference", "cuda", "triton"]
CPU = ["reference", "cpu"]


@pytest.mark.parametrize("rows, K, want", [
    (1, 4096, "cuda"), (1, 14336, "cuda"),           # decode GEMV
    (4, 4096, "cuda"), (8, 4096, "cuda"),            # a few rows, moderate K
    (4, 14336, "triton"),                            # a few rows of a long K
    (9, 4096, "triton"), (16, 4096, "triton"), (256, 4096, "triton"),
])
def test_int8_linear_auto_on_gpu(rows, K, want):
    assert int8_auto(GPU, rows, K) == want


@pytest.mark.parametrize("head_rows, T, S, want", [
    (8, 1, 32768, "cuda"), (8, 5, 8192, "cuda"),     # one row of Llama-3's 8 kv heads
    (8, 5, 32768, "triton"),                         # verification over a long cache
    (16, 1, 4096, "triton"), (256, 5, 8192, "triton"), (64, 1, 8192, "triton"),
    # short caches: the CUDA kernel at any batch for decode, up to 64 head rows for verification
    (256, 1, 2048, "cuda"), (64, 5, 2048, "cuda"), (256, 5, 2048, "triton"),
])
def test_kv_cache_attention_auto_on_gpu(head_rows, T, S, want):
    assert kv_auto(GPU, head_rows, T, S) == want


@pytest.mark.parametrize("usable, want", [
    (CPU, "cpu"), (["reference", "cpu", "triton"], "cpu"), (["reference", "cuda"], "cuda"),
    (["reference", "triton"], "triton"), (["reference"], "reference"),
])
def test_auto_without_a_choice(usable, want):
    """Where only one kernel backend can run, every shape gets it."""
    for rows in (1, 64):
        assert int8_auto(usable, rows, 4096) == want
    for head_rows in (1, 256):
        assert kv_auto(usable, head_rows, 5, 32768) == want
