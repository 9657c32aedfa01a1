"""kv_cache_attention with a sliding window, logit soft-capping and / or attention sinks (Mistral,
Qwen2, Phi-3, StarCoder2, Gemma 2 / 3, GPT-OSS): every backend against the float64 reference, with the
tolerance rule of test_kv_cache_attention.py; slots before the window are never read; bad values
name the argument.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from python_tests.ops.test_kv_cache_attention import (BACKENDS, DTYPES, TRITON_BACKENDS, _contiguous_positions,
                                                      _is_interpreter, check_against_reference,
                                                      check_compiled_fullgraph, check_unseen_slots_are_never_read,
                                                      make_case)

# (B, Hq, Hkv, T, D, S, starts, window): windows shorter than the rows' positions, so each query
# sees a strict suffix; the decode row at 290 with window 40 leaves most of a 300-slot cache unread
# (and spans several splits of what remains); prefill T = 37 > window = 9 crosses tiles.
WINDOW_SHAPES = {
    "decode-gqa": (3, 8, 2, 1, 64, 50, [0, 17, 49], 8),
    "decode-long-cache": (1, 4, 2, 1, 32, 300, [290], 40),
    "verify-k4-d96": (2, 6, 3, 5, 96, 40, [10, 30], 6),
    "verify-mqa-g8": (2, 8, 1, 5, 32, 70, [60, 3], 20),
    "prefill-t37-mha": (2, 4, 4, 37, 64, 48, [0, 11], 9),
    "prefill-t20-window1": (1, 2, 1, 20, 16, 24, [2], 1),  # each query sees itself only
}
INTERPRETER_SHAPES = ("decode-gqa", "decode-long-cache", "verify-mqa-g8", "prefill-t37-mha",
                      "prefill-t20-window1")
# Gemma 2 caps scores at 50 (attention); a cap of 2 (below the scores of these random inputs) makes
# the tanh matter everywhere, not only in the tails
SOFTCAPS = [None, 2.0]


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("shape", list(WINDOW_SHAPES))
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=["window", "window-softcap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_window_matches_reference(backend, device, shape, softcap, dtype):
    if _is_interpreter(backend, device) and (shape not in INTERPRETER_SHAPES or dtype == torch.float16):
        pytest.skip("Triton interpreter: a subset of shapes keeps the suite fast")
    B, Hq, Hkv, T, D, S, starts, window = WINDOW_SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=7)
    check_against_reference(backend, device, *case, window=window, softcap=softcap)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T", [1, 5, 20], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_softcap_without_window(backend, device, T, dtype):
    if _is_interpreter(backend, device) and dtype == torch.float16:
        pytest.skip("Triton interpreter: bfloat16 covers the 16-bit path")
    case = make_case(2, 4, 2, T, 32, 40, _contiguous_positions(2, T, [3, 40 - T]), dtype, device, seed=8)
    # scale 1 keeps raw dot products (around +-6 here) well past the cap of 3
    check_against_reference(backend, device, *case, scale=1.0, softcap=3.0)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_ragged_rows_and_padding_with_a_window(backend, device):
    # left / right padding, an all-padding row, positions out of order: windows per query
    positions = [[-1, -1, 4, 5, 6], [20, 21, 22, -1, -1], [-1, -1, -1, -1, -1], [9, 3, 30, 0, 12]]
    case = make_case(4, 4, 2, 5, 32, 31, positions, device=device)
    out = check_against_reference(backend, device, *case, window=4, softcap=5.0)
    assert torch.all(out[2] == 0) and torch.all(out[0, :, :2] == 0) and torch.all(out[1, :, 3:] == 0)


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("T, starts", [(1, [250, 90]), (5, [250, 90]), (20, [200, 90])],
                         ids=["decode", "verify", "prefill"])
def test_slots_before_the_window_are_never_read(backend, device, T, starts):
    """Slots that no query of a row can see (before every query's window) hold NaN: a kernel that
    read them, even to multiply by a zero probability, would return NaN."""
    if _is_interpreter(backend, device) and T == 20:
        pytest.skip("Triton interpreter: decode and verify cover the split kernel")
    window = 16
    check_unseen_slots_are_never_read(backend, device, T, starts, lambda start: start - window + 1, seed=9,
                                      window=window)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_window_covering_every_slot_equals_no_window(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 12, [[0, 1, 2], [8, 9, 10]], device=device)
    caches = (k_cache.clone(), v_cache.clone())
    plain = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    windowed = ops.kv_cache_attention(q, k, v, *caches, positions, window=11, backend=backend)
    torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_decode_steps_with_a_window_equal_masked_attention(backend, device):
    """Prefill then decode steps through the kernel equal sliding-window causal attention over the
    whole sequence (an explicit boolean mask for SDPA: slot s visible to query t iff t - W < s <= t)."""
    B, H, D, S, prompt, steps, window = 2, 2, 16, 24, 9, 8, 5
    total = prompt + steps
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(B, H, total, D, generator=g).to(device) for _ in range(3))
    k_cache = torch.zeros(B, H, S, D, device=device)
    v_cache = torch.zeros(B, H, S, D, device=device)
    outs = [ops.kv_cache_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], k_cache, v_cache,
                                   torch.arange(prompt, device=device), window=window, backend=backend)]
    for t in range(prompt, total):
        outs.append(ops.kv_cache_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], k_cache, v_cache,
                                           torch.tensor([t], device=device), window=window, backend=backend))
    got = torch.cat(outs, dim=2)
    query, key = torch.arange(total)[:, None], torch.arange(total)[None, :]
    mask = ((key <= query) & (key > query - window)).to(device)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, 2**31], ids=["zero", "negative", "float", "bool", "huge"])
def test_bad_window_names_the_argument(window):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    before = k_cache.clone()
    with pytest.raises(ValueError, match="window"):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, window=window)
    assert torch.equal(k_cache, before)


# 1e39 is inf in float32; past 2^125 the GPU kernels' inverse of the cap (times log2(e)) is subnormal;
# 10**400 is an int no float holds
@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), "50", 1e-40, True, 1e39, 2.0**126, 10**400],
                         ids=["zero", "negative", "inf", "nan", "str", "zero-in-float32", "bool", "inf-in-float32",
                              "past-2^125", "int-past-float"])
def test_bad_softcap_names_the_argument(softcap):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    with pytest.raises(ValueError, match="softcap"):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, softcap=softcap)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("softcap", [1e4, 1e9, 2.0**125], ids=["1e4", "1e9", "largest"])
def test_large_softcaps_are_exact(backend, device, softcap):
    """Caps far above the scores, up to the largest the checks take (2^125), against the float64
    reference (for the largest: the uncapped result). The GPU kernels' tanh from exp2 loses
    score / cap below about 1e-7 (1 - e rounds to 0), and an inverse cap's product with the scores may
    be subnormal: they take tanh's series there, so each score is exact to float32 rounding."""
    q, k, v, k_cache, v_cache, positions = make_case(1, 4, 2, 2, 16, 8, [[3, 4]], device=device)
    check_against_reference(backend, device, q, k, v, k_cache, v_cache, positions, softcap=softcap)
    if softcap == 2.0**125:
        want = ops.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, backend="reference")
        got = ops.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, softcap=softcap,
                                     backend=backend)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
