"""kv_cache_attention with ``chunk_size`` (Llama 4's chunked attention: a query at position p sees only
the slots of its own chunk of C positions up to itself, p - p % C .. p): every backend against a float64
attention under an explicit chunk mask (slot s visible iff s // C == p // C and s <= p, written
independently of the kernels' first-slot rule), with the tolerance rule of test_kv_cache_attention.py;
the caches written exactly as by the reference; decode, verification and prefill crossing chunk
boundaries, positions at chunk starts and ends, ragged, shuffled and padded rows, GQA / MQA, softcap,
sinks, values in the keys; slots before a row's chunks are never read; bad arguments name chunk_size
and write nothing; the C++ op's own checks, opcheck and torch.compile.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.ops.test_kv_cache_attention import (BACKENDS, DTYPES, ERROR_FLOOR, TRITON_BACKENDS,
                                                      _contiguous_positions, _is_interpreter, check_compiled_fullgraph,
                                                      check_unseen_slots_are_never_read, make_case)

ALL_BACKENDS = BACKENDS + [pytest.param("reference", "cpu", id="reference")]
HAS_CPU_KERNEL = _extension.has_kernel("kv_cache_attention", "CPU")


def chunk_mask(positions, S, chunk):
    """[B, T, S] bool: slot s is visible to query (b, t) iff it lies in the query's chunk, at or
    before its position (padding queries see nothing)."""
    pos = positions[:, :, None]
    slots = torch.arange(S, device=positions.device)[None, None, :]
    return (pos >= 0) & (slots <= pos) & (torch.div(slots, chunk, rounding_mode="floor")
                                          == torch.div(pos, chunk, rounding_mode="floor"))


def masked_attention(q, k, v, k_cache, v_cache, positions, chunk, scale=None, softcap=None, sinks=None,
                     value_dim=None):
    """Scatters k / v into copies of the caches, then attention under chunk_mask computed in q's
    dtype throughout (float64 for the truth, 16-bit for the low-precision baseline) -> [B, Hq, T, Dv].
    v / v_cache are unused with value_dim (the values are the keys' first value_dim numbers)."""
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    pos = reference.broadcast_positions(positions, B)
    k_cache = k_cache.clone()
    rows, cols = (pos >= 0).nonzero(as_tuple=True)
    k_cache[rows, :, pos[rows, cols]] = k[rows, :, cols]
    if value_dim:
        values = k_cache[..., :value_dim]
    else:
        values = v_cache.clone()
        values[rows, :, pos[rows, cols]] = v[rows, :, cols]
    mask = chunk_mask(pos, S, chunk)
    group = Hq // Hkv
    scores = (q @ k_cache.repeat_interleave(group, dim=1).transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[None, :, None, None].expand(B, Hq, T, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :S]  # padding rows are all -inf
    return (probs @ values.repeat_interleave(group, dim=1)) * (pos >= 0)[:, None, :, None]


def check_chunked(backend, device, q, k, v, k_cache, v_cache, positions, chunk, scale=None, softcap=None,
                  sinks=None, value_dim=None):
    """Runs ``backend`` with chunk_size=chunk; checks its output against masked_attention in float64
    (at most twice the error of the same attention in q's dtype, for 16-bit) and its caches against
    the reference's writes."""
    before = [t.cpu() for t in (q, k, v, k_cache, v_cache)]
    inputs64 = [t.double() for t in before]
    sinks64 = None if sinks is None else sinks.cpu().double()
    want = masked_attention(*inputs64, positions.cpu(), chunk, scale, softcap, sinks64, value_dim)
    want_k, want_v = inputs64[3].clone(), inputs64[4].clone()
    reference.kv_cache_attention(*inputs64[:3], want_k, want_v, positions.cpu(), scale, None, softcap, sinks64,
                                 False, value_dim, chunk)
    got = ops.kv_cache_attention(q, k, None if value_dim else v, k_cache, None if value_dim else v_cache, positions,
                                 scale, softcap=softcap, sinks=sinks, value_dim=value_dim, chunk_size=chunk,
                                 backend=backend)
    assert got.shape == (*q.shape[:-1], value_dim or q.shape[-1]) and got.dtype == q.dtype
    assert got.device == q.device and got.is_contiguous()
    assert torch.equal(k_cache.cpu().double(), want_k), "k_cache differs from the reference's"
    assert torch.equal(v_cache.cpu().double(), want_v), "v_cache differs from the reference's"
    error = (got.cpu().double() - want).abs().max().item() if got.numel() else 0.0
    allowed = ERROR_FLOOR[q.dtype]
    if q.dtype != torch.float32:
        baseline = masked_attention(*before, positions.cpu(), chunk, scale, softcap,
                                    None if sinks is None else sinks.cpu(), value_dim)
        allowed = max(2 * (baseline.double() - want).abs().max().item(), allowed)
    assert error <= allowed, f"max error {error:.3g} > allowed {allowed:.3g}"
    return got


# (B, Hq, Hkv, T, D, S, starts, chunk): decode rows at chunk starts and ends, verification and
# prefill rows crossing one or several chunk boundaries, a long cache whose only visible slots are
# a late chunk's (the split kernels' ranges then start mid-cache), chunks of one slot.
SHAPES = {
    "decode-gqa-edges": (5, 8, 2, 1, 64, 40, [0, 7, 8, 15, 16], 8),  # starts, ends, starts
    "decode-mqa-d80": (2, 4, 1, 1, 80, 33, [5, 32], 16),
    "decode-long-cache": (1, 4, 2, 1, 32, 300, [290], 100),  # sees 200..290: several splits
    "verify-k4-d96": (2, 6, 3, 5, 96, 40, [14, 30], 16),  # each row crosses a boundary
    "verify-aligned-chunk": (2, 4, 2, 8, 32, 40, [8, 20], 8),  # row 0 is exactly one chunk
    "verify-mqa-g8": (2, 8, 1, 5, 32, 70, [60, 3], 8),
    "prefill-t37-mha": (2, 4, 4, 37, 64, 48, [0, 11], 8),  # 5 and 6 chunks
    "prefill-t20-late": (1, 4, 2, 20, 32, 300, [250], 32),  # chunks 224.. and 256..
    "prefill-t20-chunk1": (1, 2, 1, 20, 16, 24, [2], 1),  # each query sees itself only
}
INTERPRETER_SHAPES = ("decode-gqa-edges", "decode-long-cache", "verify-k4-d96", "verify-aligned-chunk",
                      "prefill-t37-mha", "prefill-t20-late", "prefill-t20-chunk1")


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_masked_attention(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and (shape not in INTERPRETER_SHAPES or dtype == torch.float16):
        pytest.skip("Triton interpreter: a subset of shapes keeps the suite fast")
    B, Hq, Hkv, T, D, S, starts, chunk = SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=31)
    check_chunked(backend, device, *case, chunk)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_ragged_shuffled_and_padded_rows(backend, device):
    # left / right padding, an all-padding row, positions out of order across three chunks
    positions = [[-1, -1, 14, 15, 16], [23, 24, 25, -1, -1], [-1, -1, -1, -1, -1], [9, 3, 30, 0, 16]]
    case = make_case(4, 4, 2, 5, 32, 31, positions, device=device, seed=32)
    out = check_chunked(backend, device, *case, 8)
    assert torch.all(out[2] == 0) and torch.all(out[0, :, :2] == 0) and torch.all(out[1, :, 3:] == 0)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [30, 5]), (5, [12, 40]), (20, [3, 40])], ids=["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_with_softcap_sinks_and_scale(backend, device, T, starts, dtype):
    if _is_interpreter(backend, device) and dtype == torch.bfloat16 and T == 20:
        pytest.skip("Triton interpreter: float32 covers prefill")
    B, Hq, Hkv, D, S, chunk = 2, 8, 2, 64, 64, 16
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=33)
    sinks = (torch.randn(Hq, generator=torch.Generator().manual_seed(34)) * 2).to(device)
    check_chunked(backend, device, *case, chunk, scale=0.2, softcap=2.0, sinks=sinks)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("T, starts, D, value_dim", [(1, [30, 17], 576, 512), (5, [12, 29], 96, 40),
                                                      (20, [3, 14], 64, 64)], ids=["decode-mla", "verify", "prefill"])
