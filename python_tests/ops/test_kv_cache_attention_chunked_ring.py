"""kv_cache_attention with ring-buffer caches of chunked-attention layers (``ring=True`` with
``chunk_size`` C: position p in slot p % S, a query at p sees p - p % C .. p; the cache of a Llama 4
chunked layer kept at C + M - 1 slots): every backend against a float64 attention under an explicit
chunk mask over the ring unrolled into a full-length cache (position p at index p, read from slot
p % S), written independently of the kernels' and the reference's rules; positions far past S,
crossing chunk boundaries, ragged and padded rows, decode / verification / prefill up to the span
contract (a row's positions span at most S - C); a ring equal to a full-length cache over a sequence
that wraps many times, with a rolled-back round; bad spans and arguments named before anything is
written, by the wrapper and the C++ op.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.ops.test_kv_cache_attention import (BACKENDS, DTYPES, ERROR_FLOOR, _contiguous_positions,
                                                      _is_interpreter, check_compiled_fullgraph, make_case)
from python_tests.ops.test_kv_cache_attention_chunked import masked_attention
from python_tests.ops.test_kv_cache_attention_ring import _run_sequence

ALL_BACKENDS = BACKENDS + [pytest.param("reference", "cpu", id="reference")]
HAS_CPU_KERNEL = _extension.has_kernel("kv_cache_attention", "CPU")


def unrolled(cache, positions, S, chunk):
    """One row's ring [1, Hkv, S, D] and positions [1, T] as a full-length cache [1, Hkv, L, D] from the
    row's earliest chunk start on, and the positions shifted to it (by a multiple of the chunk: the same
    chunks): index i holds slot (start + i) % S (its position only where the ring still holds it, which
    is all a query under the span contract sees)."""
    valid = positions[positions >= 0]
    start = int(valid.min()) // chunk * chunk if valid.numel() else 0
    length = int(valid.max()) + 1 - start if valid.numel() else 1
    shifted = torch.where(positions >= 0, positions - start, -1)
    return cache[:, :, (start + torch.arange(length)) % S], shifted


def check_chunked_ring(backend, device, q, k, v, k_cache, v_cache, positions, chunk, scale=None, softcap=None,
                       sinks=None, value_dim=None):
    """Runs ``backend`` with ring=True, chunk_size=chunk; checks the caches against the ring scatter
    (slot p % S) and the output against masked_attention over the unrolled caches in float64 (at most
    twice the error of the same attention in q's dtype, for 16-bit)."""
    S = k_cache.shape[2]
    before = [t.cpu() for t in (q, k, v, k_cache, v_cache)]
    pos = reference.broadcast_positions(positions.cpu(), q.shape[0])
    rows, cols = (pos >= 0).nonzero(as_tuple=True)
    want_k, want_v = before[3].clone(), before[4].clone()
    want_k[rows, :, pos[rows, cols] % S] = before[1][rows, :, cols]
    if not value_dim:
        want_v[rows, :, pos[rows, cols] % S] = before[2][rows, :, cols]
    got = ops.kv_cache_attention(q, k, None if value_dim else v, k_cache, None if value_dim else v_cache, positions,
                                 scale, softcap=softcap, sinks=sinks, value_dim=value_dim, chunk_size=chunk,
                                 ring=True, backend=backend)
    assert got.shape == (*q.shape[:-1], value_dim or q.shape[-1]) and got.dtype == q.dtype and got.device == q.device
    assert torch.equal(k_cache.cpu(), want_k), "k_cache differs from the ring scatter's"
    assert torch.equal(v_cache.cpu(), want_v), "v_cache differs from the ring scatter's"

    def attention(dtype):  # row by row: each row's full view starts at its own earliest chunk
        outs = []
        for b in range(q.shape[0]):
            (full_k, shifted), (full_v, _) = (unrolled(c[b:b + 1].to(dtype), pos[b:b + 1], S, chunk)
                                              for c in (want_k, want_v))
            outs.append(masked_attention(*(t[b:b + 1].to(dtype) for t in before[:3]), full_k, full_v, shifted, chunk,
                                         scale, softcap, None if sinks is None else sinks.cpu().to(dtype), value_dim))
        return torch.cat(outs)

    want = attention(torch.float64)
    error = (got.cpu().double() - want).abs().max().item() if got.numel() else 0.0
    allowed = ERROR_FLOOR[q.dtype]
    if q.dtype != torch.float32:
        allowed = max(2 * (attention(q.dtype).double() - want).abs().max().item(), allowed)
    assert error <= allowed, f"max error {error:.3g} > allowed {allowed:.3g}"
    return got


# (B, Hq, Hkv, T, D, S, starts, chunk): positions many laps past S, rows of one call at different laps
# and chunk offsets; S = C + T - 1 (the tightest ring, the span contract's limit) unless noted, and not
# a multiple of C but in decode-chunk-edges (so that a slot's offset in a chunk is not its position's,
# which a kernel taking chunk starts from slots would show). Decode at chunk starts and ends; a
# 120-position chunk over the splits of a 128-slot ring; verification and prefill rows crossing chunk
# boundaries (prefill: several, wrapping the ring mid-tile); chunks of one.
SHAPES = {
    "decode-gqa": (3, 8, 2, 1, 64, 20, [5, 37, 100], 16),
    "decode-chunk-edges": (4, 4, 2, 1, 32, 16, [32, 47, 63, 1000], 16),  # start, end, end, a late start
    "decode-long-chunk": (1, 4, 2, 1, 32, 128, [1079], 120),  # sees 960..1079
    "verify-k4": (2, 6, 3, 5, 32, 24, [57, 18], 20),  # 57..61 crosses 60, 18..22 crosses 20
    "verify-mqa-g8": (2, 8, 1, 5, 32, 30, [76, 24], 26),
    "verify-slack": (2, 4, 2, 5, 96, 40, [203, 5], 16),  # a ring longer than the contract needs
    "prefill-t37": (2, 4, 4, 37, 64, 46, [0, 60], 10),  # row 1: 60..96 crosses 70, 80, 90
    "prefill-t20-late": (1, 4, 2, 20, 32, 51, [250], 32),  # 250..269 crosses 256
    "prefill-t20-chunk1": (1, 2, 1, 20, 16, 20, [33], 1),  # each query sees itself only
}
INTERPRETER_SHAPES = ("decode-gqa", "decode-chunk-edges", "decode-long-chunk", "verify-mqa-g8", "prefill-t37",
                      "prefill-t20-chunk1")


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_chunked_ring_matches_masked_attention(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and (shape not in INTERPRETER_SHAPES or dtype == torch.float16):
        pytest.skip("Triton interpreter: a subset of shapes keeps the suite fast")
    B, Hq, Hkv, T, D, S, starts, chunk = SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=41)
    check_chunked_ring(backend, device, *case, chunk)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_chunked_ring_with_padding_softcap_and_sinks(backend, device, dtype):
    # left / right padding, an all-padding row, a row at its first lap, rows out of order across a boundary
    positions = [[-1, -1, 40, 41, 42], [7, 8, 9, -1, -1], [-1] * 5, [0, 1, 2, 3, 4], [83, 80, 81, 84, 82]]
    case = make_case(5, 4, 2, 5, 32, 12, positions, dtype, device, seed=42)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    out = check_chunked_ring(backend, device, *case, 8, scale=0.3, softcap=3.0, sinks=sinks)
    assert not out[2].any(), "an all-padding row must give zeros"


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("T, starts, D, value_dim", [(1, [300, 17], 576, 512), (5, [62, 29], 96, 40),
                                                      (20, [70, 14], 64, 64)], ids=["decode-mla", "verify", "prefill"])
def test_chunked_ring_with_values_in_keys(backend, device, T, starts, D, value_dim):
    B, Hq, Hkv, chunk = 2, 4, 1, 8
    S = chunk + T - 1
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=43)
    check_chunked_ring(backend, device, *case, chunk, value_dim=value_dim)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_chunked_ring_equals_full_cache_over_a_sequence(backend, device, dtype):
    """Prompt chunks of 6, a round of 5 whose last two tokens are rejected and rewritten, then decode:
    a ring of chunk + 5 slots wraps several times and crosses many chunk boundaries, and must give
    what a cache holding every position gives (the non-ring chunked kernel), call by call."""
    chunk, step = 7, 6
    S = chunk + step - 1
    steps = [[list(range(0, 6)), list(range(2, 8))],       # prompt chunk 1 (row 1 longer)
             [list(range(6, 12)), list(range(8, 14))],      # prompt chunk 2: row 1 wraps
             [list(range(12, 17)), list(range(14, 19))],    # a round of 5 (4 drafts + 1)
             [list(range(15, 20)), list(range(17, 22))],    # its last two rejected: rewritten from 15 / 17
             ] + [[[p], [p + 2]] for p in range(20, 40)]    # decode, several laps and chunks
    if _is_interpreter(backend, device):
        steps = steps[:6]
    ring = _run_sequence(backend, device, dtype, S, None, True, steps, chunk_size=chunk)
    full = _run_sequence(backend, device, dtype, 64, None, False, steps, chunk_size=chunk)
    for i, (got, want) in enumerate(zip(ring, full)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   msg=f"call {i}: ring and full cache differ")


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=9), "needs a window or a chunk_size in 1..S = 1..8"),  # a chunk the ring cannot hold
    (dict(chunk_size=4, window=3), "chunk_size .*cannot be combined with a window"),
    (dict(), "needs a window or a chunk_size"),
], ids=["chunk-longer-than-ring", "with-window", "neither"])
def test_bad_chunked_ring_arguments_are_named(backend, device, kwargs, match):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[20, 21]], device=device)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=match):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, ring=True, backend=backend, **kwargs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote"


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("positions, match", [
    ([[10, 14]], "span at most S - chunk_size = 3"),  # 14 - 10 + 5 > 8: 14 would overwrite 6, the chunk of 10
    ([[-1, 13, 9, -1]], "got a span of 4"),           # the span of the valid positions, in any order
    ([[2**31 - 1, 3]], "positions"),                   # past the kernels' int32 positions
    ([[7, 7]], "repeat"),
], ids=["span", "span-padded-unordered", "int32", "repeated"])
def test_bad_chunked_ring_positions_raise_before_writing(backend, device, positions, match):
    T = len(positions[0])
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, T, 16, 8, positions, device=device)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=match):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, chunk_size=5, ring=True, backend=backend)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote"


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_span_contract_limit_is_accepted(backend, device):
    """A row spanning exactly S - C: every query still finds its chunk (its writes land on slots of
    positions before the chunk of its earliest query)."""
    case = make_case(1, 2, 1, 4, 16, 8, [[13, 14, 15, 16]], device=device, seed=44)
    check_chunked_ring(backend, device, *case, 5)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="extension not built")
