"""Launch-constant sweep of the Triton kv_cache_attention decode (T = 1 and the T = 5 of a k = 4
verification), on a GPU only: slots per tile, programs wanted per SM (how many splits), the
shortest split and warps, each against the constants the wrapper uses today and against the CUDA
kernel, Llama-3-8B heads at half fill. Every config's output is checked against the reference
before it is timed; one that fails to compile or is wrong is recorded, not timed. The rows say
which constants ``_GPU`` should hold.
"""

from __future__ import annotations

import itertools

import torch

from bench.bench_kv_cache_attention import D, HKV, HQ
from gptfast_kernels import _extension
from gptfast_kernels.ops import reference

CASES = [(B, T, ctx) for ctx in (4096, 16384) for B in (1, 8, 32) for T in (1, 5)]  # S = 2 x ctx
QUICK_CASES = [(1, 1, 4096), (1, 1, 16384), (8, 1, 4096), (32, 1, 4096), (1, 5, 4096)]
BLOCK_N = (32, 64, 128)
PROGRAMS_PER_SM = (2, 4)
# The shortest split binds at short contexts: 256 slots left a B = 1 row at 4k context 16 splits,
# 128 programs for 132 SMs, whatever the programs per SM (the H200 sweep at e9ab4ef: 23.3-24.5 us
# for every tile and program count).
MIN_SPLIT_LEN = (64, 256)
WARPS = (2, 4, 8)
MAX_RELATIVE_ERROR = 2e-2  # bf16 inputs and output


def tunings(base):
    for block_n, per_sm, min_split, warps in itertools.product(BLOCK_N, PROGRAMS_PER_SM, MIN_SPLIT_LEN, WARPS):
        yield base._replace(decode_block_n=block_n, programs_per_sm=per_sm, min_split_len=min_split,
                            num_warps=warps)


def name_of(tune) -> str:
    return f"n{tune.decode_block_n}_p{tune.programs_per_sm}_s{tune.min_split_len}_w{tune.num_warps}"


def run(h) -> None:
    if h.device.type != "cuda" or "triton" not in _extension.usable_backends(h.device):
        print("kv_tiles: GPU with Triton only; skipped")
        return
    from gptfast_kernels.triton import kv_cache_attention as kv

    h.measure_copy_bandwidth()
    current, num_sms = kv._tuning(h.device, D)
    for B, T, context in QUICK_CASES if h.quick else CASES:
        S = 2 * context
        g = torch.Generator(device=h.device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=h.device, dtype=torch.bfloat16)

        q, k, v = rand(B, HQ, T, D), rand(B, HKV, T, D), rand(B, HKV, T, D)
        k_cache, v_cache = rand(B, HKV, S, D), rand(B, HKV, S, D)
        positions = torch.arange(context, context + T, device=h.device).expand(B, T).contiguous()
        scale = D ** -0.5
        # every candidate writes the same k / v at the same slots, so they can share the caches
        want = reference.kv_cache_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(),
                                            positions, scale)

        def tuned(tune):
            return lambda: kv.kv_cache_attention_tuned(q, k, v, k_cache, v_cache, positions, scale, tune, num_sms)

        fixed = {"current": tuned(current), "current_fused_combine": tuned(current._replace(fused_combine=True))}
        if _extension.has_kernel("kv_cache_attention", "CUDA"):
            fixed["cuda_kernel"] = lambda: torch.ops.gptfast_kernels.kv_cache_attention(
                q, k, v, k_cache, v_cache, positions, scale)
        case = {"B": B, "T": T, "context": context, "S": S, "dtype": "bfloat16", "current": name_of(current)}
        nbytes = 2 * B * HKV * (context + T) * D * 2 + 2 * B * HQ * T * D * 2
        timed, best = h.sweep("kv_tiles", case, fixed, {name_of(t): tuned(t) for t in tunings(current)}, want,
                              MAX_RELATIVE_ERROR, baseline="current", nbytes=nbytes)
        us = {name: (1e3 * row["ms_median"], row.get("fraction_of_copy_bw", 0.0)) for name, row in timed.items()}
        best = best or "current"
        print(f"kv_tiles B={B} T={T} ctx={context}: current {us['current'][0]:.1f} us "
              f"({us['current'][1]:.0%} of copy), best {best} {us[best][0]:.1f} us ({us[best][1]:.0%})"
              + (f", CUDA {us['cuda_kernel'][0]:.1f} us" if "cuda_kernel" in us else ""), flush=True)
        del q, k, v, k_cache, v_cache, want