@pytest.mark.parametrize("window, softcap", [(-1, 0.0), (0, -2.0), (0, float("inf")), (0, 1e-40), (0, 2.0**126)],
                         ids=["window", "softcap", "softcap-inf", "softcap-zero-in-float32", "softcap-past-2^125"])
def test_cpu_kernel_refuses_bad_window_or_softcap_when_called_directly(window, softcap):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    with pytest.raises(RuntimeError, match="window" if window < 0 else "softcap"):
        torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, 0.25, window, softcap)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1e39, 2.0**127],
                         ids=["nan", "inf", "inf-in-float32", "past-2^126"])
def test_cpu_kernel_refuses_bad_scale_when_called_directly(scale):
    """The C++ entry takes scale as a double: one the kernels' float32 (times log2(e)) cannot hold raises."""
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, scale)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_opcheck_cpu_with_window_and_softcap():
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[0, 1, 2], [4, -1, 5]])
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, v, k_cache, v_cache, positions, 0.25, 2, 5.0))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton_with_window_and_softcap(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [4, -1, 5]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, 24, rows, device=device)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, v, k_cache, v_cache, positions, 0.25, 4, 5.0))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph_with_window_and_softcap(backend, device):
    case = make_case(2, 4, 2, 1, 16, 12, [[3], [10]], device=device)
    check_compiled_fullgraph(backend, *case, window=4, softcap=2.0)


