"""quantize_int8 and int8_linear: every backend against the reference."""

import os
import subprocess
import sys

import pytest
import torch

from gptfast_kernels import Int8Linear, _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends, skip_unless_cpu_build, with_cpu_build, with_threads

DTYPES = [
    pytest.param(torch.float32, 1e-3, 1e-4, id="fp32"),
    pytest.param(torch.float16, 5e-2, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 2e-1, 1.6e-2, id="bf16"),
]


def _make(N, K, dtype, device, bias=False):
    weight = torch.randn(N, K, device=device, dtype=torch.float32).to(dtype)
    qweight, scales = ops.quantize_int8(weight)
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    return qweight, scales, b


def _expected(x, qweight, scales, bias):
    """float64 ground truth of the contract's formula, rounded to x's dtype last."""
    y = reference.int8_linear(x.double(), qweight, scales, None if bias is None else bias.double())
    return y


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_int8_matches_contract(dtype):
    weight = torch.randn(33, 70).to(dtype)
    weight[5] = 0  # an all-zero row gets scale 1
    qweight, scales = ops.quantize_int8(weight)
    ref_q, ref_s = reference.quantize_int8(weight)
    assert qweight.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(qweight, ref_q) and torch.equal(scales, ref_s)
    assert scales[5] == 1 and not qweight[5].any()
    assert qweight.abs().max() == 127
    # round-trip error is at most half a quantisation step per element
    err = (qweight.float() * scales[:, None] - weight.float()).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 7, 16, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_reference(backend, device, dtype, atol, rtol, M, with_bias):
    # K not a multiple of 16 (the vector paths need a tail), N odd (paired weight rows need a
    # single last one), M = 7 a block of 4 rows and a rest
    N, K = 73, 200
    qweight, scales, bias = _make(N, K, dtype, device, with_bias)
    x = torch.randn(M, K, device=device, dtype=dtype)
    y = ops.int8_linear(x, qweight, scales, bias, backend=backend)
    assert y.dtype == dtype and y.shape == (M, N)
    torch.testing.assert_close(y.double(), _expected(x, qweight, scales, bias), atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
def test_int8_linear_aligned_decode_and_prefill_shapes(backend, device):
    # K % 16 == 0 takes the vectorised GEMV path; M = 300 the tiled prefill path.
    N, K = 96, 256
    qweight, scales, bias = _make(N, K, torch.float32, device, bias=True)
    for M in (1, 16, 300):
        x = torch.randn(M, K, device=device)
        y = ops.int8_linear(x, qweight, scales, bias, backend=backend)
        torch.testing.assert_close(y.double(), _expected(x, qweight, scales, bias), atol=1e-3, rtol=1e-4)


GPU_BACKENDS = [p for p in kernel_backends("int8_linear") if p.id in ("cuda", "triton-cuda")]


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES[1:])
@pytest.mark.parametrize("N, K", [(14336, 4096), (4096, 14336), (128256, 4096)], ids=["up", "down", "lm-head"])
def test_int8_linear_llama_shapes_on_gpu(backend, device, dtype, atol, rtol, N, K):
    """Llama-3-8B shapes in 16-bit activations: the vectorised GEMV (K % 16 == 0), the skinny
    rows of batched decode and speculative verification, and the tiled prefill path."""
    qweight, scales, bias = _make(N, K, dtype, device, bias=True)
    for M in (1, 2, 5, 16, 40, 300):
        x = (torch.randn(M, K, device=device) / K ** 0.5).to(dtype)
        y = ops.int8_linear(x, qweight, scales, bias, backend=backend)
        torch.testing.assert_close(y.double(), _expected(x, qweight, scales, bias), atol=atol, rtol=rtol,
                                   msg=lambda m: f"M={M}: {m}")


