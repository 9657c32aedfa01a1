"""int8_expert_linear against transformers' batched experts matmul in the activation dtype.

Mixtral-8x7B's experts (E = 8, top 2, hidden 4096, intermediate 14336): the gate / up projection
(N = 28672, K = 4096) for 1, 8 and 32 tokens, i.e. P = 2, 16, 64 (token, expert) rows. Baseline
"hf_batched_mm": transformers' ``batched_mm`` experts path (the compile-friendly one), which gathers
each row's expert weight in the activation dtype and multiplies with bmm. "hf_expert_loop": its eager
path, a loop over the experts hit that applies each one's weight to its rows with F.linear; it is the
baseline for a prompt (CPU_PREFILL_TOKENS), where gathering a weight per row would not fit. GB/s
counts the int8 weights of the experts the rows chose (each read once), plus x and y.

Case "latent" (``--cases``; run by default): multi-head latent attention's per-head products
(models/latent_attention.py), DeepSeek-V3's 128 heads as the experts: the query's absorption into the
latent space (N = 512, K = 128) and the values' way out (N = 128, K = 512), for one row per head (decode)
and five (verification of 4 draft tokens). Baseline "float_per_head_matmul": the same products in the
activation dtype as one batched matmul over the heads, as the unquantised latent forward runs them.
"""

from __future__ import annotations

import torch

from bench.harness import add_cpu_isa_rows, cpu_isa_of_row
from gptfast_kernels import ops

E, TOP_K, N, K = 8, 2, 2 * 14336, 4096
TOKENS = (1, 8, 32)
CPU_SHAPE = (8, 2, 2 * 1024, 512)  # a small MoE layer: the CPU machine has 2 cores
CPU_PREFILL_TOKENS = 256  # a prompt: 64 rows per expert on average, where the CPU takes a GEMM per expert
LATENT_HEADS, LATENT_SHAPES, LATENT_ROWS = 128, ((512, 128), (128, 512)), (1, 5)  # DeepSeek-V3's heads


def hf_batched_mm(x, weight, experts):
    """transformers.integrations.moe's batched_mm path for one projection: gather, then bmm."""
    return torch.bmm(weight[experts], x.unsqueeze(-1)).squeeze(-1)


def hf_expert_loop(x, weight, experts):
    """transformers' eager experts path for one projection: each expert hit, F.linear on its rows."""
    y = x.new_zeros(x.shape[0], weight.shape[1])
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero().squeeze(1)
        y.index_copy_(0, rows, torch.nn.functional.linear(x[rows], weight[e]))
    return y


def float_per_head_matmul(x, weight):
    """x [rows * H, K] (row-major over (row, head)), weight [H, N, K] -> [rows * H, N]: one batched matmul."""
    heads = weight.shape[0]
    y = torch.matmul(x.view(-1, heads, x.shape[1]).transpose(0, 1), weight.transpose(1, 2))
    return y.transpose(0, 1).reshape(x.shape[0], -1)


def run_latent(h, dtype) -> None:
    device = h.device
    g = torch.Generator(device=device).manual_seed(1)
    for n, k in LATENT_SHAPES:
        weight = torch.randn(LATENT_HEADS, n, k, device=device, dtype=dtype, generator=g) / k ** 0.5
        qweight, scales = ops.quantize_int8(weight.reshape(-1, k))
        qweight, scales = qweight.view(LATENT_HEADS, n, k), scales.view(LATENT_HEADS, n)
        for rows in LATENT_ROWS:
            experts = torch.arange(LATENT_HEADS, device=device).repeat(rows)
            x = torch.randn(rows * LATENT_HEADS, k, device=device, dtype=dtype, generator=g)
            candidates = {
                "float_per_head_matmul": lambda: float_per_head_matmul(x, weight),
                "ours_kernel": lambda: ops.int8_expert_linear(x, qweight, scales, experts, check_experts=False),
            }
            add_cpu_isa_rows(candidates, device, "ours_kernel")
            nbytes = LATENT_HEADS * (n * k + 4 * n) + x.element_size() * rows * LATENT_HEADS * (k + n)
            h.compare("int8_expert_linear", {"case": "latent", "rows_per_head": rows, "E": LATENT_HEADS, "N": n,
                                             "K": k, "dtype": str(dtype)[6:], **cpu_isa_of_row(device)},
                      candidates, baseline="float_per_head_matmul", nbytes=nbytes, graphed=tuple(candidates))


def run(h) -> None:
    device = h.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    experts_count, top_k, n, k = (E, TOP_K, N, K) if device.type == "cuda" else CPU_SHAPE
    tokens = TOKENS[:2] if h.quick else TOKENS + ((CPU_PREFILL_TOKENS,) if device.type == "cpu" else ())
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(experts_count, n, k, device=device, dtype=dtype, generator=g) / k ** 0.5
    qweight, scales = ops.quantize_int8(weight.reshape(-1, k))
    qweight, scales = qweight.view(experts_count, n, k), scales.view(experts_count, n)
    for T in tokens:
        # each token's top-k distinct experts, drawn at random (a router's choice)
        experts = torch.rand(T, experts_count, device=device, generator=g).topk(top_k).indices.reshape(-1)
        x = torch.randn(T * top_k, k, device=device, dtype=dtype, generator=g)
        prompt = T == CPU_PREFILL_TOKENS
        candidates = {} if prompt else {"hf_batched_mm": lambda: hf_batched_mm(x, weight, experts)}
        candidates.update({
            "hf_expert_loop": lambda: hf_expert_loop(x, weight, experts),
            "ours_auto": lambda: ops.int8_expert_linear(x, qweight, scales, experts),
            "ours_kernel": lambda: ops.int8_expert_linear(x, qweight, scales, experts, check_experts=False),
        })
        if device.type == "cuda":
            candidates["ours_triton"] = lambda: ops.int8_expert_linear(x, qweight, scales, experts, backend="triton",
                                                                       check_experts=False)
        add_cpu_isa_rows(candidates, device, "ours_kernel")
        chosen = int(torch.unique(experts).numel())
        nbytes = chosen * (n * k + 4 * n) + x.element_size() * T * top_k * (k + n)
        h.compare("int8_expert_linear", {"tokens": T, "rows": T * top_k, "E": experts_count, "N": n, "K": k,
                                         "experts_chosen": chosen, "dtype": str(dtype)[6:], **cpu_isa_of_row(device)},
                  candidates, baseline="hf_expert_loop" if prompt else "hf_batched_mm", nbytes=nbytes,
                  graphed=tuple(name for name in candidates if name not in ("ours_auto", "hf_expert_loop")))
    if h.wants("latent") and not h.quick:
        run_latent(h, dtype)
