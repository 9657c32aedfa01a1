"""The CPU kernels run the instruction set GPTFAST_KERNELS_CPU_ISA names, else the best the CPU runs
(baseline, AVX2 + FMA, AVX-512F + BW; _cpu_isa switches it in-process). kv_cache_attention's CPU kernel
and int8_linear's GEMV are built once per instruction set (csrc/cpu/). Every
build this CPU runs must match the reference (the other test files check the default build in depth);
the AVX2 and AVX-512 builds, whose
multiply-adds are both fused, must give the same bits; a query row must come out the same whichever
work item computes it (decode, verification, prefill, any thread count); and the 16-bit caches must
be read exactly (subnormal, huge and signed-zero float16 values).
The int8 GEMV's paths must each match the reference."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gptfast_kernels import _extension, ops
from python_tests.backends import cpu_builds, skip_unless_cpu_build, with_cpu_build, with_threads
from python_tests.ops.test_kv_cache_attention import ERROR_FLOOR, make_case

pytestmark = pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"),
                                reason="extension not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# (T, D, S, start, options): decode / verification / prefill; head dims with and without a tail past
# the 16-lane dot products and the 4-register value columns; windows, chunks, rings, softcap,
# sinks, values in keys (multi-head latent attention's 576 = 512 + 64).
CASES = {
    "decode": (1, 128, 96, 70, {}),
    "verify-d80": (5, 80, 64, 40, {}),
    "prefill-d20": (37, 20, 48, 0, {}),
    "window-softcap": (5, 64, 96, 60, {"window": 24, "softcap": 30.0}),
    "chunk": (6, 32, 96, 61, {"chunk_size": 16}),
    "ring-window": (5, 32, 40, 190, {"window": 20, "ring": True}),
    "sinks": (3, 48, 64, 30, {"sinks": True}),
    "values-in-keys": (4, 576, 48, 20, {"value_dim": 512}),
}


def _run_case(name, dtype):
    T, D, S, start, options = CASES[name]
    B, Hq, Hkv = 2, 4, 2
    options = dict(options)
    positions = torch.stack([torch.arange(start, start + T), torch.arange(start // 2, start // 2 + T)])
    if not options.get("ring"):
        positions = positions.clamp(max=S - 1)
    q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, T, D, S, positions, dtype, seed=3)
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, Hq)
    if options.get("value_dim"):
        v, v_cache = None, None

    def run(backend):
        kc, vc = k_cache.clone(), None if v_cache is None else v_cache.clone()
        return ops.kv_cache_attention(q, k, v, kc, vc, positions, backend=backend, **options)

    return run


FUSED_BUILDS = ("avx512", "avx2")  # fused multiply-adds, the same bits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_build_matches_the_reference_and_fused_builds_agree_to_the_bit(case, dtype):
    run = _run_case(case, dtype)
    outs = {isa: with_cpu_build(isa, lambda: run("cpu")) for isa in cpu_builds()}
    want = run("reference").double()
    for isa, out in outs.items():
        assert torch.isfinite(out).all(), isa
        error = (out.double() - want).abs().max().item()
        assert error <= ERROR_FLOOR[dtype] * 5, f"{case}, build {isa}: error {error} against the reference"
    fused = [outs[isa] for isa in FUSED_BUILDS if isa in outs]
    for out in fused[1:]:
        torch.testing.assert_close(out, fused[0], atol=0, rtol=0)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_each_build_matches_the_reference_on_ragged_rows(isa):
    skip_unless_cpu_build(isa)
    B, Hq, Hkv, T, D, S = 3, 8, 2, 7, 80, 64
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [-1, -1, 0, 1, 2, 3, 4], [40, 3, 17, -1, 22, 9, 30]])
    for dtype in DTYPES:
        q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, T, D, S, positions, dtype, seed=5)
        kc, vc = k_cache.clone(), v_cache.clone()
        got = with_cpu_build(isa, lambda: ops.kv_cache_attention(q, k, v, kc, vc, positions, backend="cpu"))
        want = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend="reference")
        torch.testing.assert_close(kc, k_cache, atol=0, rtol=0)
        assert torch.all(got[1, :, :2] == 0) and torch.all(got[2, :, 3] == 0)
        error = (got.double() - want.double()).abs().max().item()
        assert error <= ERROR_FLOOR[dtype] * 5, f"{dtype}: error {error}"


@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_in_any_work_item(dtype, window):
    """One kv head of one row, so that with several threads the kernel splits the tokens across work
    items: a verification of 9 tokens, the same tokens one decode step at a time, and one thread
    against four must agree to the bit. With a window each token's first position differs, so an item
    that started its blocks at its earliest position would sum a row differently per item."""
    B, Hq, Hkv, T, D, S = 1, 3, 1, 9, 48, 200
    positions = torch.arange(150, 150 + T).unsqueeze(0)
    q, k, v, k_cache, v_cache, positions = make_case(B, Hq, Hkv, T, D, S, positions, dtype, seed=7)

    def verify(num_threads):
        return with_threads(num_threads, lambda: ops.kv_cache_attention(
            q, k, v, k_cache.clone(), v_cache.clone(), positions, window=window, backend="cpu"))

    together = verify(1)
    torch.testing.assert_close(verify(4), together, atol=0, rtol=0)
    kc, vc = k_cache.clone(), v_cache.clone()
    for t in range(T):
        step = ops.kv_cache_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], kc, vc,
                                      positions[:, t:t + 1], window=window, backend="cpu")
        torch.testing.assert_close(step, together[:, :, t:t + 1], atol=0, rtol=0)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_query_head_is_the_same_in_any_group_of_heads(isa, dtype):
    """The kernel scores up to 4 query rows at once and sums the values of up to 4 rows that read the
    same slots at once; with more than 4 rows a 16-bit cache's block is converted to float first,
    with fewer it is widened as it is read. A query head must give the same bits in every grouping:
    each head of a group of G = 1 .. 8 (groups of 4, 2 + 1, 4 + 2 + 1, ...) against the same head
    alone as multi-head attention (a decode row alone: dots of one row with a register's width of
    keys at once, and one row's value sums), decode and 5 verification tokens, D = 80 (a tail past
    the 16-lane dots and the value registers), on one thread so that no item splits the group."""
    skip_unless_cpu_build(isa)
    B, Hkv, D, S = 2, 2, 80, 64
    for G in range(1, 9):
        for T in (1, 5):
            positions = torch.stack([torch.arange(40, 40 + T), torch.arange(17, 17 + T)])
            q, k, v, k_cache, v_cache, positions = make_case(B, Hkv * G, Hkv, T, D, S, positions, dtype,
                                                             seed=G * 10 + T)

            def attend(queries):
                return ops.kv_cache_attention(queries, k, v, k_cache.clone(), v_cache.clone(), positions,
                                              backend="cpu")

            grouped = with_threads(1, lambda: with_cpu_build(isa, lambda: attend(q)))
            for g in range(G):
                heads = [h * G + g for h in range(Hkv)]
                alone = with_threads(1, lambda: with_cpu_build(isa, lambda: attend(q[:, heads])))
                assert torch.equal(alone, grouped[:, heads]), f"G={G} T={T} head {g}"


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_special_half_values_are_read_exactly(isa):
    """With all-zero queries attention is the plain mean of the values seen; float16 values that are
    subnormal, near the largest finite, or negative zero must be converted exactly (a mean of a few
    float16 numbers is exact in float32 here)."""
    skip_unless_cpu_build(isa)
    B, Hq, Hkv, T, D, S = 1, 2, 1, 1, 40, 8
    specials = torch.tensor([6e-8, -6e-8, 3e-5, -0.0, 65504.0, -65504.0, 1.0, 2.0 ** -14], dtype=torch.float16)
    v_cache = specials[torch.arange(S * D).remainder(len(specials))].reshape(B, Hkv, S, D)
    v_cache = v_cache.roll(1, dims=-2).contiguous()
    k_cache = torch.zeros(B, Hkv, S, D, dtype=torch.float16)
    q = torch.zeros(B, Hq, T, D, dtype=torch.float16)
    k, v = k_cache[:, :, :1].clone(), v_cache[:, :, 1:2].clone()  # slot 1 rewritten with itself
    positions = torch.tensor([[1]])
    got = with_cpu_build(isa, lambda: ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend="cpu"))
    want = v_cache[:, :, :2].float().mean(dim=2, keepdim=True).expand(B, Hq, T, D)
    assert torch.equal(got.float(), want.half().float())


def test_choosing_a_build_by_name():
    builds = cpu_builds()
    assert builds[-1] == "baseline" and len(set(builds)) == len(builds)
    in_use = torch.ops.gptfast_kernels._cpu_isa()
    assert in_use == (os.environ.get("GPTFAST_KERNELS_CPU_ISA") or builds[0])  # the best one by default
    assert torch.ops.gptfast_kernels._cpu_isa("baseline") == in_use
    try:
        assert torch.ops.gptfast_kernels._cpu_isa() == "baseline"
        with pytest.raises(RuntimeError, match="_cpu_isa: isa must be one this CPU runs"):
            torch.ops.gptfast_kernels._cpu_isa("avx9000")
        assert torch.ops.gptfast_kernels._cpu_isa() == "baseline"
    finally:
        torch.ops.gptfast_kernels._cpu_isa(in_use)


def _in_subprocess(isa, code):
    env = dict(os.environ, GPTFAST_KERNELS_CPU_ISA=isa)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_environment_variable_picks_the_build():
    code = textwrap.dedent("""
        import torch, gptfast_kernels
        from gptfast_kernels import ops
        q = torch.randn(1, 2, 1, 16)
        k = torch.randn(1, 1, 1, 16)
        cache = torch.zeros(1, 1, 4, 16)
        ops.kv_cache_attention(q, k, k, cache, cache.clone(), torch.tensor([[0]]), backend="cpu")
        print(torch.ops.gptfast_kernels._cpu_isa())
    """)
    done = _in_subprocess("baseline", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "baseline"
    done = _in_subprocess("avx9000", code)
    assert done.returncode != 0
    assert "GPTFAST_KERNELS_CPU_ISA=avx9000 is not an instruction set this CPU runs" in done.stderr


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_int8_linear_paths_match_the_reference(isa):
    """int8_linear's GEMV per instruction set (csrc/cpu/int8_gemv_kernel.h: blocks of up to 4 rows of x
    and 4 or 2 weight rows): K with a tail past the 4-, 8- and 16-weight steps and K shorter than one,
    N not a multiple of 4, bias, 1-11 rows (whole blocks and each tail)."""
    skip_unless_cpu_build(isa)
    g = torch.Generator().manual_seed(13)
    for M, N, K in [(1, 4098, 775), (2, 37, 64), (3, 6, 33), (1, 5, 15), (5, 67, 300), (6, 9, 3), (11, 23, 129)]:
        x = torch.randn(M, K, generator=g)
        qweight = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        scales = torch.rand(N, generator=g) / 64
        bias = torch.randn(N, generator=g)
        got = with_cpu_build(isa, lambda: ops.int8_linear(x, qweight, scales, bias, backend="cpu"))
        want = ops.int8_linear(x, qweight, scales, bias, backend="reference")
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"M={M} N={N} K={K}: {m}")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_an_int8_gemv_row_does_not_depend_on_the_rows_beside_it(isa):
    """The GEMV's blocks of rows of x and of weight rows only group sums (each is LANES chains, added
    pairwise, then the K tail): a row of x gives the same bits alone, in any block position and any
    number of rows the GEMV takes (up to 11 on every build), one thread or two. K = 334 has a tail of 2+ on
    every build, N = 23 a last group of 3 weight rows."""
    skip_unless_cpu_build(isa)
    g = torch.Generator().manual_seed(17)
    qweight = torch.randint(-127, 128, (23, 334), generator=g, dtype=torch.int8)
    scales, bias = torch.rand(23, generator=g) / 64, torch.randn(23, generator=g)
    x = torch.randn(11, 334, generator=g)
    call = lambda rows: with_cpu_build(isa, lambda: torch.ops.gptfast_kernels.int8_linear(rows, qweight, scales, bias))
    whole = call(x)
    for start, stop in [(0, 1), (6, 7), (10, 11), (1, 3), (2, 5), (3, 7), (5, 10), (1, 11)]:
        assert torch.equal(call(x[start:stop]), whole[start:stop]), f"rows {start}:{stop}"
    assert torch.equal(with_threads(1, lambda: call(x)), whole)