@pytest.mark.parametrize("backend, device", [p for p in GPU_BACKENDS if p.id == "cuda"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES[1:])
@pytest.mark.parametrize("N", [200, 8500], ids=["narrow", "wide"])
def test_int8_linear_tensor_core_edges_on_gpu(backend, device, dtype, atol, rtol, N):
    """The tensor-core paths' edges: K a multiple of 16 but not of the 64-wide chunk (and a single
    16); row counts around the 8-row fragments and the switches between the three layouts (up to
    16, up to 64, more rows); N not a multiple of the feature tiles (8500 takes the 32-feature layout
    on an H100); rows of x strided inside a wider buffer (the op itself takes them; the wrapper
    would copy). A misaligned x takes the fallback kernels and must agree too."""
    for K in (16, 208, 1040):
        qweight, scales, bias = _make(N, K, dtype, device, bias=True)
        for M in (2, 8, 9, 16, 17, 64, 129):
            wide = (torch.randn(M, K + 24, device=device) / K ** 0.5).to(dtype)
            for x in (wide[:, :K], wide[:, 1:K + 1]):  # aligned rows of stride K + 24; misaligned
                for b in (bias, None):
                    y = torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, b)
                    torch.testing.assert_close(y.double(), _expected(x, qweight, scales, b), atol=atol,
                                               rtol=rtol, msg=lambda m: f"K={K} M={M}: {m}")
    aligned, misaligned = wide[:, :K], wide[:, 1:K + 1]
    assert _ran_tensor_core_kernel(lambda: torch.ops.gptfast_kernels.int8_linear(aligned, qweight, scales, None))
    assert not _ran_tensor_core_kernel(
        lambda: torch.ops.gptfast_kernels.int8_linear(misaligned, qweight, scales, None))


def _ran_tensor_core_kernel(call) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return any("int8_linear_mma_kernel" in event.name for event in prof.events())


# Run in a child process with GPTFAST_INT8_CUDA_KERNEL set (the op reads it once per process):
# results against the reference for the rows the choice moves, and the profiler names the kernel.
CHOSEN_KERNEL = """
import sys
import torch
from gptfast_kernels import ops
from gptfast_kernels.ops import reference
rows, kernel = [int(m) for m in sys.argv[1].split(",")], sys.argv[2]
for dtype, atol, rtol in ((torch.float16, 5e-2, 2e-3), (torch.bfloat16, 2e-1, 1.6e-2)):
    for N, K in ((200, 16), (200, 208), (8500, 1040), (4096, 4096)):
        qweight, scales = ops.quantize_int8(torch.randn(N, K, device="cuda"))
        bias = torch.randn(N, device="cuda", dtype=dtype)
        for M in rows:
            x = (torch.randn(M, K, device="cuda") / K ** 0.5).to(dtype)
            y = torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, bias)
            want = reference.int8_linear(x.double(), qweight, scales, bias.double())
            torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, bias)
                torch.cuda.synchronize()
            names = [event.name for event in prof.events()]
            assert any(kernel in name for name in names), (M, names)
"""


