"""int8_expert_linear: every kernel backend against the reference (odd N / K, several rows per expert,
experts no row chose, padding and out-of-range ids), bad inputs naming the argument, opcheck and
torch.compile."""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends, skip_unless_cpu_build, with_cpu_build

BACKENDS = kernel_backends("int8_expert_linear")
TRITON_BACKENDS = [p for p in BACKENDS if p.id.startswith("triton")]
# float32 sums in a different order; 16-bit outputs round once (bf16: 8 bits of mantissa)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def make_case(P, E, N, K, experts, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, K, generator=g).to(dtype).to(device)
    qweight = torch.randint(-127, 128, (E, N, K), generator=g, dtype=torch.int8).to(device)
    scales = (torch.rand(E, N, generator=g) * 0.01 + 1e-3).to(device)
    return x, qweight, scales, torch.as_tensor(experts, dtype=torch.int64).to(device)


def check_against_reference(backend, x, qweight, scales, experts, bias=None):
    # the kernels add the bias in x's dtype (as int8_linear's): the reference gets it rounded the same way
    want_bias = None if bias is None else bias.to(x.dtype).cpu().double()
    want = reference.int8_expert_linear(x.cpu().double(), qweight.cpu(), scales.cpu().double(), experts.cpu(),
                                        want_bias)
    got = ops.int8_expert_linear(x, qweight, scales, experts, bias, backend=backend)
    assert got.shape == (x.shape[0], qweight.shape[1]) and got.dtype == x.dtype and got.device == x.device
    torch.testing.assert_close(got.cpu().double(), want, **TOLERANCE[x.dtype])
    return got


# (P, E, N, K, experts): decode (one token, top-2 of 4), verification-like rows sharing experts,
# an expert nobody chose, odd N and K (no 16-byte loads), padding (-1)
CASES = {
    "decode-top2": (2, 4, 64, 128, [3, 1]),
    "shared-experts-odd": (9, 5, 50, 72, [0, 4, 4, 1, 0, 4, 1, 1, 4]),
    "odd-k-padding": (6, 3, 33, 101, [2, -1, 0, 2, -1, 0]),
    "many-rows-one-expert": (40, 9, 24, 64, [7] * 33 + [0] * 7),
}


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_matches_reference(backend, device, case, dtype):
    P, E, N, K, experts = CASES[case]
    check_against_reference(backend, *make_case(P, E, N, K, experts, dtype, device))


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("case", ["shared-experts-odd", "odd-k-padding"])
def test_gradients_reach_x_and_bias(backend, device, case):
    """As int8_linear's: x's and the bias's gradients equal the reference formula's (a padding row's
    are zero); they were silently dropped."""
    P, E, N, K, experts = CASES[case]
    x, qweight, scales, experts = make_case(P, E, N, K, experts, device=device)
    bias = torch.randn(E, N, device=device)
    upstream = torch.randn(P, N, device=device)
    grads = []
    for run in (lambda *a: ops.int8_expert_linear(*a, backend=backend), reference.int8_expert_linear):
        xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
        (run(xg, qweight, scales, experts, bg) * upstream).sum().backward()
        grads.append((xg.grad, bg.grad))
    (x_grad, b_grad), (x_want, b_want) = grads
    assert x_grad is not None and b_grad is not None
    torch.testing.assert_close(x_grad, x_want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b_grad, b_want, atol=1e-4, rtol=1e-4)
    assert not x_grad[experts < 0].any()


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("case", ["decode-top2", "odd-k-padding", "many-rows-one-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_bias_per_expert(backend, device, case, dtype):
    """GPT-OSS's experts: bias[experts[p]] added after the scales; padding rows stay zero (no bias)."""
    P, E, N, K, experts = CASES[case]
    x, qweight, scales, ids = make_case(P, E, N, K, experts, dtype, device)
    bias = torch.randn(E, N, generator=torch.Generator().manual_seed(3)).to(device)  # float32: cast to x's dtype
    got = check_against_reference(backend, x, qweight, scales, ids, bias)
    assert torch.all(got[ids.cpu() < 0] == 0)
    without = ops.int8_expert_linear(x, qweight, scales, ids, backend=backend)
    assert not torch.allclose(got[ids.cpu() >= 0], without[ids.cpu() >= 0])  # the bias was applied


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_padding_rows_are_zero_and_unchosen_experts_do_not_matter(backend, device):
    """Rows with expert -1 are zero; an expert that no row chose may hold anything (here NaN scales)
    without touching the result."""
    x, qweight, scales, experts = make_case(4, 3, 16, 32, [0, -1, 0, 2], device=device)
    scales[1] = float("nan")  # expert 1 is not chosen
    got = check_against_reference(backend, x, qweight, scales, experts)
    assert torch.all(got[1] == 0) and torch.isfinite(got).all()


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_empty_rows(backend, device):
    x, qweight, scales, experts = make_case(0, 2, 8, 16, [], device=device)
    assert ops.int8_expert_linear(x, qweight, scales, experts, backend=backend).shape == (0, 8)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_out_of_range_ids_unchecked_give_zero_rows(backend, device):
    """Under torch.compile the ids cannot be checked: the kernels must neither read outside qweight
    nor return anything but zeros for them."""
    x, qweight, scales, _ = make_case(3, 2, 8, 16, [0, 0, 0], device=device)
    experts = torch.tensor([1, 7, -5], device=device)
    got = ops.int8_expert_linear(x, qweight, scales, experts, backend=backend, check_experts=False)
    want = reference.int8_expert_linear(x.cpu(), qweight.cpu(), scales.cpu(), experts.cpu())
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])
    assert torch.all(got[1:] == 0)


