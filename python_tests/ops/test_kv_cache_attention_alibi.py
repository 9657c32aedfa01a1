"""kv_cache_attention with ALiBi (``alibi_slopes``: BLOOM, MPT, Falcon-RW): every backend against the
float64 reference (the tolerance rule of test_kv_cache_attention.py), alone and with a window, a
soft cap, sinks, a ring buffer or chunks; the reference itself against PyTorch's SDPA with the bias
written out; zero slopes change no bit; slots no query sees are never read; bad slopes name the
argument; opcheck and torch.compile.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.ops.test_kv_cache_attention import (BACKENDS, DTYPES, TRITON_BACKENDS, _contiguous_positions,
                                                      _is_interpreter, check_against_reference,
                                                      check_compiled_fullgraph, check_unseen_slots_are_never_read,
                                                      make_case)
from python_tests.ops.test_kv_cache_attention_window import WINDOW_SHAPES, _sinks, check_window_shape

HAS_CPU_KERNEL = _extension.has_kernel("kv_cache_attention", "CPU")


def _slopes(Hq, device, seed=21):
    """BLOOM's geometric slopes 2^(-8 i / Hq) for heads i = 1 .. Hq, shuffled so that every head of a
    group gets a different one (a kernel reading the kv head's or the wrong query head's slope fails),
    and scaled up 4x so that the bias, not the dot products, decides most of each softmax."""
    slopes = 4 * 2.0 ** (-8 * torch.arange(1, Hq + 1) / Hq)
    return slopes[torch.randperm(Hq, generator=torch.Generator().manual_seed(seed))].to(device)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("shape", list(WINDOW_SHAPES))
@pytest.mark.parametrize("window", [None, "shape"], ids=["no-window", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_alibi_matches_reference(backend, device, shape, window, dtype):
    """Decode (one split and several: decode-long-cache), verification and prefill; GQA / MQA / MHA."""
    if _is_interpreter(backend, device) and (dtype == torch.float16 or shape == "verify-k4-d96"):
        pytest.skip("Triton interpreter: bfloat16 covers the 16-bit path, a subset of shapes keeps it fast")
    check_window_shape(backend, device, shape, dtype, 22, bool(window), alibi_slopes=_slopes)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T", [1, 5, 20], ids=["decode", "verify", "prefill"])
def test_alibi_with_softcap_and_sinks(backend, device, T):
    """The bias is added after the cap, and the sink's logit gets none."""
    case = make_case(2, 4, 2, T, 32, 40, _contiguous_positions(2, T, [3, 40 - T]), torch.bfloat16, device, seed=23)
    check_against_reference(backend, device, *case, scale=1.0, softcap=3.0, sinks=_sinks(4, device),
                            alibi_slopes=_slopes(4, device))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_alibi_with_ragged_rows_and_padding(backend, device):
    """Left / right padding, an all-padding row and shuffled positions: each query's bias is
    measured from its own position."""
    positions = [[-1, -1, 4, 5, 6], [20, 21, 22, -1, -1], [-1, -1, -1, -1, -1], [9, 3, 30, 0, 12]]
    case = make_case(4, 4, 2, 5, 32, 31, positions, device=device, seed=24)
    out = check_against_reference(backend, device, *case, alibi_slopes=_slopes(4, device))
    assert torch.all(out[2] == 0) and torch.all(out[0, :, :2] == 0) and torch.all(out[1, :, 3:] == 0)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [70, 150]), (5, [70, 150]), (20, [60, 140])],
                         ids=["decode", "verify", "prefill"])