@pytest.mark.parametrize("backend, device", [p for p in GPU_BACKENDS if p.id == "cuda"])
@pytest.mark.parametrize("choice, rows, kernel", [
    ("tensor_core", "1", "int8_linear_mma_kernel"),   # one row on tensor cores: fragment columns 1..7 empty
    ("fma", "2,5,16", "int8_linear_gemv_kernel"),     # 2-16 rows kept on the FMA GEMV
    ("fma", "17", "int8_linear_simt_kernel"),         # and more rows on the SIMT tiles
])
def test_int8_linear_kernel_chosen_by_environment_on_gpu(backend, device, choice, rows, kernel):
    env = {**os.environ, "GPTFAST_INT8_CUDA_KERNEL": choice}
    result = subprocess.run([sys.executable, "-c", CHOSEN_KERNEL, rows, kernel], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("backend, device", [p for p in GPU_BACKENDS if p.id == "cuda"])
@pytest.mark.parametrize("variable, value, message", [
    ("GPTFAST_INT8_CUDA_KERNEL", "wmma", "must be auto, tensor_core or fma, got 'wmma'"),
    ("GPTFAST_INT8_GEMV", "u3f1", "must be u4f1, u8f1, u16f1, u4f2, u8f2, u4p or u4s, got 'u3f1'"),
    ("GPTFAST_CUDA_PDL", "yes", "must be 0 or 1, got 'yes'"),
], ids=["kernel", "gemv", "pdl"])
def test_int8_linear_bad_kernel_choice_names_the_variable_on_gpu(backend, device, variable, value, message):
    code = ("import torch\nfrom gptfast_kernels import ops\nq, s = ops.quantize_int8(torch.randn(32, 32, device='cuda'))\n"
            "torch.ops.gptfast_kernels.int8_linear(torch.randn(1, 32, device='cuda', dtype=torch.half), q, s, None)")
    env = {**os.environ, variable: value}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert f"{variable} {message}" in result.stderr


@pytest.mark.parametrize("backend, device", [p for p in GPU_BACKENDS if p.id == "cuda"])
@pytest.mark.parametrize("shape", ["u4f1", "u8f1", "u16f1", "u4f2", "u8f2", "u4p", "u4s"])
def test_int8_linear_one_row_gemv_shapes_on_gpu(backend, device, shape):
    """Each unroll depth / features-per-warp of the one-row GEMV, its pipelined form (u4p) and its
    form with x staged in shared memory (u4s; K = 12304 is past its limit: u4f1)
    (GPTFAST_INT8_GEMV, read once per process, so a process of its own) against float64: K not a
    multiple of a warp's step (and, for u4p, an odd and an even number of trips), odd N (a warp of
    two features with one), every dtype, with and without bias. (33, 4112) has K > N, which
    takes the tensor cores in 16 bits (the GEMV in float32)."""
    code = f"""
import torch
from gptfast_kernels import ops
torch.manual_seed(0)
for N, K in [(4099, 4096), (4113, 4112), (17, 16), (12305, 12304), (33, 4112)]:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        qweight, scales = ops.quantize_int8(torch.randn(N, K, device='cuda'))
        bias = torch.randn(N, device='cuda').to(dtype)
        x = torch.randn(1, K, device='cuda', dtype=dtype)
        for b in (None, bias):
            y = torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, b)
            want = (x.double() @ qweight.double().T) * scales.double() + (0 if b is None else b.double())
            err = ((y.double() - want).abs() / (want.abs() + 1)).max().item()
            assert err < (1e-4 if dtype == torch.float32 else 1e-2), (N, K, dtype, err)
print('ok')
"""
    env = {**os.environ, "GPTFAST_INT8_GEMV": shape}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("N, K", [(50257, 64), (24, 4095)])
def test_int8_linear_odd_shapes_cpu(N, K):
    qweight, scales, bias = _make(N, K, torch.float32, "cpu", bias=True)
    for M in (1, 3, 300):
        x = torch.randn(M, K)
        y = ops.int8_linear(x, qweight, scales, bias, backend="cpu")
        torch.testing.assert_close(y.double(), _expected(x, qweight, scales, bias), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
def test_int8_linear_3d_and_non_contiguous_x(backend, device):
    N, K = 40, 64
    qweight, scales, bias = _make(N, K, torch.float32, device, bias=True)
    x3d = torch.randn(2, 5, K, device=device)
    y = ops.int8_linear(x3d, qweight, scales, bias, backend=backend)
    assert y.shape == (2, 5, N)
    torch.testing.assert_close(y.double(), _expected(x3d, qweight, scales, bias), atol=1e-3, rtol=1e-4)
    x_t = torch.randn(K, 7, device=device).t()  # [7, K] with stride (1, 7)
    assert not x_t.is_contiguous()
    y = ops.int8_linear(x_t, qweight, scales, None, backend=backend)
    torch.testing.assert_close(y.double(), _expected(x_t, qweight, scales, None), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
def test_int8_linear_scales_in_activation_dtype_and_empty_batch(backend, device):
    qweight, scales, _ = _make(16, 32, torch.float16, device)
    x = torch.randn(4, 32, device=device, dtype=torch.float16)
    y = ops.int8_linear(x, qweight, scales.half(), backend=backend)
    torch.testing.assert_close(y.double(), _expected(x, qweight, scales.half().float(), None),
                               atol=5e-2, rtol=2e-3)
    empty = ops.int8_linear(x[:0], qweight, scales, backend=backend)
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
@pytest.mark.parametrize("rows", [1, 37])
def test_int8_linear_gradients_reach_x_and_bias(backend, device, rows):
    """Gradients flow through every backend as through the reference's float formula: x's (so a
    float layer or an adapter before an int8 layer trains) and the bias's; the int8 weight is a
    constant. (They were silently dropped: the ops had no autograd formula.)"""
    qweight, scales, bias = _make(24, 40, torch.float32, device, bias=True)
    upstream = torch.randn(2, rows, 24, device=device)
    grads = []
    for run in (lambda *a: ops.int8_linear(*a, backend=backend), reference.int8_linear):
        x = torch.randn(2, rows, 40, device=device, generator=torch.Generator().manual_seed(1)).requires_grad_()
        b = bias.clone().requires_grad_()
        (run(x, qweight, scales, b) * upstream).sum().backward()
        grads.append((x.grad, b.grad))
    (x_grad, b_grad), (x_want, b_want) = grads
    assert x_grad is not None and b_grad is not None
    torch.testing.assert_close(x_grad, x_want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b_grad, b_want, atol=1e-4, rtol=1e-4)


def test_a_layer_before_an_int8_linear_gets_its_gradient():
    before, linear = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
    int8 = Int8Linear.from_float(linear)
    x = torch.randn(3, 16)
    int8(before(x)).square().sum().backward()
    got = before.weight.grad.clone()
    before.weight.grad = None
    dequantised = torch.nn.Linear(16, 8)
    with torch.no_grad():
        dequantised.weight.copy_(int8.qweight.float() * int8.scales[:, None])
        dequantised.bias.copy_(int8.bias)
    dequantised(before(x)).square().sum().backward()
    torch.testing.assert_close(got, before.weight.grad, atol=1e-4, rtol=1e-4)


def test_int8_linear_bad_inputs():
    qweight, scales, bias = _make(8, 16, torch.float32, "cpu", bias=True)
    x = torch.randn(2, 16)
    cases = [
        (dict(x=x.to(torch.int32)), "x"),
        (dict(x=torch.randn(2, 15)), "x"),
        (dict(qweight=qweight.float()), "qweight"),
        (dict(qweight=qweight[None]), "qweight"),
        (dict(scales=scales[:4]), "scales"),
        (dict(scales=scales.double()), "scales"),
        (dict(bias=bias[:3]), "bias"),
        (dict(x=x.to("meta")), "on meta"),
    ]
    for overrides, needle in cases:
        args = dict(x=x, qweight=qweight, scales=scales, bias=bias) | overrides
        with pytest.raises(ValueError, match=needle):
            ops.int8_linear(**args)
    with pytest.raises(TypeError, match="x"):
        ops.int8_linear([[1.0] * 16], qweight, scales)
    with pytest.raises(ValueError, match="backend"):
        ops.int8_linear(x, qweight, scales, backend="tpu")
    with pytest.raises(ValueError, match="backend='cuda' is not usable"):
        ops.int8_linear(x, qweight, scales, backend="cuda")
    with pytest.raises(ValueError, match="weight"):
        ops.quantize_int8(torch.randn(3, 4, 5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_refuses_weights_that_are_not_finite(bad, dtype):
    """A NaN or an infinity has no int8 code: unchecked, an inf row quantises to a scale of inf and
    codes of 0 (NaN outputs), and a NaN reads as 0 (a silently wrong weight)."""
    weight = torch.randn(6, 16).to(dtype)
    weight[4, 3] = bad
    weight[5, 0] = bad
    with pytest.raises(ValueError, match=r"weight must be finite .* 2 row\(s\) .* first being row 4"):
        ops.quantize_int8(weight)
    with pytest.raises(ValueError, match="weight must be finite"):
        Int8Linear.from_float(_linear_with(weight))


def _linear_with(weight):
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_quantize_takes_meta_weights():
    """A model built on the meta device (load_patched) quantises without data: no value check."""
    qweight, scales = ops.quantize_int8(torch.empty(6, 16, device="meta"))
    assert (qweight.device.type, qweight.dtype, tuple(qweight.shape), tuple(scales.shape)) == \
        ("meta", torch.int8, (6, 16), (6,))


@pytest.mark.skipif(not _extension.extension_loaded(), reason="extension not built")
@pytest.mark.parametrize("bad, needle", [
    ({"scales": torch.tensor(1.0)}, "scales"),
    ({"scales": torch.ones(8, 1)}, "scales"),  # N numbers, but not the [N] the op takes
    ({"bias": torch.tensor(1.0)}, "bias"),
    ({"bias": torch.ones(8, 2)}, "bias"),  # would pass a size(0) check, and only 8 of its 16 numbers be read
], ids=["scales-0d", "scales-2d", "bias-0d", "bias-2d"])
def test_compiled_op_refuses_bad_shapes_when_called_directly(bad, needle):
    """The C++ entry (no Python checks before it) names the argument in a RuntimeError, not an
    IndexError from reading a size its tensor does not have, nor a silent answer from a 2-d one."""
    args = dict(x=torch.randn(3, 16), qweight=torch.ones(8, 16, dtype=torch.int8), scales=torch.ones(8),
                bias=torch.zeros(8))
    args.update(bad)
    with pytest.raises(RuntimeError, match=needle):
        torch.ops.gptfast_kernels.int8_linear(args["x"], args["qweight"], args["scales"], args["bias"])


@pytest.mark.skipif(not _extension.extension_loaded(), reason="extension not built")
def test_compiled_quantize_refuses_no_input_features():
    with pytest.raises(RuntimeError, match="K >= 1"):
        torch.ops.gptfast_kernels.quantize_int8(torch.randn(4, 0))


def test_opcheck_int8_ops():
    qweight, scales, bias = _make(24, 48, torch.float32, "cpu", bias=True)
    x = torch.randn(5, 48)
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_linear.default, (x, qweight, scales, bias))
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_linear.default, (x, qweight, scales, None))
    torch.library.opcheck(torch.ops.gptfast_kernels.quantize_int8.default, (torch.randn(6, 10),))


@pytest.mark.parametrize("backend, device", [p for p in kernel_backends("int8_linear")
                                             if p.values[0] == "triton"])
def test_opcheck_int8_linear_triton(backend, device):
    from gptfast_kernels.triton.int8_linear import int8_linear_triton

    qweight, scales, bias = _make(24, 48, torch.float32, device, bias=True)
    x = torch.randn(5, 48, device=device)
    torch.library.opcheck(int8_linear_triton, (x, qweight, scales, bias))


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear"))
def test_int8_linear_torch_compile_fullgraph(backend, device):
    qweight, scales, bias = _make(32, 64, torch.float32, device, bias=True)

    @torch.compile(fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    def layer(x):
        return torch.relu(ops.int8_linear(x, qweight, scales, bias, backend=backend)) * 2

    x = torch.randn(3, 64, device=device)
    expected = torch.relu(_expected(x, qweight, scales, bias)) * 2
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("backend, device", [p for p in kernel_backends("int8_linear")
                                             if p.values[0] == "triton"])
def test_every_tile_config_of_the_sweep(backend, device):
    """bench/bench_int8_tiles.py times these tile configs to pick the wrapper's: each one computes
    int8_linear (masked edges: N and K not multiples of the tiles)."""
    from bench.bench_int8_tiles import tile_configs
    from gptfast_kernels.triton.int8_linear import tiled_int8_linear

    dtype, atol, rtol = torch.float16, 5e-2, 2e-3
    qweight, scales, _ = _make(72, 300, dtype, device)
    x = torch.randn(5, 300, device=device, dtype=dtype)
    want = _expected(x, qweight, scales, None)
    configs = list(tile_configs(5))
    assert len({(c.block_n, c.block_k, c.num_stages, c.num_warps) for c in configs}) == len(configs) > 1
    for config in configs:
        got = tiled_int8_linear(x, qweight, scales, config)
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m, c=config: f"{c}: {m}")


@pytest.mark.skipif(not _extension.has_kernel("int8_linear", "CPU"), reason="extension not built")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_cpu_results_do_not_depend_on_the_thread_count(isa):
    """The GEMV gives each output feature the same arithmetic wherever a thread's range of features
    starts or ends (an odd last weight row too), and the packed GEMM's outputs are single chains: one
    thread and two give the same bits for N = 70, whose halves are 35 features (odd, not a multiple of 4)."""
    skip_unless_cpu_build(isa)
    g = torch.Generator().manual_seed(5)
    qweight = torch.randint(-127, 128, (70, 200), generator=g, dtype=torch.int8)
    scales, bias = torch.rand(70, generator=g) / 64, torch.randn(70, generator=g)
    for M in (1, 3, 4, 7, 16, 40):
        x = torch.randn(M, 200, generator=g)
        call = lambda: with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, bias))
        assert torch.equal(with_threads(1, call), with_threads(2, call)), f"M={M}"
