"""The workload that `bench/gpu_run.sh profile` runs under Nsight Compute (ncu): one call of each
of our kernels at the Llama-3-8B shapes whose tuning is open (see the H100 notes in bench/results),
so the report gives each kernel's duration, DRAM throughput, occupancy, registers and warp stall
reasons. ncu replays every kernel it profiles, so no warm-up is needed; the filter on kernel names
(KERNELS) leaves out torch's own kernels that build the inputs.

    ncu --clock-control none -k "regex:$(python -m bench.profile_kernels --kernels)" python -m bench.profile_kernels
"""

from __future__ import annotations

import sys

import torch

from bench.bench_kv_cache_attention import D, HKV, HQ
from gptfast_kernels import ops

KERNELS = "int8_linear|expert_gemv_kernel|int8_expert_linear|decode_kernel|combine_kernel|verify_draft"
N_K_SHAPES = {"qkv-size": (4096, 4096), "up": (14336, 4096), "down": (4096, 14336)}


def cases(device: torch.device):
    """(name, fn) pairs, inputs built once."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    out = []
    for shape_name, (N, K) in N_K_SHAPES.items():
        qweight, scales = ops.quantize_int8(torch.randn(N, K, **bf16) / K ** 0.5)
        # the CUDA op: FMA GEMV (1 row), tensor-core layouts for 2-16 rows and 17-64 rows
        for M, backend in ((1, "cuda"), (4, "cuda"), (16, "cuda"), (40, "cuda"), (4, "triton"), (16, "triton")):
            x = torch.randn(M, K, **bf16)
            out.append((f"int8_linear {backend} M={M} {shape_name} {N}x{K}",
                        lambda x=x, q=qweight, s=scales, b=backend: ops.int8_linear(x, q, s, backend=b)))
    for B, T, context, backend in ((1, 1, 4096, "cuda"), (1, 1, 4096, "triton"), (32, 1, 4096, "cuda"),
                                   (32, 1, 4096, "triton"), (1, 5, 4096, "cuda")):
        S = 2 * context
        q, k, v = torch.randn(B, HQ, T, D, **bf16), torch.randn(B, HKV, T, D, **bf16), torch.randn(B, HKV, T, D, **bf16)
        k_cache, v_cache = torch.randn(B, HKV, S, D, **bf16), torch.randn(B, HKV, S, D, **bf16)
        positions = torch.arange(context, context + T, device=device).expand(B, T).contiguous()
        out.append((f"kv_cache_attention {backend} B={B} T={T} ctx={context}",
                    lambda a=(q, k, v, k_cache, v_cache, positions), b=backend:
                    ops.kv_cache_attention(*a, backend=b, check_positions=False)))
    # Mixtral-8x7B's gate / up experts for 1 and 8 tokens (top 2 of 8): the unmeasured expert kernels
    experts_weight = torch.randn(8, 2 * 14336, 4096, **bf16) / 64
    eq, es = ops.quantize_int8(experts_weight.view(-1, 4096))
    eq, es = eq.view(8, 2 * 14336, 4096), es.view(8, 2 * 14336)
    del experts_weight
    for tokens in (1, 8):
        chosen = torch.arange(2 * tokens, device=device) % 8
        x = torch.randn(2 * tokens, 4096, **bf16)
        for backend in ("cuda", "triton"):
            out.append((f"int8_expert_linear {backend} tokens={tokens} top2-of-8 28672x4096",
                        lambda x=x, e=chosen, b=backend: ops.int8_expert_linear(x, eq, es, e, backend=b,
                                                                              check_experts=False)))
    B, k, V = 64, 5, 128256
    target = torch.randn(B, k + 1, V, device=device).softmax(-1)
    draft = torch.randn(B, k, V, device=device).softmax(-1)
    tokens = torch.randint(0, V, (B, k), device=device)
    uniforms = torch.rand(B, k + 1, device=device)
    out.append(("verify_draft cuda sampling B=64 k=5 V=128256",
                lambda: ops.verify_draft(target, draft, tokens, uniforms, backend="cuda", check_values=False)))
    greedy_tokens = target[:, :k].argmax(-1)
    out.append(("verify_draft cuda greedy B=64 k=5 V=128256",
                lambda: ops.verify_draft(target, None, greedy_tokens, backend="cuda", check_values=False)))
    return out


def main() -> None:
    if "--kernels" in sys.argv:
        print(KERNELS)
        return
    for name, fn in cases(torch.device("cuda")):
        print("case:", name, flush=True)
        fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