def test_cpu_entry_checks_chunked_ring_itself():
    """The registered op, called directly, refuses what the Python wrapper refuses (its own C++ checks,
    shared with the CUDA entry point but for the span, which the CUDA op cannot read), and writes nothing."""
    op = torch.ops.gptfast_kernels.kv_cache_attention
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[10, 14]])
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(RuntimeError, match="span at most S - chunk_size = 3"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None, True, 0, 5)
    with pytest.raises(RuntimeError, match="needs a window or a chunk_size in 1..S"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None, True, 0, 9)
    with pytest.raises(RuntimeError, match="chunk_size .*cannot be combined with a window"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 3, 0.0, None, True, 0, 4)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    torch.library.opcheck(op.default, (q, k, v, k_cache, v_cache, torch.tensor([[12, 13]]), 0.25, 0, 0.0, None,
                                       True, 0, 5))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    case = make_case(2, 4, 2, 1, 16, 6, [[13], [40]], device=device)
    check_compiled_fullgraph(backend, *case, chunk_size=4, ring=True)


GPU_BACKENDS = [p for p in BACKENDS if p.id in ("cuda", "triton-cuda")]


@pytest.mark.parametrize("backend, device", GPU_BACKENDS)
@pytest.mark.parametrize("B, T", [(4, 1), (4, 5), (2, 100)], ids=["decode", "verify", "prefill"])
def test_llama4_heads_with_chunked_ring_on_gpu(backend, device, B, T):
    """Llama 4 Scout's heads (40 / 8, D = 128) in bf16 with its 8192-token chunks in a ring of
    8192 + 2047 slots (generation's prefill chunk), rows many laps in, at a chunk start, at a chunk's
    end and crossing a boundary, so the splits and tiles start mid-ring and wrap."""
    chunk = 8192
    S = chunk + 2047
    starts = [5 * chunk - T // 2, 7 * chunk, 3 * chunk - T, 130_000][:B]
    case = make_case(B, 40, 8, T, 128, S, _contiguous_positions(B, T, starts), torch.bfloat16, device, seed=45)
    check_chunked_ring(backend, device, *case, chunk)
