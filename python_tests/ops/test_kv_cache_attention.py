"""kv_cache_attention: every kernel backend against the reference (outputs and cache writes), for
decode (T = 1), verification (T = k + 1) and prefill shapes, GQA / MQA, ragged and padded rows,
shuffled positions, stale slots after a crop, non-contiguous inputs, bad inputs (caches untouched),
opcheck and torch.compile.

Tolerance (flash-attention's rule): a kernel's max error against a float64 reference may be at most
twice the error of the same attention computed by PyTorch in the low-precision dtype.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends

BACKENDS = kernel_backends("kv_cache_attention")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# An absolute floor on the allowed error: float32 results differ from float64 by rounding only.
ERROR_FLOOR = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _is_interpreter(backend, device):
    return backend == "triton" and device == "cpu"


def make_case(B, Hq, Hkv, T, D, S, positions, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q, k, v = rand(B, Hq, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    k_cache, v_cache = rand(B, Hkv, S, D), rand(B, Hkv, S, D)
    positions = torch.as_tensor(positions, dtype=torch.int64).to(device)
    return q, k, v, k_cache, v_cache, positions



def check_unseen_slots_are_never_read(backend, device, T, starts, first_seen, seed, **kwargs):
    """Rows of T queries from positions ``starts``; each row's slots before ``first_seen(start)`` (which
    no query of the row sees: before its earliest query's window or chunk, ``kwargs`` being
    kv_cache_attention's window= / chunk_size=) hold NaN: a kernel that read them, even to multiply by
    a zero probability, would return NaN."""
    B, Hq, Hkv, D, S = 2, 4, 2, 32, 260
    positions = _contiguous_positions(B, T, starts).to(device)
    q, k, v, k_cache, v_cache, _ = make_case(B, Hq, Hkv, T, D, S, positions, device=device, seed=seed)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(starts):
        unseen = first_seen(start)
        for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
            cache[b, :, :unseen] = float("nan")
            clean[b, :, :unseen] = 0
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend, **kwargs)
    want = ops.kv_cache_attention(q, k, v, clean_k, clean_v, positions, backend="reference", **kwargs)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

def _attention_in_dtype(q, k, v, k_cache, v_cache, positions, scale=None, window=None, softcap=None, sinks=None,
                        ring=False, alibi_slopes=None):
    """The same attention computed by PyTorch in q's dtype throughout (the low-precision baseline)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    pos = reference.broadcast_positions(positions, B)
    rows, cols = (pos >= 0).nonzero(as_tuple=True)
    written = pos[rows, cols] % S if ring else pos[rows, cols]
    k_cache[rows, :, written] = k[rows, :, cols]
    v_cache[rows, :, written] = v[rows, :, cols]
    group = Hq // Hkv
    keys = k_cache.repeat_interleave(group, dim=1)
    values = v_cache.repeat_interleave(group, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    slots = torch.arange(S, device=q.device)[None, None, :]
    if ring:  # the position each slot holds for each query: the latest <= the query's
        slots = pos[:, :, None] - (pos[:, :, None] - slots) % S
    allowed = (slots <= pos[:, :, None]) & (slots >= 0)
    if window:
        allowed &= slots > pos[:, :, None] - window
    if alibi_slopes is not None:
        distance = (slots - pos[:, :, None]).to(scores.dtype)  # [B, T, S]
        scores = scores + alibi_slopes.to(scores.dtype)[None, :, None, None] * distance[:, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[None, :, None, None].expand(B, Hq, T, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :S]
    out = (probs @ values) * (pos >= 0)[:, None, :, None]
    return out


def check_against_reference(backend, device, q, k, v, k_cache, v_cache, positions, scale=None, window=None,
                            softcap=None, sinks=None, ring=False, alibi_slopes=None):
    """Runs the backend and checks its output and both caches against the float64 reference."""
    inputs64 = [t.cpu().double() for t in (q, k, v, k_cache, v_cache)]
    want_k_cache, want_v_cache = inputs64[3].clone(), inputs64[4].clone()
    slopes64 = None if alibi_slopes is None else alibi_slopes.cpu().double()
    want = reference.kv_cache_attention(*inputs64[:3], want_k_cache, want_v_cache, positions.cpu(), scale, window,
                                        softcap, None if sinks is None else sinks.cpu().double(), ring,
                                        alibi_slopes=slopes64)
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, scale, window=window, softcap=softcap,
                                 sinks=sinks, ring=ring, alibi_slopes=alibi_slopes, backend=backend)
    assert got.shape == q.shape and got.dtype == q.dtype and got.device == q.device
    # the scatter is a copy: the caches must hold exactly the new k / v at the written slots
    assert torch.equal(k_cache.cpu().double(), want_k_cache), "k_cache differs from the reference"
    assert torch.equal(v_cache.cpu().double(), want_v_cache), "v_cache differs from the reference"
    error = (got.cpu().double() - want).abs().max().item() if got.numel() else 0.0
    if q.dtype == torch.float32:
        allowed = ERROR_FLOOR[q.dtype]
    else:
        cpu = [t.cpu() for t in (q, k, v, k_cache, v_cache)]
        baseline = _attention_in_dtype(*cpu[:3], *cpu[3:], positions.cpu(), scale, window, softcap,
                                       None if sinks is None else sinks.cpu(), ring,
                                       None if alibi_slopes is None else alibi_slopes.cpu()).double()
        allowed = max(2 * (baseline - want).abs().max().item(), ERROR_FLOOR[q.dtype])
    assert error <= allowed, f"max error {error:.3g} > allowed {allowed:.3g}"
    return got


def _contiguous_positions(B, T, starts):
    return torch.stack([torch.arange(s, s + T) for s in starts])


# (B, Hq, Hkv, T, D, S, starts): decode, verification and prefill, MHA / GQA / MQA, odd sizes
SHAPES = {
    "decode-gqa": (3, 8, 2, 1, 64, 50, [0, 17, 49]),
    "decode-mqa-d80": (2, 4, 1, 1, 80, 33, [5, 32]),
    "verify-k4-d96": (2, 6, 3, 5, 96, 40, [10, 0]),
    "verify-k4-d128": (2, 4, 2, 5, 128, 24, [19, 3]),
    "prefill-t37-mha": (2, 4, 4, 37, 64, 48, [0, 11]),
    "prefill-t7-d256": (1, 2, 1, 7, 256, 16, [2]),
    "decode-long-cache": (1, 4, 2, 1, 32, 300, [290]),  # many KV splits (flash-decoding kernels)
    "verify-mqa-g8": (2, 8, 1, 5, 32, 70, [60, 3]),     # group x tokens rows span several tiles
}
# the interpreter runs each Triton program in Python: keep its shapes few and small (the Triton
# kernel switches to its prefill kernels above T = 16: prefill-t37 covers them)
INTERPRETER_SHAPES = ("decode-gqa", "verify-k4-d96", "prefill-t7-d256", "prefill-t37-mha",
                      "decode-long-cache", "verify-mqa-g8")
TRITON_BACKENDS = [p for p in BACKENDS if p.id.startswith("triton")]


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_reference(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and (shape not in INTERPRETER_SHAPES or dtype == torch.float16):
        pytest.skip("Triton interpreter: a subset of shapes keeps the suite fast")
    B, Hq, Hkv, T, D, S, starts = SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device)
    check_against_reference(backend, device, *case)


# Head dims past 256: D = 512 (Gemma 4's global layers) and D = 320, which pads to the same Triton
# tiles with masked columns; D = 576 = MAX_HEAD_DIM (multi-head latent attention's latents, r + dr =
# 512 + 64, as multi-query attention: one kv head), which Triton tiles as 512 + a 64-wide tail, and
# D = 520, whose tail is mostly masked: (B, Hq, Hkv, T, D, S, starts). T = 20 is a prefill chunk (the
# kernels' prefill paths start at T = 17).
LARGE_HEAD_SHAPES = {
    "decode-gqa-d512": (2, 4, 2, 1, 512, 20, [0, 19]),
    "verify-k4-d512": (2, 4, 2, 5, 512, 24, [19, 3]),
    "prefill-t20-d512": (1, 4, 2, 20, 512, 24, [2]),
    "decode-gqa-d320": (2, 4, 2, 1, 320, 17, [16, 5]),
    "verify-k4-mqa-d320": (2, 4, 1, 5, 320, 17, [12, 0]),
    "prefill-t20-d320": (1, 4, 2, 20, 320, 24, [3]),
    "decode-mla-d576": (2, 16, 1, 1, 576, 20, [0, 19]),
    "verify-k4-mla-d576": (2, 4, 1, 5, 576, 24, [19, 3]),
    "prefill-t20-mla-d576": (1, 8, 1, 20, 576, 24, [2]),
    "decode-mla-d520": (2, 8, 1, 1, 520, 17, [16, 5]),
    "verify-k4-mla-d520": (2, 4, 1, 5, 520, 17, [12, 0]),
    "prefill-t20-mla-d520": (1, 4, 1, 20, 520, 24, [3]),
}


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("shape", list(LARGE_HEAD_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_large_head_dims_match_reference(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and dtype == torch.float16:
        pytest.skip("Triton interpreter: bfloat16 covers the 16-bit path")
    B, Hq, Hkv, T, D, S, starts = LARGE_HEAD_SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=11)
    check_against_reference(backend, device, *case)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [30, 5]), (20, [3, 40])], ids=["decode", "prefill"])
