"""The Triton decode kernel's fused combine (Tuning.fused_combine): the last split program of each
(row, kv head, query-row block) reduces the splits' partial outputs itself, counted with an atomic,
instead of a second kernel. Every scoring feature against the float64 reference, with the combine
kernel shown not to run; a kept workspace of counts left at zero for the next call; bad workspaces
refused; on a GPU, CUDA-graph replays at Llama-3-8B heads."""

import pytest
import torch

from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends
from python_tests.ops.test_kv_cache_attention import _contiguous_positions, make_case

TRITON_BACKENDS = [p for p in kernel_backends("kv_cache_attention") if p.id.startswith("triton")]


def _kv():
    from gptfast_kernels.triton import kv_cache_attention as kv

    return kv


def _tuning(device, head_dim, fused):
    kv = _kv()
    tune, num_sms = kv._tuning(torch.device(device), head_dim)
    return tune._replace(fused_combine=fused), num_sms


class _CombineLaunches:
    """Counts the launches of the combine kernel (patched into the wrapper's module)."""

    def __init__(self, monkeypatch):
        kv = _kv()
        self.count = 0
        kernel = kv._kv_cache_attention_combine_kernel

        class Counting:
            def __getitem__(_, grid):
                self.count += 1
                return kernel[grid]

        monkeypatch.setattr(kv, "_kv_cache_attention_combine_kernel", Counting())


# name -> (B, Hq, Hkv, T, D, S, starts, op keywords); each row spans several splits of the tuning
FEATURES = {
    "gqa-decode-padding-row": (3, 8, 2, 1, 32, 300, [290, 57, -1], {}),
    "verify-ragged": (2, 8, 2, 5, 32, 200, [150, 3], {}),
    "mqa-many-rows": (1, 16, 1, 5, 32, 160, [120], {}),  # 80 query rows: several row blocks and steps
    "sinks-softcap": (2, 4, 2, 1, 32, 200, [190, 60], {"softcap": 5.0, "sinks": True}),
    "window-ring": (2, 4, 2, 1, 32, 96, [400, 130], {"window": 80, "ring": True}),
    "chunked": (2, 4, 2, 5, 32, 300, [250, 70], {"chunk_size": 128}),
    "alibi": (2, 4, 4, 1, 32, 200, [180, 40], {"alibi": True}),
    "values-in-keys-d576": (1, 4, 1, 1, 576, 96, [90], {"value_dim": 512}),
    "values-in-keys-d576-dv544": (1, 2, 1, 1, 576, 96, [90], {"value_dim": 544}),  # values reach the tail
    "d544-separate-values": (1, 2, 1, 1, 544, 96, [90], {}),
}


def _case(device, B, Hq, Hkv, T, D, S, starts, options, seed=0):
    positions = torch.stack([torch.arange(s, s + T) if s >= 0 else torch.full((T,), -1) for s in starts])
    q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, T, D, S, positions, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = {name: options[name] for name in ("window", "softcap", "ring", "value_dim", "chunk_size")
              if name in options}
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(Hq, generator=g).to(device)
    if options.get("alibi"):
        kwargs["alibi_slopes"] = (torch.rand(Hq, generator=g) * 0.1).to(device)
    if "value_dim" in kwargs:
        v = v_cache = torch.empty(0, device=device)
    return (q, k, v, k_cache, v_cache, positions), kwargs


def _reference(inputs, kwargs):
    q, k, v, k_cache, v_cache, positions = (t.cpu().double() if t.is_floating_point() else t.cpu() for t in inputs)
    ref_kwargs = {name: (value.cpu().double() if isinstance(value, torch.Tensor) else value)
                  for name, value in kwargs.items()}
    out = reference.kv_cache_attention(q, k, v, k_cache, v_cache, positions, inputs[0].shape[-1] ** -0.5,
                                       **ref_kwargs)
    return out, k_cache


def _run(inputs, kwargs, tune, num_sms, counts=None):
    q, k, v, k_cache, v_cache, positions = inputs
    return _kv().kv_cache_attention_tuned(q, k, v, k_cache, v_cache, positions, q.shape[-1] ** -0.5, tune,
                                          num_sms, counts=counts, **kwargs)


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
@pytest.mark.parametrize("name", list(FEATURES))
def test_fused_combine_matches_reference(backend, device, name, monkeypatch):
    B, Hq, Hkv, T, D, S, starts, options = FEATURES[name]
    inputs, kwargs = _case(device, B, Hq, Hkv, T, D, S, starts, options)
    want, want_k_cache = _reference(inputs, kwargs)
    for fused in (False, True):
        launches = _CombineLaunches(monkeypatch)
        run_inputs = [t.clone() for t in inputs]
        got = _run(run_inputs, kwargs, *_tuning(device, D, fused))
        # the rows split (the combine kernel runs without the fused combine), and fused, it does not
        assert launches.count == (0 if fused else 1), (fused, launches.count)
        assert torch.equal(run_inputs[3].cpu().double(), want_k_cache), "k_cache differs from the reference"
        error = (got.cpu().double() - want).abs().max().item()
        assert error <= 2e-5, f"fused={fused}: max error {error:.3g}"


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_kept_counts_are_left_at_zero_for_the_next_call(backend, device):
    """A workspace of counts kept across calls (as a CUDA graph keeps its buffers): each call's last
    programs set their counts back to zero, so the next call, with other positions and other rows
    empty, combines at the right program."""
    B, Hq, Hkv, T, D, S = 2, 8, 2, 1, 32, 300
    tune, num_sms = _tuning(device, D, True)
    counts = torch.zeros(64, dtype=torch.int32, device=device)
    for step, starts in enumerate(([290, 57], [-1, 299], [17, 200], [31, -1])):
        inputs, kwargs = _case(device, B, Hq, Hkv, T, D, S, starts, {}, seed=step)
        want, _ = _reference(inputs, kwargs)
        got = _run(inputs, kwargs, tune, num_sms, counts)
        assert (got.cpu().double() - want).abs().max().item() <= 2e-5, starts
        assert not counts.any(), f"counts left at {counts.tolist()} after positions {starts}"


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
@pytest.mark.parametrize("counts, match", [
    (lambda device: torch.zeros(64, dtype=torch.int64, device=device), "counts must be contiguous int32"),
    (lambda device: torch.zeros(3, dtype=torch.int32, device=device), "at least 4 entries"),
    (lambda device: torch.zeros(64, dtype=torch.int32, device=device)[::2], r"strides \(2,\)"),
], ids=["int64", "too-few", "strided"])
def test_bad_counts_are_refused(backend, device, counts, match):
    inputs, kwargs = _case(device, 2, 8, 2, 1, 32, 300, [290, 57], {})
    with pytest.raises(ValueError, match=match):
        _run(inputs, kwargs, *_tuning(device, 32, True), counts(device))


