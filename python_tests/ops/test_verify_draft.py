"""verify_draft: every kernel backend against the reference (same uniforms), crafted edge cases,
the speculative-sampling guarantee checked statistically, bad inputs, opcheck and torch.compile.

Kernels may differ from the reference only where float rounding puts u * total on a partial sum
of the final inverse-CDF step (API.md: "up to ties"); `assert_matches_reference` checks that any
such difference is a rounding tie, and that accept counts and accepted tokens are identical.
"""

import pytest
import torch

import gptfast_kernels.triton.verify_draft as triton_verify_draft
from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends, requires_cuda

BACKENDS = kernel_backends("verify_draft")
LARGEST_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 uniform


def _is_interpreter(backend, device):
    return backend == "triton" and device == "cpu"


def make_case(B, k, V, *, greedy, device="cpu", generator=None):
    """Peaked random target / draft rows; drafts sampled from the draft (or the target argmax with
    some rows corrupted, for greedy) so that acceptance lengths vary across rows."""
    g = generator
    target = torch.rand(B, k + 1, V, generator=g).pow(6) + 1e-6
    target /= target.sum(-1, keepdim=True)
    # the draft is a blend of the target and noise, so p and q are close but not equal
    noise = torch.rand(B, k, V, generator=g).pow(6)
    draft = 0.7 * target[:, :k] + 0.3 * noise / noise.sum(-1, keepdim=True)
    if greedy:
        tokens = target[:, :k].argmax(-1)
        if k:
            wrong = torch.rand(B, k, generator=g) < 0.2
            tokens = torch.where(wrong, (tokens + 1) % V, tokens)
        draft = None
    elif k:
        tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, k)
    else:
        tokens = torch.zeros(B, 0, dtype=torch.int64)
    uniforms = torch.rand(B, k + 1, generator=g)
    to = (lambda t: None if t is None else t.to(device))
    return to(target), to(draft), to(tokens), to(uniforms)


def _final_weights(target, draft, num_accepted):
    """float64 weights of the final sampling step per row, as API.md defines them."""
    B, K1, V = target.shape
    rows = torch.arange(B)
    weights = target[rows, num_accepted].double()
    if draft is not None:
        rejected = num_accepted < K1 - 1
        stop_draft = draft[rows, num_accepted.clamp(max=max(K1 - 2, 0))].double() if K1 > 1 \
            else torch.zeros_like(weights)
        residual = (weights - stop_draft).clamp(min=0)
        use = rejected & (residual.sum(-1) > 0)
        weights = torch.where(use[:, None], residual, weights)
    return weights


def _assert_inverse_cdf_pick(j, weights, u, where, rel_tol=1e-4):
    """j is the inverse-CDF pick for u over float64 weights [V], up to float32 rounding."""
    cdf = weights.cumsum(-1)
    total = float(cdf[-1])
    threshold = u * total
    assert 0 <= j < weights.shape[-1] and weights[j] > 0, f"{where}: zero-weight token {j}"
    below = float(cdf[j - 1]) if j > 0 else 0.0
    assert below <= threshold + rel_tol * total and float(cdf[j]) >= threshold - rel_tol * total, \
        f"{where}: token {j} is not the inverse-CDF pick (nor a rounding tie)"