def test_mla_head_dim_with_window_softcap_sinks_and_ring(backend, device, T, starts):
    """D = 576 with every scoring option at once (a sliding window, soft-capping, sinks) on a ring
    cache whose reads wrap: the tail block of Triton's split head dim goes through each path."""
    B, Hq, Hkv, S, window = 2, 4, 1, 24, 5
    case = make_case(B, Hq, Hkv, T, 576, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=13)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    check_against_reference(backend, device, *case, window=window, softcap=2.0, sinks=sinks, ring=True)


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_head_dim_past_the_limit_is_refused(backend, device):
    """D = 577, one past MAX_HEAD_DIM: a ValueError naming D, before anything is written."""
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 577, 4, [[2]], device=device)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="head dim D must be in 1..576, got 577"):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_cpu_kernel_head_dim_limit_when_called_directly():
    """The C++ check's limit is the wrapper's: D = 576 runs, D = 577 raises, the cache untouched."""
    for D, fits in ((576, True), (577, False)):
        q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, D, 4, [[2]])
        if fits:
            torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, D ** -0.5)
        else:
            before = k_cache.clone()
            with pytest.raises(RuntimeError, match="head dim D must be in 1..576, got 577"):
                torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, D ** -0.5)
            assert torch.equal(k_cache, before)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_ragged_rows_padding_and_shuffled_positions(backend, device):
    # row 0: left padding; row 1: right padding; row 2: all padding; row 3: positions out of order
    positions = [[-1, -1, 4, 5, 6], [20, 21, 22, -1, -1], [-1, -1, -1, -1, -1], [9, 3, 30, 0, 12]]
    case = make_case(4, 4, 2, 5, 32, 31, positions, device=device)
    out = check_against_reference(backend, device, *case)
    assert torch.all(out[2] == 0) and torch.all(out[0, :, :2] == 0) and torch.all(out[1, :, 3:] == 0)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_positions_shared_by_all_rows(backend, device, positions_dtype):
    q, k, v, k_cache, v_cache, _ = make_case(3, 4, 2, 3, 16, 12, [[0, 1, 2]] * 3, device=device)
    check_against_reference(backend, device, q, k, v, k_cache, v_cache,
                            torch.tensor([4, 5, 6], dtype=positions_dtype, device=device))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_stale_slots_after_crop_do_not_leak(backend, device):
    """After a crop to length L, slots >= L hold stale (here: huge) values; a query at position p
    attends 0..p only, so the result must equal the one with a clean cache."""
    B, Hq, Hkv, T, D, S = 2, 4, 2, 2, 32, 64
    lengths = [7, 20]
    positions = torch.stack([torch.arange(n, n + T) for n in lengths]).to(device)
    q, k, v, k_cache, v_cache, _ = make_case(B, Hq, Hkv, T, D, S, positions, device=device)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        clean_k[b, :, n:] = 0
        clean_v[b, :, n:] = 0
        k_cache[b, :, n:] = 1e4
        v_cache[b, :, n:] = -1e4
    stale = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    clean = ops.kv_cache_attention(q, k, v, clean_k, clean_v, positions, backend=backend)
    torch.testing.assert_close(stale, clean, atol=0, rtol=0)
    assert stale.abs().max() < 100


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("T, starts", [(1, [0, 30]), (5, [0, 26]), (20, [0, 11])], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_never_written_slots_of_an_empty_cache_do_not_leak(backend, device, T, starts, dtype):
    """Caches from torch.empty hold garbage past what was written; here NaN, past every query of
    the row (and in row 0 everything but this call's slots). No query sees those slots, so the output
    equals the one with zeros there; an implementation multiplying them by a zero probability
    would return NaN."""
    if _is_interpreter(backend, device) and (T == 20 or dtype == torch.float16):
        pytest.skip("Triton interpreter: decode and verify in float32 cover it")
    B, Hq, Hkv, D, S = 2, 4, 2, 32, 48
    positions = _contiguous_positions(B, T, starts).to(device)
    q, k, v, k_cache, v_cache, _ = make_case(B, Hq, Hkv, T, D, S, positions, dtype, device, seed=4)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(starts):
        for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
            cache[b, :, start + T:] = float("nan")
            clean[b, :, start + T:] = 0
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    want = ops.kv_cache_attention(q, k, v, clean_k, clean_v, positions, backend=backend)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_backward_through_it_is_a_clear_error(backend, device):
    """The op writes the cache in place and has no gradient. With inputs that require one, the
    forward gives the same output and writes, and a backward raises instead of giving q, k, v none
    (silently, or with a warning)."""
    positions = _contiguous_positions(2, 3, [4, 0])
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 12, positions, device=device)
    want_cache = k_cache.clone()
    want = ops.kv_cache_attention(q, k, v, want_cache, v_cache.clone(), positions, backend=backend)
    q, k = q.requires_grad_(), k.requires_grad_()
    out = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    torch.testing.assert_close(out.detach(), want)
    torch.testing.assert_close(k_cache, want_cache)
    with pytest.raises(RuntimeError, match="kv_cache_attention has no gradient"):
        out.sum().backward()


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_non_contiguous_inputs_and_custom_scale(backend, device):
    # HF layout: projections are [B, T, H, D], transposed to [B, H, T, D] without a copy
    B, Hq, Hkv, T, D, S = 2, 4, 2, 3, 16, 10
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, Hq, D, generator=g).to(device).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(device).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(device).transpose(1, 2)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(device)
    v_cache = torch.randn(B, Hkv, S, D, generator=g).to(device)
    assert not q.is_contiguous()
    check_against_reference(backend, device, q, k, v, k_cache, v_cache,
                            torch.tensor([[0, 1, 2], [5, 6, 7]], device=device), scale=0.3)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_head_dim_of_one_with_any_stride(backend, device):
    """A head of one number may have any stride in that dim (torch calls such a tensor contiguous,
    so .contiguous() keeps the stride); the kernels, which need stride 1 there, still take it."""
    B, Hq, Hkv, T, S = 1, 2, 1, 3, 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, Hq, 1, T, generator=g).to(device).transpose(2, 3)  # [1, 2, 3, 1], strides (6, 3, 1, 3)
    k = torch.randn(B, Hkv, 1, T, generator=g).to(device).transpose(2, 3)
    v = torch.randn(B, Hkv, 1, T, generator=g).to(device).transpose(2, 3)
    assert q.stride(-1) != 1 and q.is_contiguous()
    check_against_reference(backend, device, q, k, v, torch.zeros(B, Hkv, S, 1, device=device),
                            torch.zeros(B, Hkv, S, 1, device=device), torch.tensor([[2, 3, 4]], device=device))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_decode_steps_accumulate_in_the_cache(backend, device):
    """Prefill then 6 decode steps through the kernel equals attention over the whole sequence."""
    B, H, D, S, prompt, steps = 2, 2, 16, 16, 4, 6
    total = prompt + steps
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, total, D, generator=g).to(device) for _ in range(3))
    k_cache = torch.zeros(B, H, S, D, device=device)
    v_cache = torch.zeros(B, H, S, D, device=device)
    outs = [ops.kv_cache_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], k_cache, v_cache,
                                   torch.arange(prompt, device=device), backend=backend)]
    for t in range(prompt, total):
        outs.append(ops.kv_cache_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], k_cache,
                                           v_cache, torch.tensor([t], device=device), backend=backend))
    got = torch.cat(outs, dim=2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_empty_batch_and_all_padding(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(0, 4, 2, 1, 16, 8, torch.zeros(0, 1), device=device)
    assert ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend).shape == (0, 4, 1, 16)
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[-1] * 3] * 2, device=device)
    before = k_cache.clone()
    out = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    assert torch.all(out == 0) and torch.equal(k_cache, before)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("bad", [[[0, 8]], [[-2, 1]], [[3, 3]]], ids=["eq-S", "below-minus-one", "repeated"])