@pytest.mark.parametrize("T", [1, 5], ids=["decode", "verify"])
@pytest.mark.parametrize("kept_counts", [False, True], ids=["counts-per-call", "kept-counts"])
def test_fused_combine_in_cuda_graphs(T, kept_counts):
    """Llama-3-8B heads (32 / 8, D = 128, bf16) at B = 1 and 8 over 8k-slot caches, captured in a
    CUDA graph with the GPU tuning's splits and replayed at new positions: every replay matches
    the two-kernel combine run eagerly on the same inputs, and a kept workspace stays zero."""
    if not torch.cuda.is_available():
        pytest.skip("requires CUDA")
    for B in (1, 8):
        S = 8192
        q, k, v, k_cache, v_cache, positions = make_case(B, 32, 8, T, 128, S,
                                                         _contiguous_positions(B, T, [100] * B), torch.bfloat16,
                                                         "cuda")
        tune, num_sms = _tuning("cuda", 128, True)
        counts = torch.zeros(B * 8 * 4, dtype=torch.int32, device="cuda") if kept_counts else None
        inputs = (q, k, v, k_cache, v_cache, positions)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _run(inputs, {}, tune, num_sms, counts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run(inputs, {}, tune, num_sms, counts)
        for step, start in enumerate((4096, 8192 - T, 17)):
            new = make_case(B, 32, 8, T, 128, S, _contiguous_positions(B, T, [start - b for b in range(B)]),
                            torch.bfloat16, "cuda", seed=20 + step)
            unfused_caches = (k_cache.clone(), v_cache.clone())
            want = _run((*new[:3], *unfused_caches, new[5]), {}, *_tuning("cuda", 128, False))
            for buffer, value in zip((q, k, v, positions), (new[0], new[1], new[2], new[5])):
                buffer.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(k_cache, unfused_caches[0]) and torch.equal(v_cache, unfused_caches[1])
            torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
            if kept_counts:
                assert not counts.any(), counts.tolist()


@pytest.mark.parametrize("backend, device", TRITON_BACKENDS)
def test_bench_candidates_compute_the_op(backend, device):
    """bench_kv_cache_attention's fused-combine candidates (counts per call, and one workspace kept
    across the layers) return what the op returns, layer by layer."""
    from bench.bench_kv_cache_attention import HKV, HQ, fused_combine_candidates, random_step
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

    if device != "cpu":
        pytest.skip("the interpreter's check; on a GPU the bench checks its own rows")
    for T in (1, 5):
        steps = [random_step(torch.device(device), torch.float32, 2, HQ, HKV, T, 60, 128) for _ in range(2)]
        scale = 0.1
        want = [kv_cache_attention_triton(q, k, v, kc, vc, pos, scale) for q, k, v, kc, vc, _, pos in steps]
        for name, layers in fused_combine_candidates(steps, scale, 2, T).items():
            for got, expected in zip(layers(), want):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"{name}, T = {T}")


@pytest.mark.parametrize("rows, width, num_splits, num_warps",
                         [(4, 128, 33, 4), (20, 128, 33, 4), (16, 576, 64, 8), (16, 512, 64, 8), (80, 32, 7, 4),
                          (4, 128, 2, 4), (1, 2048, 3, 4)])
def test_fused_combine_steps_fit_the_register_budget(rows, width, num_splits, num_warps):
    """Each step's tile (rows x splits x width) stays within the per-thread budget (a single row
    and split excepted), both are powers of two, and no other such pair takes fewer steps."""
    kv = _kv()
    budget = kv.COMBINE_NUMBERS_PER_THREAD * 32 * num_warps
    combine_rows, splits = kv._fused_combine_blocks(rows, width, num_splits, num_warps)
    assert combine_rows & (combine_rows - 1) == 0 and splits & (splits - 1) == 0
    assert combine_rows * splits * width <= budget or combine_rows == splits == 1
    steps = -(-rows // combine_rows) * -(-num_splits // splits)
    fitting = [(r, s) for r in (2 ** i for i in range(8)) for s in (2 ** i for i in range(8))
               if r * s * width <= budget and r <= 2 * rows and s <= 2 * num_splits]
    assert all(-(-rows // r) * -(-num_splits // s) >= steps for r, s in fitting)
