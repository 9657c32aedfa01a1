"""kv_cache_attention with ``value_dim`` (values in the keys, multi-head latent attention's cache):
each backend against the float64 reference of the ordinary op run with v = k and a value cache
that is a copy of the key cache, its output cut to the first value_dim numbers. The key cache must
be written exactly as by the ordinary op; nothing else exists to be written. Bad value_dim / v /
v_cache arguments raise errors naming them, with the cache untouched; opcheck and torch.compile.
"""

import pytest
import torch

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends
from python_tests.ops.test_kv_cache_attention import (DTYPES, ERROR_FLOOR, _attention_in_dtype, _contiguous_positions,
                                                      _is_interpreter, check_compiled_fullgraph, make_case)

BACKENDS = kernel_backends("kv_cache_attention")
ALL_BACKENDS = BACKENDS + [pytest.param("reference", "cpu", id="reference")]


def check_values_in_keys(backend, device, q, k, k_cache, positions, value_dim, **options):
    """Runs ``backend`` with values in the keys; checks k_cache and the output against the reference."""
    q64, k64, cache64 = (t.cpu().double() for t in (q, k, k_cache))
    sinks = options.get("sinks")
    options64 = dict(options, sinks=None if sinks is None else sinks.cpu().double())
    want = reference.kv_cache_attention(q64, k64, k64, cache64, cache64.clone(), positions.cpu(),
                                        **options64)[..., :value_dim]
    got = ops.kv_cache_attention(q, k, None, k_cache, None, positions, value_dim=value_dim, backend=backend,
                                 **options)
    assert got.shape == (*q.shape[:-1], value_dim) and got.dtype == q.dtype and got.device == q.device
    assert got.is_contiguous()
    assert torch.equal(k_cache.cpu().double(), cache64), "k_cache differs from the reference's"
    error = (got.cpu().double() - want).abs().max().item() if got.numel() else 0.0
    allowed = ERROR_FLOOR[q.dtype]
    if q.dtype != torch.float32:  # twice the error of the same attention computed in q's dtype
        cpu = [t.cpu() for t in (q, k)]
        cache = k_cache.cpu()  # (written already: the baseline writes the same values again)
        baseline = _attention_in_dtype(*cpu, cpu[1], cache.clone(), cache.clone(), positions.cpu(),
                                       options.get("scale"), options.get("window"), options.get("softcap"),
                                       None if sinks is None else sinks.cpu(), options.get("ring", False))
        allowed = max(2 * (baseline[..., :value_dim].double() - want).abs().max().item(), allowed)
    assert error <= allowed, f"max error {error:.3g} > allowed {allowed:.3g}"
    return got


# (B, Hq, Hkv, T, D, value_dim, S, starts): MLA's geometry (one kv head, D = 576 = 512 + 64, values
# the 512-wide latent), an odd split, a value dim equal to D and of 1, GQA; decode, verification and
# prefill (the kernels' prefill paths start at T = 17)
SHAPES = {
    "decode-mla-576-512": (2, 16, 1, 1, 576, 512, 20, [0, 19]),
    "verify-k4-mla-576-512": (2, 4, 1, 5, 576, 512, 24, [19, 3]),
    "prefill-t20-mla-576-512": (1, 8, 1, 20, 576, 512, 24, [2]),
    "decode-gqa-96-40": (3, 8, 2, 1, 96, 40, 50, [0, 17, 49]),
    "verify-k4-mqa-64-64": (2, 4, 1, 5, 64, 64, 40, [10, 0]),
    "prefill-t37-mha-64-1": (2, 4, 4, 37, 64, 1, 48, [0, 11]),
    "decode-long-cache-32-16": (1, 4, 2, 1, 32, 16, 300, [290]),
}
INTERPRETER_DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_matches_reference(backend, device, shape, dtype):
    if _is_interpreter(backend, device) and dtype not in INTERPRETER_DTYPES:
        pytest.skip("Triton interpreter: bfloat16 covers the 16-bit path")
    B, Hq, Hkv, T, D, value_dim, S, starts = SHAPES[shape]
    q, k, _, k_cache, _, positions = make_case(B, Hq, Hkv, T, D, S, _contiguous_positions(B, T, starts), dtype,
                                               device, seed=21)
    check_values_in_keys(backend, device, q, k, k_cache, positions, value_dim)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
@pytest.mark.parametrize("T, starts", [(1, [30, 5]), (5, [12, 40]), (20, [3, 40])],
                         ids=["decode", "verify", "prefill"])