def assert_matches_reference(got, target, draft, tokens, uniforms, rel_tol=1e-4):
    target, uniforms = target.cpu(), uniforms.cpu()
    draft = None if draft is None else draft.cpu()
    want_tokens, want_n = reference.verify_draft(target, draft, tokens.cpu(), uniforms)
    got_tokens, got_n = got[0].cpu(), got[1].cpu()
    assert got_tokens.dtype == torch.int64 and got_n.dtype == torch.int64
    assert torch.equal(got_n, want_n), "accept counts differ from the reference"
    B, K1 = want_tokens.shape
    final_col = (want_n - 1)[:, None]
    cols = torch.arange(K1)[None, :]
    assert torch.equal(got_tokens[cols != final_col], want_tokens[cols != final_col])
    got_final = got_tokens.gather(1, final_col).squeeze(1)
    want_final = want_tokens.gather(1, final_col).squeeze(1)
    differ = (got_final != want_final).nonzero().flatten()
    if draft is None:
        assert differ.numel() == 0, "greedy results must be exact"
        return
    weights = _final_weights(target, draft, want_n - 1)
    for b in differ.tolist():
        _assert_inverse_cdf_pick(int(got_final[b]), weights[b], float(uniforms[b, K1 - 1]),
                                 f"row {b}", rel_tol)
    assert differ.numel() <= max(1, B // 20), "too many inverse-CDF ties to be rounding"


def _shapes(backend, device):
    if _is_interpreter(backend, device):
        return [(1, 1, 37), (5, 4, 37), (3, 0, 1000), (4, 4, 1000)]
    return [(1, 1, 50257), (6, 4, 50257), (3, 0, 101), (33, 4, 1000), (2, 16, 1000)]


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_matches_reference(backend, device, greedy, contiguous):
    for B, k, V in _shapes(backend, device):
        target, draft, tokens, uniforms = make_case(B, k, V, greedy=greedy, device=device)
        if not contiguous:  # same values, transposed storage
            target = target.transpose(1, 2).contiguous().transpose(1, 2)
            uniforms = uniforms.t().contiguous().t()
        got = ops.verify_draft(target, draft, tokens, uniforms, backend=backend)
        assert_matches_reference(got, target, draft, tokens, uniforms)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_greedy_draws_no_uniforms(backend, device):
    """Greedy verification reads no uniforms, so with none given it draws none: its answer is the
    reference's whatever the uniforms, and the generator is left as it was."""
    target, _, tokens, uniforms = make_case(5, 4, 300, greedy=True, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    state = generator.get_state()
    got = ops.verify_draft(target, None, tokens, generator=generator, backend=backend)
    assert torch.equal(generator.get_state(), state)
    assert_matches_reference(got, target, None, tokens, uniforms)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_triton_multi_tile(monkeypatch, greedy):
    """Small tiles make the Triton kernel cross tile boundaries (carry, argmax across tiles)."""
    if not (_extension.triton_available() and _extension.triton_interpreting()):
        pytest.skip("Triton interpreter off (a GPU is present) or Triton missing")
    monkeypatch.setattr(triton_verify_draft, "BLOCK_V", 16)
    target, draft, tokens, uniforms = make_case(6, 3, 101, greedy=greedy)
    got = ops.verify_draft(target, draft, tokens, uniforms, backend="triton")
    assert_matches_reference(got, target, draft, tokens, uniforms)


def _one_hot(V, index, scale=1.0):
    row = torch.zeros(V)
    row[index] = scale
    return row


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_crafted_cases(backend, device):
    V, k = 11, 3
    run = lambda t, d, x, u: [r.cpu() for r in ops.verify_draft(  # noqa: E731
        t.to(device), None if d is None else d.to(device), x.to(device), u.to(device),
        backend=backend)]
    tokens = torch.tensor([[4, 1, 6]])
    # all accepted (p == q): the bonus token comes from target_probs[:, k]
    draft = torch.stack([_one_hot(V, 4), _one_hot(V, 1), _one_hot(V, 6)])[None]
    target = torch.cat([draft, _one_hot(V, 9)[None, None]], dim=1)
    out, n = run(target, draft, tokens, torch.full((1, k + 1), 0.9))
    assert n.tolist() == [4] and out.tolist() == [[4, 1, 6, 9]]
    # first draft rejected (p = 0, q = 1): the residual target - draft is one-hot at 3
    target0 = target.clone()
    target0[0, 0] = _one_hot(V, 3)
    out, n = run(target0, draft, tokens, torch.full((1, k + 1), 0.5))
    assert n.tolist() == [1] and out.tolist() == [[3, -1, -1, -1]]
    # q = 0 is rejected even though u * q = 0 < p; the residual puts all its mass on the token
    target_q0 = target.clone()
    target_q0[0, 0] = 0.5 * (_one_hot(V, 4) + _one_hot(V, 8))
    draft_q0 = draft.clone()
    draft_q0[0, 0] = _one_hot(V, 8)
    out, n = run(target_q0, draft_q0, tokens, torch.zeros(1, k + 1))
    assert n.tolist() == [1] and out.tolist() == [[4, -1, -1, -1]]
    # all-zero residual (target = draft / 2 everywhere): sample from target_probs[:, 0] itself
    draft_z = draft.clone()
    draft_z[0, 0] = 0.4 * _one_hot(V, 4) + 0.6 * _one_hot(V, 7)
    target_z = target.clone()
    target_z[0, 0] = draft_z[0, 0] / 2  # weights need not sum to 1
    for u_final, expected in ((0.1, 4), (0.5, 7)):  # cdf of the target row: 0.2 at 4, 0.5 at 7
        uniforms = torch.tensor([[0.9, 0.0, 0.0, u_final]])  # 0.9 * 0.4 >= 0.2: rejected
        out, n = run(target_z, draft_z, tokens, uniforms)
        assert n.tolist() == [1] and out.tolist() == [[expected, -1, -1, -1]]
    # u near 1 with trailing zeros: u * total rounds to total, so no partial sum exceeds it and
    # the last non-zero entry is returned (never a zero-weight or out-of-range index)
    target_u = torch.zeros(1, 1, V)
    target_u[0, 0, :3] = 1.0
    out, n = run(target_u, torch.zeros(1, 0, V), torch.zeros(1, 0, dtype=torch.int64),
                 torch.tensor([[LARGEST_BELOW_ONE]]))
    assert n.tolist() == [1] and out.tolist() == [[2]]
    # greedy ties: the first maximal index wins, so draft 3 is accepted and 7 is a mismatch
    tie = 0.25 * (_one_hot(V, 3) + _one_hot(V, 7)) + 0.01
    target_g = tie.expand(1, k + 1, V).clone()
    out, n = run(target_g, None, torch.tensor([[3, 7, 3]]), torch.zeros(1, k + 1))
    assert n.tolist() == [2] and out.tolist() == [[3, 3, -1, -1]]


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_unnormalised_weights(backend, device, greedy):
    """Rows are weights: scaling target and draft by a power of two (exact in float32) changes
    nothing, and the result still agrees with the reference."""
    target, draft, tokens, uniforms = make_case(4, 4, 37 if _is_interpreter(backend, device) else 1001,
                                                greedy=greedy, device=device)
    base = ops.verify_draft(target, draft, tokens, uniforms, backend=backend)
    scaled = ops.verify_draft(target * 4, None if draft is None else draft * 4, tokens, uniforms,
                              backend=backend)
    assert torch.equal(base[0], scaled[0]) and torch.equal(base[1], scaled[1])
    assert_matches_reference(scaled, target * 4, None if draft is None else draft * 4, tokens,
                             uniforms)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_weights_near_float32s_limit(backend, device):
    """Sampling rows of weights scaled by 2^126 (sums still below 2^127, so no float32 running sum
    overflows) pass the value checks, which then add up the rows, since the cheap bound (largest
    weight times V) is past 2^127, and give what the unscaled rows give; twice those weights
    overflow and are refused, naming target_probs."""
    target, draft, tokens, uniforms = make_case(4, 4, 37, greedy=False, device=device)
    big = 2.0**126
    assert target.max().item() * target.shape[-1] * big >= 2.0**127  # the bound alone would refuse them
    base = ops.verify_draft(target, draft, tokens, uniforms, backend=backend)
    scaled = ops.verify_draft(target * big, draft * big, tokens, uniforms, backend=backend)
    assert torch.equal(base[0], scaled[0]) and torch.equal(base[1], scaled[1])
    with pytest.raises(ValueError, match="target_probs' rows must each sum to less than 2\\^127"):
        ops.verify_draft(target * (2 * big), draft, tokens, uniforms, backend=backend)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_generator_reproducible(backend, device):
    target, draft, tokens, _ = make_case(64, 4, 37, greedy=False, device=device)
    gen = lambda seed: torch.Generator(device=device).manual_seed(seed)  # noqa: E731
    first = ops.verify_draft(target, draft, tokens, generator=gen(1), backend=backend)
    again = ops.verify_draft(target, draft, tokens, generator=gen(1), backend=backend)
    other = ops.verify_draft(target, draft, tokens, generator=gen(2), backend=backend)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])  # 64 rows: equal by chance with negligible odds


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_first_token_follows_target(backend, device):
    """Speculative sampling's guarantee: whatever the draft, the first emitted token is distributed
    as target_probs[:, 0]. Chi-square over V = 8 bins, 20000 rows, fixed seed."""
    if _is_interpreter(backend, device):
        pytest.skip("20000 rows are too slow for the Triton interpreter (runs on GPU)")
    B, k, V = 20000, 3, 8
    g = torch.Generator().manual_seed(1234)
    target_row = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
    draft_row = torch.tensor([0.05, 0.40, 0.05, 0.20, 0.10, 0.05, 0.10, 0.05])  # very different
    target = torch.rand(B, k + 1, V, generator=g)
    target /= target.sum(-1, keepdim=True)
    target[:, 0] = target_row
    draft = torch.rand(B, k, V, generator=g)
    draft /= draft.sum(-1, keepdim=True)
    draft[:, 0] = draft_row
    tokens = torch.multinomial(draft.reshape(-1, V), 1, replacement=True,
                               generator=g).reshape(B, k)
    uniforms = torch.rand(B, k + 1, generator=g)
    out, _ = ops.verify_draft(target.to(device), draft.to(device), tokens.to(device),
                              uniforms.to(device), backend=backend)
    counts = torch.bincount(out[:, 0].cpu(), minlength=V).double()
    assert counts[3] == 0, "a token with zero target probability was emitted"
    expected = target_row.double() * B
    support = expected > 0
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    # 6 degrees of freedom: P(chi2 > 27) is about 1.4e-4 under the null hypothesis
    assert chi2 < 27.0, f"chi-square {chi2:.1f}: first token does not follow the target"