def test_with_values_in_keys(backend, device, T, starts, D, value_dim):
    """Multi-head latent attention's cache (values are the keys' first value_dim numbers) with chunks."""
    B, Hq, Hkv, S, chunk = 2, 4, 1, 40, 8
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=35)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    check_chunked(backend, device, *case, chunk, softcap=3.0, sinks=sinks, value_dim=value_dim)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [250, 90]), (5, [250, 90]), (20, [200, 90])],
                         ids=["decode", "verify", "prefill"])
def test_slots_before_the_rows_chunks_are_never_read(backend, device, T, starts):
    """Slots before the chunk of a row's earliest query hold NaN: a kernel that read them, even to
    multiply by a zero probability, would return NaN."""
    chunk = 32
    check_unseen_slots_are_never_read(backend, device, T, starts, lambda start: start - start % chunk, seed=36,
                                      chunk_size=chunk)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_a_chunk_covering_every_slot_equals_no_chunking(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 12, [[0, 1, 2], [8, 9, 10]], device=device)
    caches = (k_cache.clone(), v_cache.clone())
    plain = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend)
    for chunk in (11, 2**31 - 1):
        chunked = ops.kv_cache_attention(q, k, v, *caches, positions, chunk_size=chunk, backend=backend)
        torch.testing.assert_close(chunked, plain, atol=0, rtol=0)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_prefill_then_decode_steps_equal_chunked_masked_attention(backend, device):
    """A prompt then decode steps through the kernel (crossing two chunk boundaries) equal attention
    over the whole sequence under the chunk mask (SDPA with an explicit boolean mask)."""
    B, H, D, S, prompt, steps, chunk = 2, 2, 16, 24, 7, 12, 6
    total = prompt + steps
    g = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(B, H, total, D, generator=g).to(device) for _ in range(3))
    k_cache = torch.zeros(B, H, S, D, device=device)
    v_cache = torch.zeros(B, H, S, D, device=device)
    outs = [ops.kv_cache_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], k_cache, v_cache,
                                   torch.arange(prompt, device=device), chunk_size=chunk, backend=backend)]
    for t in range(prompt, total):
        outs.append(ops.kv_cache_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], k_cache, v_cache,
                                           torch.tensor([t], device=device), chunk_size=chunk, backend=backend))
    got = torch.cat(outs, dim=2)
    mask = chunk_mask(torch.arange(total)[None], total, chunk)[0].to(device)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_bad_chunk_size_names_the_argument_and_writes_nothing(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[3, 4]], device=device)
    before = (k_cache.clone(), v_cache.clone())
    cases = [
        (dict(chunk_size=0), "chunk_size must be None or an int in 1..2147483647"),
        (dict(chunk_size=-4), "chunk_size must be None or an int"),
        (dict(chunk_size=2**31), "chunk_size must be None or an int"),
        (dict(chunk_size=True), "chunk_size must be None or an int"),
        (dict(chunk_size=4.0), "chunk_size must be None or an int"),
        (dict(chunk_size="4"), "chunk_size must be None or an int"),
        (dict(chunk_size=4, window=2), "chunk_size .*cannot be combined with a window"),
        (dict(chunk_size=4, window=2, ring=True), "chunk_size .*cannot be combined with a window"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend, **arguments)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), arguments


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="extension not built")
def test_cpu_kernel_checks_chunk_size_when_called_directly():
    """The C++ op's own checks (shared with the CUDA entry point): chunk_size in 0..2^31 - 1, and not
    with a window (with ring or without); nothing is written when they fail."""
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[3, 4]])
    op = torch.ops.gptfast_kernels.kv_cache_attention
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(RuntimeError, match=r"chunk_size must be in 0..2\^31 - 1 \(0: no chunking\), got -1"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, chunk_size=-1)
    with pytest.raises(RuntimeError, match="chunk_size must be in 0..2"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, chunk_size=2**31)
    with pytest.raises(RuntimeError, match="chunk_size .*cannot be combined with a window"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, window=2, chunk_size=4)
    with pytest.raises(RuntimeError, match="chunk_size .*cannot be combined with a window"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, window=2, ring=True, chunk_size=4)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    # positional, after value_dim, as the schema declares it
    got = op(q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None, False, 0, 4)
    want = masked_attention(q, k, v, *before, positions, 4, scale=0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="extension not built")