@pytest.mark.parametrize("experts, needle", [([0, 3], "experts must lie in"), ([-2, 0], "experts must lie in")],
                         ids=["too-large", "below-minus-one"])
def test_bad_expert_ids_name_the_argument(experts, needle):
    x, qweight, scales, ids = make_case(2, 3, 8, 16, experts)
    with pytest.raises(ValueError, match=needle):
        ops.int8_expert_linear(x, qweight, scales, ids)


@pytest.mark.parametrize("change, needle", [
    (lambda a: {**a, "x": a["x"][:, :-1]}, "x must be"),
    (lambda a: {**a, "qweight": a["qweight"].float()}, "qweight must have dtype"),
    (lambda a: {**a, "qweight": a["qweight"][0]}, "qweight must have 3 dimensions"),
    (lambda a: {**a, "scales": a["scales"][:, :-1]}, "scales must have shape"),
    (lambda a: {**a, "experts": a["experts"][:1]}, "experts must have one entry per row"),
    (lambda a: {**a, "experts": a["experts"].float()}, "experts must have dtype"),
    (lambda a: {**a, "x": a["x"].to(torch.int32)}, "x must have dtype"),
    (lambda a: {**a, "bias": torch.zeros(3, 7)}, "bias must have shape"),
    (lambda a: {**a, "bias": torch.zeros(8)}, "bias must have 2 dimensions"),
    (lambda a: {**a, "bias": torch.zeros(3, 8, dtype=torch.int32)}, "bias must have dtype"),
], ids=["x-k", "qweight-dtype", "qweight-dim", "scales-shape", "experts-len", "experts-dtype", "x-dtype", "bias-shape",
        "bias-dim", "bias-dtype"])
def test_bad_inputs_name_the_argument(change, needle):
    x, qweight, scales, experts = make_case(2, 3, 8, 16, [0, 2])
    args = change(dict(x=x, qweight=qweight, scales=scales, experts=experts))
    with pytest.raises(ValueError, match=needle):
        ops.int8_expert_linear(**args)


@pytest.mark.skipif(not _extension.has_kernel("int8_expert_linear", "CPU"), reason="extension not built")
def test_cpu_kernel_checks_shapes_when_called_directly():
    x, qweight, scales, experts = make_case(2, 3, 8, 16, [0, 2])
    with pytest.raises(RuntimeError, match="experts must be"):
        torch.ops.gptfast_kernels.int8_expert_linear(x, qweight, scales, experts[:1])
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.gptfast_kernels.int8_expert_linear(x, qweight, scales, experts, torch.zeros(3, 7))
    with pytest.raises(RuntimeError, match="bias"):  # the kernel adds it in x's dtype
        torch.ops.gptfast_kernels.int8_expert_linear(x, qweight, scales, experts, torch.zeros(3, 8).double())


@pytest.mark.skipif(not _extension.has_kernel("int8_expert_linear", "CPU"), reason="extension not built")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_rows_equal_int8_linear_with_their_experts_weight(isa, dtype):
    """The CPU kernel runs int8_linear's on each expert's rows: its GEMV for an expert with 1-4 rows,
    its packed GEMM for one with 40 (AVX2 / AVX-512), so each row gets the same bits as int8_linear."""
    skip_unless_cpu_build(isa)
    experts = [2] * 40 + [0, 5, 5, 0, 1, 5, -1, 7]
    x, qweight, scales, ids = make_case(len(experts), 8, 70, 100, experts, dtype)
    bias = torch.randn(8, 70).to(dtype)
    got = with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_expert_linear(x, qweight, scales, ids, bias))
    for e in range(8):
        rows = (ids == e).nonzero().squeeze(1)
        want = with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(x[rows], qweight[e], scales[e],
                                                                                  bias[e]))
        assert torch.equal(got[rows], want), f"expert {e}"
    assert not got[ids == -1].any()  # padding


@pytest.mark.skipif(not _extension.has_kernel("int8_expert_linear", "CPU"), reason="extension not built")
def test_opcheck_cpu():
    args = make_case(5, 3, 8, 16, [0, 2, 2, -1, 1])
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_expert_linear.default, args)
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_expert_linear.default, (*args, torch.randn(3, 8)))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton(backend, device):
    from gptfast_kernels.triton.int8_expert_linear import int8_expert_linear_triton  # noqa: F401

    args = make_case(5, 3, 20, 16, [0, 2, 2, -1, 1], device=device)
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_expert_linear_triton.default, args)
    torch.library.opcheck(torch.ops.gptfast_kernels.int8_expert_linear_triton.default,
                          (*args, torch.randn(3, 20, device=device)))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    x, qweight, scales, experts = make_case(4, 3, 16, 32, [2, 0, 2, 1], device=device)
    bias = torch.randn(3, 16, device=device)
    want = ops.int8_expert_linear(x, qweight, scales, experts, bias, backend=backend)

    @torch.compile(fullgraph=True)
    def step(x, experts):
        return ops.int8_expert_linear(x, qweight, scales, experts, bias, backend=backend) * 2

    torch.testing.assert_close(step(x, experts), want * 2)
