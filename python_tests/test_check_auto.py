"""bench/check_auto.py: per measured case, the faster of the CUDA and Triton kernels (from the
CUDA-graph rows where a run has them) against what backend="auto" picks."""

import pytest

from bench.check_auto import verdicts


def _row(op, impl, ms, **case):
    return {"op": op, "impl": impl, "ms_median": ms, **case}


def test_verdicts_prefer_graph_rows_and_price_a_wrong_pick():
    int8_case = dict(M=1, N=4096, K=4096)        # auto: CUDA (one row)
    kv_case = dict(B=32, T=1, context=4096, S=8192)  # auto: Triton (256 head rows, a long cache)
    rows = [
        # eager rows say Triton is faster, the CUDA-graph replays say CUDA: the replays count
        _row("int8_linear", "ours_cuda", 0.050, **int8_case), _row("int8_linear", "ours_triton", 0.030, **int8_case),
        _row("int8_linear", "ours_cuda@graph", 0.015, **int8_case),
        _row("int8_linear", "ours_triton@graph", 0.022, **int8_case),
        _row("kv_cache_attention", "ours_kernel", 0.183, **kv_case),
        _row("kv_cache_attention", "ours_triton_kernel", 0.217, **kv_case),
        _row("kv_cache_attention", "hf_static_cache", 1.0, **kv_case),
        # a case with only one of the two kernels measured is left out
        _row("int8_linear", "ours_cuda", 0.1, M=2, N=8, K=16),
    ]
    found = {v["op"]: v for v in verdicts(rows)}
    assert set(found) == {"int8_linear", "kv_cache_attention"}
    int8 = found["int8_linear"]
    assert (int8["faster"], int8["auto"], int8["lost_ms"]) == ("cuda", "cuda", 0)
    assert int8["cuda_ms"] == pytest.approx(0.015) and int8["triton_ms"] == pytest.approx(0.022)
    kv = found["kv_cache_attention"]
    assert (kv["faster"], kv["auto"]) == ("cuda", "triton")
    assert kv["lost_ms"] == pytest.approx(0.217 - 0.183)


def test_a_windowed_case_is_judged_apart_from_the_same_shape_without_a_window():
    shape = dict(B=1, T=1, context=16384, S=32768)
    rows = [
        _row("kv_cache_attention", "ours_kernel", 0.090, **shape),
        _row("kv_cache_attention", "ours_triton_kernel", 0.180, **shape),
        _row("kv_cache_attention", "ours_kernel", 0.040, window=4096, **shape),
        _row("kv_cache_attention", "ours_triton_kernel", 0.030, window=4096, **shape),
    ]
    found = {v.get("window"): v for v in verdicts(rows)}
    assert set(found) == {None, 4096}
    assert (found[None]["cuda_ms"], found[None]["triton_ms"]) == (0.090, 0.180)
    assert (found[4096]["cuda_ms"], found[4096]["triton_ms"], found[4096]["faster"]) == (0.040, 0.030, "triton")


def test_a_case_timed_in_cuda_graphs_is_judged_by_the_rule_for_graphs():
    """One row of 8 kv heads: eager, auto takes the CUDA kernel; timed as graph replays, Triton."""
    shape = dict(B=1, T=1, context=16384, S=32768)
    eager = [_row("kv_cache_attention", "ours_kernel", 0.090, **shape),
             _row("kv_cache_attention", "ours_triton_kernel", 0.180, **shape)]
    graphs = [_row("kv_cache_attention", "ours_kernel@graph", 0.080, layers=7, **shape),
              _row("kv_cache_attention", "ours_triton_kernel@graph", 0.050, layers=7, **shape)]
    found = {v.get("layers"): v for v in verdicts(eager + graphs)}
    assert (found[None]["graphed"], found[None]["auto"], found[None]["lost_ms"]) == (False, "cuda", 0)
    assert (found[7]["graphed"], found[7]["auto"], found[7]["lost_ms"]) == (True, "triton", 0)