def test_opcheck_cpu():
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[0, 1, 2], [4, -1, 5]])
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, v, k_cache, v_cache, positions, 0.25), {"softcap": 5.0, "chunk_size": 2})


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [4, -1, 5]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, 24, rows, device=device)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, v, k_cache, v_cache, positions, 0.25), {"softcap": 5.0, "chunk_size": 4})


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    check_compiled_fullgraph(backend, *make_case(2, 4, 2, 1, 16, 12, [[3], [10]], device=device), chunk_size=4)


GPU_BACKENDS = [p for p in BACKENDS if p.id in ("cuda", "triton-cuda")]


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("B, T, S", [(4, 1, 32768), (4, 5, 32768), (2, 100, 16384)],
                         ids=["decode", "verify", "prefill"])
def test_llama4_heads_with_chunks_long_cache_on_gpu(backend, device, B, T, S):
    """Llama 4 Scout's heads (40 / 8, D = 128) in bf16 with its 8192-token chunks, rows in late chunks,
    at a chunk start and crossing a boundary, so the splits and tiles start mid-cache."""
    chunk = 8192
    starts = [S - T, S // 2 - 2, 3 * chunk, 0][:B]  # S // 2 is a chunk boundary: T >= 3 tokens cross it
    case = make_case(B, 40, 8, T, 128, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=38)
    check_chunked(backend, device, *case, chunk)