def test_alibi_on_a_ring_buffer(backend, device, T, starts):
    """A ring buffer's slots hold positions past S: the bias comes from positions, not slots; with
    sinks (whose logit gets no bias) the query's own position counts, not only the keys'."""
    if _is_interpreter(backend, device) and T == 20:
        pytest.skip("Triton interpreter: decode and verify cover the ring's split kernel")
    case = make_case(2, 4, 2, T, 32, 32, _contiguous_positions(2, T, starts), device=device, seed=25)
    check_against_reference(backend, device, *case, window=8, ring=True, alibi_slopes=_slopes(4, device))
    check_against_reference(backend, device, *case, window=8, ring=True, sinks=_sinks(4, device),
                            alibi_slopes=_slopes(4, device))


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [37, 70]), (20, [30, 5])], ids=["decode", "prefill"])
def test_alibi_with_chunked_attention(backend, device, T, starts):
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 32, 96, _contiguous_positions(2, T, starts),
                                                     device=device, seed=26)
    slopes = _slopes(4, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference.kv_cache_attention(q.cpu(), k.cpu(), v.cpu(), want_k.cpu(), want_v.cpu(), positions.cpu(),
                                        chunk_size=16, alibi_slopes=slopes.cpu())
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, chunk_size=16, alibi_slopes=slopes,
                                 backend=backend)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T, starts", [(1, [250, 90]), (20, [200, 90])], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_alibi_never_reads_slots_before_the_window(backend, device, T, starts):
    if _is_interpreter(backend, device) and T == 20:
        pytest.skip("Triton interpreter: decode covers the split kernel")
    window = 16
    check_unseen_slots_are_never_read(backend, device, T, starts, lambda start: start - window + 1, seed=27,
                                      window=window, alibi_slopes=_slopes(4, device))


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
def test_alibi_equals_sdpa_with_the_bias_written_out(backend, device):
    """The semantics, independently of the reference: a prompt of T tokens from position 0 equals
    SDPA over the same keys with the float mask slope_h * (j - i) on j <= i (-inf above); BLOOM's
    form slope_h * j (the same up to a per-query constant, which the softmax drops) too."""
    B, Hq, Hkv, T, D = 2, 4, 2, 12, 16
    q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, T, D, T, _contiguous_positions(B, T, [0, 0]),
                                                     device=device, seed=28)
    slopes = _slopes(Hq, device)
    got = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, alibi_slopes=slopes, backend=backend)
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    keys, values = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    for distance in (j - i, j.expand(T, T)):  # relative, and BLOOM's absolute key positions
        bias = slopes[:, None, None] * distance.to(torch.float32)
        bias = bias.masked_fill(j > i, float("-inf"))
        want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend, device", BACKENDS + [pytest.param("reference", "cpu", id="reference")])
@pytest.mark.parametrize("T", [1, 20], ids=["decode", "prefill"])
def test_zero_slopes_change_no_bit(backend, device, T):
    case = make_case(2, 4, 2, T, 32, 40, _contiguous_positions(2, T, [3, 40 - T]), torch.bfloat16, device, seed=29)
    q, k, v, k_cache, v_cache, positions = case
    without = ops.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, backend=backend)
    with_zeros = ops.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions,
                                        alibi_slopes=torch.zeros(4, device=device), backend=backend)
    assert torch.equal(without, with_zeros)
    # and the slopes do change it (the comparison above can fail)
    with_slopes = ops.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions,
                                         alibi_slopes=_slopes(4, device), backend=backend)
    assert not torch.equal(without, with_slopes)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["float16", "float64"])
def test_slopes_of_other_dtypes_are_taken_as_float32(backend, device, dtype):
    case = make_case(2, 4, 2, 5, 32, 31, [[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]], device=device, seed=30)
    check_against_reference(backend, device, *case, alibi_slopes=_slopes(4, device).to(dtype))


@pytest.mark.parametrize("slopes, needle", [
    (torch.zeros(3), r"alibi_slopes must have one slope per query head, \[Hq\] = \[2\]"),
    (torch.zeros(2, 1), "alibi_slopes must have 1 dimension,"),
    (torch.zeros(2, dtype=torch.int32), "alibi_slopes must have dtype"),
    (torch.zeros(2, device="meta"), "alibi_slopes is on meta"),
], ids=["length", "ndim", "dtype", "device"])
def test_bad_alibi_slopes_name_the_argument(slopes, needle):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    before = k_cache.clone()
    with pytest.raises(ValueError, match=needle):
        ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, alibi_slopes=slopes)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="extension not built")
@pytest.mark.parametrize("slopes, needle", [
    (torch.zeros(2, dtype=torch.float64), "alibi_slopes must be float32"),
    (torch.zeros(3), r"alibi_slopes must be contiguous \[Hq\] = \[2\]"),
    (torch.zeros(4)[::2], r"alibi_slopes must be contiguous \[Hq\] = \[2\]"),
], ids=["dtype", "length", "strided"])
def test_cpu_kernel_refuses_bad_slopes_when_called_directly(slopes, needle):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 8, [[3]])
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match=needle):
        torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None,
                                                     False, 0, 0, slopes)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="extension not built")
def test_opcheck_cpu_with_alibi():
    q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, 3, 16, 8, [[0, 1, 2], [4, -1, 5]])
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, v, k_cache, v_cache, positions, 0.25, 2, 0.0, None, False, 0, 0, _slopes(4, "cpu")))


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_opcheck_triton_with_alibi(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [4, -1, 5]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, v, k_cache, v_cache, positions = make_case(2, 4, 2, T, 16, 24, rows, device=device)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, v, k_cache, v_cache, positions, 0.25, 0, 0.0, None, False, 0, 0,
                               _slopes(4, device)))


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph_with_alibi(backend, device):
    case = make_case(2, 4, 2, 1, 16, 12, [[3], [10]], device=device)
    check_compiled_fullgraph(backend, *case, window=4, alibi_slopes=_slopes(4, device))