def _valid_case():
    return make_case(2, 3, 13, greedy=False)


@pytest.mark.parametrize("field, make_bad, match", [
    ("target_probs", lambda t, d, x, u: (t.double(), d, x, u), "target_probs"),
    ("target_probs", lambda t, d, x, u: (t[:, :, :5], d, x, u), "draft_probs"),
    ("target_probs", lambda t, d, x, u: (t[0], d, x, u), "target_probs"),
    ("draft_probs", lambda t, d, x, u: (t, d.half(), x, u), "draft_probs"),
    ("draft_probs", lambda t, d, x, u: (t, d[:, :2], x, u), "draft_probs"),
    ("draft_tokens", lambda t, d, x, u: (t, d, x.int(), u), "draft_tokens"),
    ("draft_tokens", lambda t, d, x, u: (t, d, x[:, :2], u), "draft_tokens"),
    ("draft_tokens", lambda t, d, x, u: (t, d, x.clone().fill_(13), u), "draft_tokens"),
    ("draft_tokens", lambda t, d, x, u: (t, d, x.clone().fill_(-1), u), "draft_tokens"),
    ("uniforms", lambda t, d, x, u: (t, d, x, u.double()), "uniforms"),
    ("uniforms", lambda t, d, x, u: (t, d, x, u[:, :3]), "uniforms"),
    ("uniforms", lambda t, d, x, u: (t, d, x, torch.ones_like(u)), "uniforms"),
    ("uniforms", lambda t, d, x, u: (t, d, x, -u), "uniforms"),
    ("target_probs", lambda t, d, x, u: (t.clone().fill_(float("nan")), d, x, u), "target_probs"),
    ("target_probs", lambda t, d, x, u: (-t, d, x, u), "target_probs"),
    ("draft_probs", lambda t, d, x, u: (t, d.clone().fill_(float("inf")), x, u), "draft_probs"),
    ("target_probs", lambda t, d, x, u: (t.clone().index_fill_(1, torch.tensor([1]), 0.0), d, x, u),
     "positive probability in every row"),
    ("target_probs", lambda t, d, x, u: (t.clone().index_fill_(1, torch.tensor([1]), 0.0), None, x, None),
     "positive probability in every row"),  # greedy too: the argmax of zeros is no pick
])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_bad_inputs_raise_value_error(field, make_bad, match, backend):
    args = make_bad(*_valid_case())
    with pytest.raises(ValueError, match=match):
        ops.verify_draft(*args, backend=backend)