def test_with_window_softcap_sinks_ring_and_padding(backend, device, T, starts):
    """Every scoring option at once on a ring cache whose reads wrap, with a padded query per row."""
    B, Hq, Hkv, D, value_dim, S, window = 2, 4, 1, 576, 512, 24, 5
    positions = _contiguous_positions(B, T, starts)
    positions[0, 0] = -1
    positions[1, -1] = -1
    q, k, _, k_cache, _, positions = make_case(B, Hq, Hkv, T, D, S, positions, torch.bfloat16, device, seed=23)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    got = check_values_in_keys(backend, device, q, k, k_cache, positions, value_dim, window=window, softcap=2.0,
                               sinks=sinks, ring=True)
    assert not got[0, :, 0].any() and not got[1, :, -1].any()  # padding queries: zero output


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_scale_and_shuffled_positions(backend, device):
    """An explicit scale and positions out of order (a row's tokens need not be consecutive)."""
    positions = torch.tensor([[7, 2, 9], [0, 5, 3]])
    q, k, _, k_cache, _, positions = make_case(2, 4, 2, 3, 48, 12, positions, device=device, seed=25)
    check_values_in_keys(backend, device, q, k, k_cache, positions, 32, scale=0.3)


@pytest.mark.parametrize("backend, device", ALL_BACKENDS)
def test_bad_arguments_name_themselves_and_write_nothing(backend, device):
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 2, 16, 8, [[3, 4]], device=device)
    before = k_cache.clone()
    cases = [
        (dict(v=v, v_cache=None, value_dim=8), "v must be None"),
        (dict(v=None, v_cache=v_cache, value_dim=8), "v_cache must be None"),
        (dict(v=None, v_cache=None, value_dim=0), "value_dim must be None or an int in 1..D = 1..16"),
        (dict(v=None, v_cache=None, value_dim=17), "value_dim must be None or an int in 1..D = 1..16"),
        (dict(v=None, v_cache=None, value_dim=True), "value_dim must be None or an int"),
        (dict(v=None, v_cache=None, value_dim=8.0), "value_dim must be None or an int"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.kv_cache_attention(q, k, arguments["v"], k_cache, arguments["v_cache"], positions,
                                   value_dim=arguments["value_dim"], backend=backend)
        assert torch.equal(k_cache, before), arguments
    with pytest.raises(ValueError, match="positions must lie in"):  # position checks hold in this mode too
        ops.kv_cache_attention(q, k, None, k_cache, None, torch.tensor([[3, 8]], device=device), value_dim=8,
                               backend=backend)
    assert torch.equal(k_cache, before)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_cpu_kernel_checks_when_called_directly():
    """The C++ op's own checks: v and v_cache must be empty with value_dim > 0, value_dim in 0..D."""
    q, k, v, k_cache, v_cache, positions = make_case(1, 2, 1, 1, 16, 4, [[2]])
    op = torch.ops.gptfast_kernels.kv_cache_attention
    empty = q.new_empty(0)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="v and v_cache must be empty"):
        op(q, k, v, k_cache, empty, positions, 0.25, value_dim=8)
    with pytest.raises(RuntimeError, match="value_dim must be 0"):
        op(q, k, empty, k_cache, empty, positions, 0.25, value_dim=17)
    with pytest.raises(RuntimeError, match="value_dim must be 0"):
        op(q, k, empty, k_cache, empty, positions, 0.25, value_dim=-1)
    assert torch.equal(k_cache, before)
    out = op(q, k, empty, k_cache, empty, positions, 0.25, value_dim=8)
    assert out.shape == (1, 2, 1, 8)


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_opcheck_cpu():
    q, k, _, k_cache, _, positions = make_case(2, 4, 1, 3, 40, 10, [[0, 1, 2], [5, 6, -1]])
    empty = q.new_empty(0)
    torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention.default,
                          (q, k, empty, k_cache, empty, positions, 0.2),
                          {"value_dim": 24})


@pytest.mark.parametrize("backend, device", [p for p in BACKENDS if p.id.startswith("triton")])
def test_opcheck_triton(backend, device):
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton  # noqa: F401

    for T, rows in ((3, [[0, 1, 2], [5, 6, -1]]), (17, [list(range(17)), [-1] * 2 + list(range(5, 20))])):
        q, k, _, k_cache, _, positions = make_case(2, 4, 1, T, 40, 24, rows, device=device)
        empty = q.new_empty(0)
        torch.library.opcheck(torch.ops.gptfast_kernels.kv_cache_attention_triton.default,
                              (q, k, empty, k_cache, empty, positions, 0.2), {"value_dim": 24})


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_torch_compile_fullgraph(backend, device):
    q, k, _, k_cache, _, positions = make_case(2, 8, 1, 1, 72, 16, [[4], [9]], device=device, seed=27)
    check_compiled_fullgraph(backend, q, k, None, k_cache, None, positions, value_dim=64)