def test_bad_positions_raise_before_writing(backend, device, bad):
    q, k, v, k_cache, v_cache, _ = make_case(1, 2, 1, 2, 16, 8, [[0, 1]], device=device)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match="positions"):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, torch.tensor(bad, device=device), backend=backend)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_cpu_kernel_refuses_out_of_range_positions_when_called_directly():
    q, k, v, k_cache, v_cache, _ = make_case(1, 2, 1, 1, 16, 8, [[0]])
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="positions"):
        torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, torch.tensor([[8]]), 0.25)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_opcheck_cpu():
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[0, 1, 2], [4, -1, 5]])
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, v, k_cache, v_cache, positions, 0.25))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [4, -1, 5]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, 24, rows, device=device)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, v, k_cache, v_cache, positions, 0.25))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
@pytest.mark.parametrize("T", [2, 17], ids=["decode-kernel", "prefill-kernel"])
def test_triton_kernel_treats_out_of_range_positions_as_padding(backend, device, T):
    """Under torch.compile / CUDA graphs the wrapper cannot check position values: the kernel
    itself must then write nothing and return zeros for positions outside [-1, S)."""
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

    S = 20
    rows = [list(range(T)), list(range(T))]
    rows[0][1], rows[1][0], rows[1][-1] = S, -7, S + 1000  # out of range at both ends
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, S, rows, device=device)
    cleaned = torch.where((positions >= 0) & (positions < S), positions, -1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = ops.kv_cache_attention(q, k, v, want_k, want_v, cleaned, 0.25, backend="reference")
    got = kv_cache_attention_triton(q, k, v, k_cache, v_cache, positions, 0.25)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.all(got[0, :, 1] == 0) and torch.all(got[1, :, 0] == 0) and torch.all(got[1, :, -1] == 0)


def check_compiled_fullgraph(backend, q, k, v, k_cache, v_cache, positions, **options):
    """kv_cache_attention(**options) inside torch.compile(fullgraph=True) equals the eager call, and
    the compiled graph keeps the in-place cache writes (v / v_cache None with values in keys).
    Every caller compiles the same code object `step` with its own options, so Dynamo is reset first:
    past 8 guard sets on one code object it refuses to compile (recompile_limit), which made these
    tests fail or pass by how many of them ran before in the same process."""
    torch._dynamo.reset()
    want_k = k_cache.clone()
    want_v = None if v_cache is None else v_cache.clone()
    want = ops.kv_cache_attention(q, k, v, want_k, want_v, positions, backend=backend, **options)

    @torch.compile(fullgraph=True)
    def step(q, k, v, k_cache, v_cache, positions):
        return ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend, **options) * 2

    got = step(q, k, v, k_cache, v_cache, positions)
    torch.testing.assert_close(got, want * 2)
    assert torch.equal(k_cache, want_k) and (v_cache is None or torch.equal(v_cache, want_v))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    check_compiled_fullgraph(backend, *make_case(2, 4, 2, 1, 16, 8, [[3], [6]], device=device))


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_long_cache_split_kv_called_twice(backend, device, dtype):
    """Long caches with few (batch x kv head) pairs make the GPU kernels split the KV length over
    blocks and combine the splits; two calls in a row also check that per-call combine state
    (counters, workspaces) is reset."""
    if _is_interpreter(backend, device):
        pytest.skip("Triton interpreter: a 2048-slot cache is too slow to interpret")
    B, Hq, Hkv, D, S = 2, 4, 1, 64, 2048
    q, k, v, k_cache, v_cache, _ = make_case(B, Hq, Hkv, 5, D, S, [[0] * 5] * 2, dtype, device, seed=3)
    for starts in ([700, 1500], [701, 1501]):
        positions = _contiguous_positions(B, 1, starts).to(device)
        check_against_reference(backend, device, q[:, :, :1].clone(), k[:, :, :1].clone(), v[:, :, :1].clone(),
                                k_cache, v_cache, positions)
    positions = _contiguous_positions(B, 5, [1800, 40]).to(device)  # verification: T = k + 1 = 5
    check_against_reference(backend, device, q, k, v, k_cache, v_cache, positions)