def test_bad_types_and_backend():
    target, draft, tokens, uniforms = _valid_case()
    with pytest.raises(TypeError, match="draft_tokens"):
        ops.verify_draft(target, draft, tokens.tolist(), uniforms)
    with pytest.raises(ValueError, match="backend"):
        ops.verify_draft(target, draft, tokens, uniforms, backend="tpu")


@pytest.mark.skipif(not _extension.has_kernel("verify_draft", "CPU"), reason="extension not built")
def test_compiled_op_rejects_out_of_range_tokens():
    """Called directly (no wrapper checks), the C++ kernel still refuses ids outside [0, V)."""
    target, draft, tokens, uniforms = _valid_case()
    with pytest.raises(RuntimeError, match="draft_tokens"):
        torch.ops.gptfast_kernels.verify_draft(target, draft, tokens.clone().fill_(13), uniforms)


@pytest.mark.parametrize("backend, device", [b for b in BACKENDS if b.id != "cpu"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_gpu_kernels_treat_out_of_range_tokens_as_rejected(backend, device, greedy):
    """Without the wrapper's checks (as under torch.compile), ids outside [0, V) are never read:
    the CUDA and Triton kernels count them as rejected (sampling) or mismatched (greedy)."""
    target, draft, tokens, uniforms = make_case(4, 3, 37, greedy=greedy, device=device)
    bad = tokens.clone()
    bad[:, 0] = torch.tensor([37, -1, 1 << 40, -(1 << 40)], device=device)
    if backend == "cuda":
        out, n = torch.ops.gptfast_kernels.verify_draft(target, draft, bad, uniforms)
    else:
        from gptfast_kernels.triton.verify_draft import verify_draft_triton

        out, n = verify_draft_triton(target, draft, bad, uniforms)
    assert n.tolist() == [1, 1, 1, 1]
    assert bool(((out[:, 0] >= 0) & (out[:, 0] < 37)).all()) and bool((out[:, 1:] == -1).all())
    # the emitted token is what API.md emits after a rejection at position 0
    target, out = target.cpu(), out.cpu()
    if greedy:
        assert torch.equal(out[:, 0], target[:, 0].argmax(-1))
        return
    weights = _final_weights(target, draft.cpu(), torch.zeros(4, dtype=torch.int64))
    for b in range(4):
        _assert_inverse_cdf_pick(int(out[b, 0]), weights[b], float(uniforms[b, -1]), f"row {b}")


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_opcheck(greedy):
    target, draft, tokens, uniforms = make_case(3, 2, 37, greedy=greedy)
    ops_to_check = []
    if _extension.has_kernel("verify_draft", "CPU"):
        ops_to_check.append(torch.ops.gptfast_kernels.verify_draft.default)
    if _extension.triton_available() and _extension.triton_interpreting():
        ops_to_check.append(torch.ops.gptfast_kernels.verify_draft_triton.default)
    if not ops_to_check:
        pytest.skip("no CPU kernel and no Triton interpreter")
    for op in ops_to_check:
        torch.library.opcheck(op, (target, draft, tokens, uniforms))


@pytest.mark.skipif(not _extension.has_kernel("verify_draft", "CPU"), reason="extension not built")
def test_torch_compile_fullgraph():
    target, draft, tokens, uniforms = make_case(4, 4, 101, greedy=False)
    compiled = torch.compile(lambda t, d, x, u: ops.verify_draft(t, d, x, u, backend="cpu"),
                             fullgraph=True)
    got = compiled(target, draft, tokens, uniforms)
    want = ops.verify_draft(target, draft, tokens, uniforms, backend="cpu")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@requires_cuda
@pytest.mark.skipif(not _extension.has_kernel("verify_draft", "CUDA"), reason="extension built without CUDA")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_int64_offsets_large_batch(backend):
    """B * (k + 1) * V > 2^31: the last rows must still be read at the right place."""
    B, k, V = 64, 16, 256 * 1024
    target = torch.full((B, k + 1, V), 1e-9, device="cuda")
    target[-1, :, 7] = 1.0  # last row: every position peaks at token 7
    tokens = torch.full((B, k), 7, dtype=torch.int64, device="cuda")
    out, n = ops.verify_draft(target, None, tokens, torch.zeros(B, k + 1, device="cuda"),
                              backend=backend)
    assert n[-1].item() == k + 1 and out[-1].tolist() == [7] * (k + 1)
    assert n[0].item() == 1 and out[0, 0].item() == 0  # a flat row: argmax is the first index


def _raw_kernel(backend):
    """The kernel entry point itself, without the wrapper's eager value checks (as under capture)."""
    if backend == "triton":
        return triton_verify_draft.verify_draft_triton
    return torch.ops.gptfast_kernels.verify_draft


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_greedy_nan_is_the_maximum_when_unchecked(backend, device):
    """Under capture the wrapper cannot reject NaN probabilities; a greedy kernel must then still
    finish with one answer per row, and it is torch.argmax's (NaN above every number, first NaN)."""
    B, k, V = 3, 2, 300
    target = torch.rand(B, k + 1, V)
    target[0, 0, 250] = float("nan")  # row 0: draft 0 is rejected in favour of the NaN index
    target[1, 1, 40] = target[1, 1, 41] = float("nan")  # row 1: the first of two NaNs
    target[2].fill_(float("nan"))  # row 2: everything NaN
    tokens = target[:, :k].nan_to_num(-1.0).argmax(-1)
    tokens[1, 0] = target[1, 0].argmax()
    uniforms = torch.zeros(B, k + 1)
    want = reference.verify_draft(target, None, tokens, uniforms)
    assert want[0][0, 0].item() == 250 and want[0][1, 1].item() == 40 and want[0][2, 0].item() == 0
    got = _raw_kernel(backend)(target.to(device), None, tokens.to(device), uniforms.to(device))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_greedy_argmax_across_chunks(monkeypatch, backend, device):
    """The GPU kernels split each greedy row into chunks reduced by separate blocks / programs and
    merged after: a tie between two chunks goes to the earlier index, a NaN in a later chunk beats
    any number in an earlier one, and acceptance stops at the first mismatch as before."""
    B, k = 2, 2
    if _is_interpreter(backend, device):  # small tiles, chunks of one tile: V = 101 in 4 chunks
        monkeypatch.setattr(triton_verify_draft, "BLOCK_V", 16)
        monkeypatch.setattr(triton_verify_draft, "GREEDY_MIN_CHUNK_TILES", 1)
        V = 101
        assert triton_verify_draft._greedy_chunks(B * (k + 1), V, 16)[1] > 2
    else:  # the CUDA kernel's shortest chunk is 8192 entries; Triton's 4096
        V = 5 * 8192 + 4
    early, late = V // 5, V - 3  # in the first and the last chunk
    target = torch.rand(B, k + 1, V)
    target[0, 0, early] = target[0, 0, late] = 2.0  # tie: the earlier index wins
    target[0, 1, late] = 3.0  # the maximum in the last chunk only
    target[1, 0, early] = 5.0
    target[1, 0, late] = float("nan")  # NaN in a later chunk still wins
    tokens = torch.tensor([[early, late], [late, 0]])
    uniforms = torch.zeros(B, k + 1)
    want = reference.verify_draft(target, None, tokens, uniforms)
    assert want[1].tolist() == [3, 2] and want[0][1, 1].item() == target[1, 1].argmax().item()
    got = _raw_kernel(backend)(target.to(device), None, tokens.to(device), uniforms.to(device))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_check_values_false_skips_only_the_value_checks():
    """check_values=False (callers with valid-by-construction inputs) skips the data checks but
    keeps the shape / dtype checks, which cost nothing."""
    target, draft, tokens, uniforms = make_case(2, 3, 50, greedy=False)
    want = ops.verify_draft(target, draft, tokens, uniforms, backend="reference")
    got = ops.verify_draft(target, draft, tokens, uniforms, backend="reference", check_values=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    negative = target.clone()
    negative[0, 0, 0] = -1.0
    with pytest.raises(ValueError, match="target_probs"):
        ops.verify_draft(negative, draft, tokens, uniforms, backend="reference")
    ops.verify_draft(negative, draft, tokens, uniforms, backend="reference", check_values=False)  # not read
    with pytest.raises(ValueError, match="draft_tokens"):
        ops.verify_draft(target, draft, tokens[:, :2], uniforms, backend="reference", check_values=False)