GPU_BACKENDS = [p for p in BACKENDS if p.id in ("cuda", "triton-cuda")]


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("B, T, S", [(4, 1, 32768), (4, 5, 32768), (2, 100, 16384)],
                         ids=["decode", "verify", "prefill"])
def test_llama_heads_with_mistral_window_long_cache_on_gpu(backend, device, B, T, S):
    """Mistral-7B-v0.1 heads (32 / 8, D = 128, window 4096) in bf16 with rows past the window, so the
    splits and tiles start mid-cache; Gemma 2's softcap of 50 on top."""
    starts = [S - T, S // 2 + 3, 4095, 0][:B]
    case = make_case(B, 32, 8, T, 128, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=11)
    check_against_reference(backend, device, *case, window=4096, softcap=50.0)


def check_window_shape(backend, device, shape, dtype, seed, with_window: bool, **options):
    """check_against_reference on WINDOW_SHAPES[shape] (its window when ``with_window``) with ``options``
    (sinks=, alibi_slopes=: each a function of the query heads and the device)."""
    B, Hq, Hkv, T, D, S, starts, window = WINDOW_SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=seed)
    check_against_reference(backend, device, *case, window=window if with_window else None,
                            **{name: make(Hq, device) for name, make in options.items()})


def _sinks(Hq, device, seed=12):
    # around the scores' own size, so the sink takes a real share of each softmax
    return (torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("shape", ["decode-gqa", "decode-long-cache", "verify-mqa-g8", "prefill-t37-mha"])
@pytest.mark.parametrize("window", [None, "shape"], ids=["no-window", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_sinks_match_reference(backend, device, shape, window, dtype):
    """GPT-OSS's attention sinks, with one split and with several (decode-long-cache: the splits'
    merge adds each sink once), with and without a window."""
    if _is_interpreter(backend, device) and dtype == torch.float16:
        pytest.skip("Triton interpreter: bfloat16 covers the 16-bit path")
    check_window_shape(backend, device, shape, dtype, 13, bool(window), sinks=_sinks)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_sinks_with_padding_rows_and_float16_sinks(backend, device):
    positions = [[-1, -1, 4, 5, 6], [-1, -1, -1, -1, -1]]
    case = make_case(2, 4, 2, 5, 32, 31, positions, device=device)
    out = check_against_reference(backend, device, *case, sinks=_sinks(4, device).half())
    assert torch.all(out[1] == 0) and torch.all(out[0, :, :2] == 0)


@pytest.mark.parametrize("sinks, needle", [
    (torch.zeros(3), r"sinks must have one logit per query head, \[Hq\] = \[2\]"),
    (torch.zeros(2, 1), "sinks must have 1 dimension,"),
    (torch.zeros(2, dtype=torch.int32), "sinks must have dtype"),
], ids=["length", "ndim", "dtype"])
def test_bad_sinks_name_the_argument(sinks, needle):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    with pytest.raises(ValueError, match=needle):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, sinks=sinks)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_opcheck_cpu_with_sinks():
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[0, 1, 2], [4, -1, 5]])
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, v, k_cache, v_cache, positions, 0.25, 2, 0.0, _sinks(4, "cpu")))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton_with_sinks(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [4, -1, 5]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, 24, rows, device=device)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, _sinks(4, device)))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph_with_sinks(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 1, 16, 12, [[3], [10]], device=device)
    sinks = _sinks(4, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = ops.kv_cache_attention(q, k, v, want_k, want_v, positions, window=4, sinks=sinks, backend=backend)

    @torch.compile(fullgraph=True)
    def step(q, k, v, k_cache, v_cache, positions, sinks):
        return ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, window=4, sinks=sinks, backend=backend)

    torch.testing.assert_close(step(q, k, v, k_cache, v_cache, positions, sinks), want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