GPU_BACKENDS = [p for p in BACKENDS if p.id in ("cuda", "triton-cuda")]


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("B, T, S", [(4, 1, 32768), (4, 5, 32768), (2, 100, 16384)],
                         ids=["decode", "verify", "prefill"])
def test_llama_heads_long_cache_on_gpu(backend, device, B, T, S):
    """Llama-3-8B heads (32 query / 8 kv, D = 128) in bf16 over long caches with rows near the end,
    in the middle and at the start: the GPU tuning's many splits, tiles and int64 offsets."""
    starts = [S - T, S // 2 + 3, 4095, 0][:B]
    case = make_case(B, 32, 8, T, 128, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=5)
    check_against_reference(backend, device, *case)


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("B, T, S", [(3, 1, 16384), (3, 5, 16384), (2, 100, 4096)],
                         ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("D, Hq, Hkv", [(512, 8, 2), (576, 16, 1)], ids=["d512-gqa", "d576-mla"])
def test_large_head_dims_long_cache_on_gpu(backend, device, dtype, B, T, S, D, Hq, Hkv):
    """D = 512 (Gemma 4's global layers; 8 query / 2 kv heads here) and D = 576 (MLA's latents: 16
    query heads over one kv head) over long caches: the CUDA kernels' shared memory sized by D
    (16-slot SIMT tiles; the WMMA prefill's smaller tiles) and Triton's large-head tiles (at 576,
    512 + a 64-wide tail), with many splits and prefill tiles."""
    starts = [S - T, S // 2 + 3, 0][:B]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=12)
    check_against_reference(backend, device, *case)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_graph_capture_and_replay(backend):
    """The op is captured in a CUDA graph and replayed with new positions / new tokens written into
    the captured input buffers; every replay matches the reference."""
    if not torch.cuda.is_available() or not _extension.has_kernel("kv_cache_attention", "CUDA"):
        pytest.skip("requires CUDA and an extension built with CUDA")
    B, Hq, Hkv, D, S = 2, 8, 2, 128, 1024
    q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, 1, D, S, [[10], [20]], torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (allocations, autotuning)
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    for step in range(3):
        new = make_case(B, Hq, Hkv, 1, D, S, [[300 + step], [900 + step]], torch.bfloat16, "cuda", seed=10 + step)
        want_k, want_v = k_cache.clone().double(), v_cache.clone().double()
        want = reference.kv_cache_attention(new[0].double(), new[1].double(), new[2].double(), want_k, want_v,
                                            new[5])
        for buffer, value in zip((q, k, v, positions), (new[0], new[1], new[2], new[5])):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache.double(), want_k)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T", [3, 20], ids=["decode-kernel", "prefill-kernel"])
@pytest.mark.parametrize("Hq", [4, 64], ids=["g2", "g32"])
def test_repeated_positions_unchecked_last_token_wins(backend, device, T, Hq):
    """Under capture / compile repeated positions cannot be refused: a slot written by several
    tokens of a row then holds the last one's K/V (as a sequential scatter), in the cache and in
    what every query attends to. 32 query heads per kv head make the Triton decode kernel's
    (group head, token) rows span several programs of one slot range (more than 64 rows on a GPU,
    16 under the interpreter): each stores the new rows before reading them."""
    S = 32
    rows = [[2, 1, 2] + list(range(3, T)), list(range(T - 1)) + [0]]  # slot 2 / slot 0 written twice
    q, k, v, k_cache, v_cache, positions = make_case(2, Hq, 2, T, 16, S, rows, device=device)
    # the reference with every writer of a slot carrying the last writer's K/V: order-free
    k_last, v_last = k.clone(), v.clone()
    for b, row in enumerate(rows):
        for t, slot in enumerate(row):
            last = max(i for i, s in enumerate(row) if s == slot)
            k_last[b, :, t], v_last[b, :, t] = k[b, :, last], v[b, :, last]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference.kv_cache_attention(q, k_last, v_last, want_k, want_v, positions, 0.25)
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, 0.25, backend=backend,
                                 check_positions=False)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# Decode shapes whose dynamic shared memory alone is under 48 KiB but not with the kernel's static
# arrays added: the launch must opt in (dtype, D, G, T).
SHARED_MEMORY_EDGES = [("float32", 64, 4, 5), ("float16", 128, 4, 3), ("bfloat16", 256, 8, 1)]


def test_cuda_decode_shared_memory_edges_in_a_fresh_process():
    """Each kernel instantiation's first launch at a size just past the 48 KiB default; a fresh
    process, since an earlier opt-in of the same kernel in this one would hide a missing opt-in."""
    if not torch.cuda.is_available() or not _extension.has_kernel("kv_cache_attention", "CUDA"):
        pytest.skip("requires CUDA and an extension built with CUDA")
    script = textwrap.dedent(f"""
        import torch
        from python_tests.ops.test_kv_cache_attention import _contiguous_positions, check_against_reference, make_case
        for dtype_name, D, G, T in {SHARED_MEMORY_EDGES!r}:
            B, Hkv, S = 2, 2, 300
            case = make_case(B, Hkv * G, Hkv, T, D, S, _contiguous_positions(B, T, [100, 7]),
                             getattr(torch, dtype_name), "cuda")
            check_against_reference("cuda", "cuda", *case)
            print("ok", dtype_name, D, G, T)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(SHARED_MEMORY_EDGES)


@pytest.mark.parametrize("backend, device", [p for p in BACKENDS if p.values[0] == "triton"])
def test_every_launch_config_of_the_decode_sweep(backend, device):
    """bench/bench_kv_tiles.py times these decode launch constants (tile, splits, warps) to pick
    the GPU's: each one computes the op (ragged rows, padding, several splits), caches included."""
    from bench.bench_kv_tiles import tunings
    from gptfast_kernels.triton import kv_cache_attention as kv

    positions = [[300, 301, 302], [500, -1, 561]]
    configs = list(tunings(kv._GPU))
    assert len(configs) > 1
    for tune in configs:
        q, k, v, k_cache, v_cache, pos = make_case(2, 4, 2, 3, 32, 600, positions, device=device)
        inputs64 = [t.cpu().double() for t in (q, k, v, k_cache, v_cache)]
        want = reference.kv_cache_attention(*inputs64, pos.cpu(), None)
        got = kv.kv_cache_attention_tuned(q, k, v, k_cache, v_cache, pos, 32 ** -0.5, tune, 8)
        assert torch.equal(k_cache.cpu().double(), inputs64[3]), tune
        assert torch.equal(v_cache.cpu().double(), inputs64[4]), tune
        error = (got.cpu().double() - want).abs().max().item()
        assert error <= ERROR_FLOOR[torch.float32], f"{tune}: max error {error:.3g}"
