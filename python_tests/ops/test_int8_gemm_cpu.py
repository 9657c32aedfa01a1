"""int8_linear's packed CPU GEMM (csrc/cpu/int8_gemm_kernel.h): the AVX-512 build takes 12-384 rows of x,
the AVX2 build 16-64 (more go through dequantised tiles and the BLAS GEMM). Each build must match the
reference on ragged shapes (panels of 32 / 16 features and tiles of 12 / 6 rows with tails, K blocks of
128 / 256 with tails, K = 1); each output is one multiply-add chain over k in order, so a row's result
must not depend on the rows beside it or the thread count, and the two builds must give the same bits."""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import skip_unless_cpu_build, with_cpu_build, with_threads

pytestmark = pytest.mark.skipif(not _extension.has_kernel("int8_linear", "CPU"), reason="extension not built")

FUSED_BUILDS = ["avx512", "avx2"]  # the builds with a packed GEMM

DTYPES = [
    pytest.param(torch.float32, 1e-4, 1e-5, id="fp32"),
    pytest.param(torch.float16, 2e-2, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-1, 1.6e-2, id="bf16"),
]

# (M, N, K): row tails of both tile heights, N short of a panel, past one and under a panel in all,
# K blocks with a tail and K = 1; M = 100 (AVX-512's GEMM, AVX2's dequantise-and-GEMM path); M = 400
# (both builds' dequantise-and-GEMM path: two tiles of weight rows, the second short).
SHAPES = [(18, 37, 33), (17, 16, 300), (29, 70, 129), (40, 5, 64), (25, 100, 777), (64, 33, 1), (100, 40, 257),
          (400, 300, 70)]


def _case(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    qweight = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) / 64
    bias = torch.randn(N, generator=g).to(dtype)
    return x, qweight, scales, bias


@pytest.mark.parametrize("isa", FUSED_BUILDS)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("M, N, K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_each_build_matches_the_reference(isa, dtype, atol, rtol, M, N, K):
    skip_unless_cpu_build(isa)
    x, qweight, scales, bias = _case(M, N, K, dtype)
    for b in (bias, None):
        got = with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, b))
        want = reference.int8_linear(x.double(), qweight, scales, None if b is None else b.double())
        assert got.dtype == dtype and got.shape == (M, N) and got.is_contiguous()
        # float32 sums of up to 777 products of |q| <= 127: scale the tolerance with sqrt(K)
        torch.testing.assert_close(got.double(), want, atol=atol * K ** 0.5, rtol=rtol)


@pytest.mark.parametrize("isa", FUSED_BUILDS)
def test_a_row_is_the_same_whatever_rows_and_threads_share_the_call(isa):
    skip_unless_cpu_build(isa)
    x, qweight, scales, bias = _case(40, 77, 300, torch.float32, seed=1)
    call = lambda rows: with_cpu_build(isa, lambda: ops.int8_linear(rows, qweight, scales, bias, backend="cpu"))
    whole = call(x)
    assert torch.equal(call(x[5:23]), whole[5:23])   # 18 rows: another tile split
    assert torch.equal(call(x[21:40]), whole[21:40])
    assert torch.equal(with_threads(1, lambda: call(x)), whole)


def test_the_avx512_and_avx2_builds_give_the_same_bits():
    """Both are a fused multiply-add chain over k in order per output, then * scale + bias; the GEMV
    they take below 12 / 16 rows sums differently, so equal bits also show both ran the GEMM."""
    for isa in FUSED_BUILDS:
        skip_unless_cpu_build(isa)
    for M, N, K in [(18, 37, 33), (29, 70, 129), (64, 33, 300)]:
        x, qweight, scales, bias = _case(M, N, K, torch.float32, seed=2)
        got = {isa: with_cpu_build(isa, lambda: ops.int8_linear(x, qweight, scales, bias, backend="cpu"))
               for isa in FUSED_BUILDS}
        assert torch.equal(got["avx512"], got["avx2"]), f"M={M} N={N} K={K}"


@pytest.mark.parametrize("isa", FUSED_BUILDS)
def test_empty_dimensions(isa):
    """The op itself (the Python wrapper refuses K = 0): K = 0 gives the bias; N = 0 an empty result."""
    skip_unless_cpu_build(isa)
    x, qweight, scales, bias = _case(20, 9, 0, torch.float32)
    y = with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, bias))
    assert torch.equal(y, bias.expand(20, 9))
    x, qweight, scales, bias = _case(20, 0, 8, torch.float32)
    assert with_cpu_build(isa, lambda: ops.int8_linear(x, qweight, scales, bias, backend="cpu")).shape == (20, 0)


@pytest.mark.parametrize("isa", FUSED_BUILDS)
def test_fewer_panels_than_threads_split_the_rows(isa):
    """N = 10: one panel of output features, so two threads take half of x's row blocks each (and
    widen the panel's weights each); the bits equal one thread's, the values the reference."""
    skip_unless_cpu_build(isa)
    x, qweight, scales, bias = _case(60, 10, 300, torch.float32, seed=3)
    call = lambda: with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, bias))
    split, whole = with_threads(2, call), with_threads(1, call)
    assert torch.equal(split, whole)
    want = reference.int8_linear(x.double(), qweight, scales, bias.double())
    torch.testing.assert_close(split.double(), want, atol=1e-4 * 300 ** 0.5, rtol=1e-5)
