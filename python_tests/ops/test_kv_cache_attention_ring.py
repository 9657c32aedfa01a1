"""kv_cache_attention with ring-buffer caches (``ring=True``: position p in slot p % S, the cache of a
sliding-window layer kept at window + C - 1 slots): every backend against the float64 reference, a
ring equal to a full-length cache over a whole sequence written call by call (wrapping many times,
with a rolled-back speculative round), and bad arguments named before anything is written.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from python_tests.ops.test_kv_cache_attention import (BACKENDS, DTYPES, _contiguous_positions, _is_interpreter,
                                                      check_against_reference, make_case)

# (B, Hq, Hkv, T, D, S, starts, window): positions far past S, so every read wraps; rows of one call
# at different laps of the ring; the decode window of 120 spans the splits of a 128-slot ring; the
# prefill chunk of 37 (S = window + T - 1, the tightest ring) crosses the end of the ring mid-tile.
RING_SHAPES = {
    "decode-gqa": (3, 8, 2, 1, 64, 20, [5, 37, 100], 16),
    "decode-long-window": (1, 4, 2, 1, 32, 128, [1000], 120),
    "verify-k4": (2, 6, 3, 5, 32, 24, [50, 3], 20),
    "verify-mqa-g8": (2, 8, 1, 5, 32, 30, [61, 7], 26),
    "prefill-t37": (2, 4, 4, 37, 64, 45, [0, 60], 9),
    "prefill-t20-window1": (1, 2, 1, 20, 16, 20, [33], 1),
}
INTERPRETER_SHAPES = ("decode-gqa", "decode-long-window", "verify-mqa-g8", "prefill-t37")


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("shape", list(RING_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_ring_matches_reference(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and (shape not in INTERPRETER_SHAPES or dtype == torch.float16):
        pytest.skip("Triton interpreter: a subset of shapes keeps the suite fast")
    B, Hq, Hkv, T, D, S, starts, window = RING_SHAPES[shape]
    case = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype, device, seed=11)
    check_against_reference(backend, device, *case, window=window, ring=True)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_ring_with_padding_softcap_and_sinks(backend, device):
    # left / right padding, an all-padding row, a row at its first lap and one far past it
    positions = [[-1, -1, 40, 41, 42], [7, 8, 9, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]]
    case = make_case(4, 4, 2, 5, 32, 12, positions, device=device, seed=12)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    out = check_against_reference(backend, device, *case, window=8, softcap=3.0, sinks=sinks, ring=True)
    assert not out[2].any(), "an all-padding row must give zeros"


def _run_sequence(backend, device, dtype, S, window, ring, steps, seed=13, chunk_size=None):
    """Writes one token sequence through ``steps`` calls (each a [B, T] positions list), into a cache of S
    slots; returns every call's output. The k / v / q of position p are the same whatever the cache."""
    B, Hq, Hkv, D = 2, 4, 2, 16
    g = torch.Generator().manual_seed(seed)
    total = 1 + max(max(max(row) for row in positions) for positions in steps)
    # per position, a fresh draw for each time it is written (a rolled-back draft is rewritten with other values)
    draws = [torch.randn(3, B, Hkv * 2 + Hq, total, D, generator=g).to(dtype) for _ in range(2)]
    written = torch.zeros(B, total, dtype=torch.int64)
    k_cache = torch.zeros(B, Hkv, S, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    outputs = []
    for positions in steps:
        pos = torch.tensor(positions)
        T = pos.shape[1]
        q, k, v = (torch.empty(B, h, T, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
        for b in range(B):
            for t in range(T):
                p = int(pos[b, t])
                if p < 0:
                    continue
                draw = draws[min(int(written[b, p]), 1)][0, b, :, p]
                q[b, :, t], k[b, :, t], v[b, :, t] = draw[:Hq], draw[Hq:Hq + Hkv], draw[Hq + Hkv:]
                written[b, p] += 1
        outputs.append(ops.kv_cache_attention(q.to(device), k.to(device), v.to(device), k_cache, v_cache,
                                              pos.to(device), window=window, ring=ring, chunk_size=chunk_size,
                                              backend=backend))
    return outputs


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_ring_equals_full_cache_over_a_sequence(backend, device, dtype):
    """A prompt in two chunks, a speculative round whose last two drafts are rejected and rewritten,
    then decode steps: a ring of window + 5 slots (the longest call writes 6 tokens) wraps several
    times and must give what a cache holding every position gives, call by call."""
    window, chunk = 7, 6
    S = window + chunk - 1
    steps = [[list(range(0, 6)), list(range(2, 8))],       # prompt chunk 1 (row 1 longer)
             [list(range(6, 12)), list(range(8, 14))],      # prompt chunk 2: both rows have wrapped
             [list(range(12, 17)), list(range(14, 19))],    # a round of 5 (4 drafts + 1)
             [list(range(15, 20)), list(range(17, 22))],    # its last two rejected: rewritten from 15 / 17
             ] + [[[p], [p + 2]] for p in range(20, 40)]    # decode, several laps
    if _is_interpreter(backend, device):
        steps = steps[:6]
    ring = _run_sequence(backend, device, dtype, S, window, True, steps)
    full = _run_sequence(backend, device, dtype, 64, window, False, steps)
    for i, (got, want) in enumerate(zip(ring, full)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   msg=f"call {i}: ring and full cache differ")


RING_BAD = {
    "no-window": (dict(window=None), "ring"),
    "window-longer-than-ring": (dict(window=9), "ring"),
    "not-bool": (dict(window=4, ring=1), "ring"),
}


@pytest.mark.parametrize("backend, device", [*BACKENDS, pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("bad", list(RING_BAD))
def test_bad_ring_arguments_are_named(backend, device, bad):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[20, 21]], device=device)
    kwargs, name = RING_BAD[bad]
    kwargs = {"ring": True, **kwargs}
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=name):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend, **kwargs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote"


@pytest.mark.parametrize("backend, device", [*BACKENDS, pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("positions, match", [
    ([[10, 14]], "span"),                 # 14 - 10 + window 5 > S = 8: 14 would overwrite 6, which 10 reads
    ([[2**31 - 1, 3]], "positions"),      # past the kernels' int32 positions
    ([[-2, 3]], "positions"),
    ([[5, 5]], "repeat"),
], ids=["span", "int32", "negative", "repeated"])
def test_bad_ring_positions_raise_before_writing(backend, device, positions, match):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, positions, device=device)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=match):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, window=5, ring=True, backend=backend)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a refused call wrote"


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_cpu_entry_checks_ring_itself():
    """The registered op, called directly, refuses what the Python wrapper refuses (its own C++ checks)."""
    op = torch.ops.gptfast_kernels.kv_cache_attention
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[10, 14]])
    with pytest.raises(RuntimeError, match="span"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 5, 0.0, None, True)
    with pytest.raises(RuntimeError, match="ring"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None, True)
    with pytest.raises(RuntimeError, match="ring"):
        op(q, k, v, k_cache, v_cache, positions, 0.25, 9, 0.0, None, True)
    torch.library.opcheck(op.default, (q, k, v, k_cache, v_cache, torch.tensor([[10, 11]]), 0.25, 5, 0.0, None,
                                       True))
