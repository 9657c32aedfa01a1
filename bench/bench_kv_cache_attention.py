"""kv_cache_attention against the Hugging Face static-cache way, per attention layer call.

Baseline "hf_static_cache": what a transformers StaticCache layer plus SDPA attention does,
k_cache.index_copy_(2, cache_position, k) (likewise v), then transformers' own
``sdpa_attention_forward`` over the WHOLE cache [B, Hkv, S, D] with a boolean mask (slots <=
position), which, given a mask, handles GQA by packing the group into the query (T = 1) or by
``repeat_kv`` (T > 1). The mask is built once outside the timed call, as HF builds it once per
forward for all layers.

Llama-3-8B attention (Hq / Hkv = 32 / 8, D = 128); decode (T = 1) and verification (T = 5, k = 4)
at context 1k / 4k / 16k with S = 2 x context, so every GPU row is at half fill (the issue's GPU
target: >= 1.5x the HF way at half fill); the issue's CPU target is decode at 25% fill of
S = 4096, B = 1. GB/s counts the K/V our kernel reads (context + T slots per kv head) plus q and
out. "ours_auto" is the eager wrapper, whose position checks synchronise with the host;
"ours_kernel" / "ours_triton_kernel" are the ops alone, as under torch.compile or CUDA graphs;
on a GPU their "@graph" rows time them as CUDA-graph replays (no host launch work): the figures to
hold against the bandwidth target. The CPU rows also prefill a 512-token prompt into an empty cache,
and run "ours_kernel" once more per other instruction set this CPU runs ("ours_kernel_avx2",
"ours_kernel_baseline"; the row's "cpu_isa" is the one the others use).

Sliding-window rows (Mistral-7B-v0.1: the same heads, window 4096) decode far past the window.
Their baseline, "hf_sliding_window", is transformers' sliding static-cache layer at its best: SDPA
over only the slots the window covers (its ring buffer holds no more), after the same
``index_copy_``; ours gets ``window=`` and must read no more than that either. The "ring" rows run
our kernels on a ring buffer of window + 2047 slots (``ring=True``, as generation allocates it:
generation/forward.py's PREFILL_CHUNK) at the same positions: they must cost what the full-length
cache costs.

Chunked-attention rows (``--cases chunked``: Llama 4's 8192-token chunks, with Llama-3's heads: the
same 8 kv heads of 128, 32 query heads where Scout has 40) decode late in a chunk and just past a
chunk start, against "hf_chunked", transformers' chunked static-cache layer at its best: SDPA over
the slots of the query's chunk alone, after the same ``index_copy_``; ours gets ``chunk_size=``.
Their "ring" rows run a ring buffer of chunk + 2047 slots, as generation allocates it.

Multi-head latent attention rows (``--cases mla``: DeepSeek-V3's absorbed attention, 128 query
heads over one kv head of the latent and rotary key, D = 512 + 64, values the 512-wide latent):
"ours_kernel" / "ours_triton_kernel" read the values from the keys (``value_dim=512``, one [S, 576]
buffer per layer, what generation runs) against "ours_kernel_separate_values", the same kernel
with a value cache holding the same rows (two buffers: what MLA took before values-in-keys). GB/s
counts the keys alone for all, so the fractions compare bytes the layer must read.

ALiBi rows (``--cases alibi``: MPT-7B / BLOOM-7B1 heads, 32 of 128, multi-head) against
"hf_static_cache_alibi", the same static-cache step with the bias slope_h * (key position) added
through SDPA's float mask, as transformers' MPT and Falcon-RW attention add theirs (the bias and mask
built once outside the timed call, as per forward); "ours_kernel_no_alibi" is the kernel without
slopes, the bias's own cost.
"""

from __future__ import annotations

import types

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.harness import PDL_SUFFIX, add_cpu_isa_rows, cpu_isa_of_row
from bench.read_floor import read_floor_candidates
from gptfast_kernels import _extension, ops

HQ, HKV, D = 32, 8, 128  # Llama-3-8B
CONTEXTS = (1024, 4096, 16384)
BATCHES = (1, 8, 32)
TOKENS = (1, 5)  # decode, verification of k = 4 draft tokens
# (B, T, context, S)
CPU_CASES = [(B, T, 1024, 2048) for B in (1, 8) for T in TOKENS]
CPU_QUICK_CASES = [(1, 1, 1024, 2048), (1, 5, 1024, 2048), (8, 1, 1024, 2048)]
CPU_PREFILL_CASE = (1, 512, 0, 2048)  # a 512-token prompt into an empty cache
ISSUE_CPU_CASE = (1, 1, 1024, 4096)  # target on CPU: decode at 25% fill
GPU_CASES = [(B, T, ctx, 2 * ctx) for ctx in CONTEXTS for B in BATCHES for T in TOKENS]
GPU_QUICK_CASES = [(B, T, 4096, 8192) for B in (1, 32) for T in TOKENS]
WINDOW = 4096  # Mistral-7B-v0.1
# (B, T, context, S, window): decode at 16k / 32k tokens, verification at 16k
GPU_WINDOW_CASES = [(B, 1, ctx, 2 * ctx, WINDOW) for ctx in (16384, 32768) for B in BATCHES] + \
    [(B, 5, 16384, 32768, WINDOW) for B in (1, 32)]
GPU_QUICK_WINDOW_CASES = [(1, 1, 32768, 65536, WINDOW), (32, 1, 16384, 32768, WINDOW)]
CPU_WINDOW_CASES = [(1, 1, 8192, 16384, 1024), (1, 5, 8192, 16384, 1024)]
RING_EXTRA = 2047  # a ring buffer's slots past the window (generation's prefill chunk - 1)
CHUNK = 8192  # Llama 4's attention_chunk_size
# (B, T, context, S, chunk): decode 8000 tokens into a chunk and 100 past a chunk start, verification
GPU_CHUNK_CASES = [(B, 1, ctx, 32768, CHUNK) for ctx in (2 * CHUNK + 8000, 2 * CHUNK + 100) for B in BATCHES] + \
    [(B, 5, 2 * CHUNK + 8000, 32768, CHUNK) for B in (1, 32)]
GPU_QUICK_CHUNK_CASES = [(1, 1, 2 * CHUNK + 8000, 32768, CHUNK), (32, 1, 2 * CHUNK + 8000, 32768, CHUNK)]
CPU_CHUNK_CASES = [(1, 1, 8192 + 900, 16384, 1024), (1, 5, 8192 + 900, 16384, 1024)]


def random_step(device, dtype, B, heads, kv_heads, T, context, S):
    """A seeded step of T new tokens at positions context .. context + T - 1 for every row: q, k, v,
    k_cache, v_cache (randn), cache_position [T] and positions [B, T]."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    q, k, v = rand(B, heads, T, D), rand(B, kv_heads, T, D), rand(B, kv_heads, T, D)
    k_cache, v_cache = rand(B, kv_heads, S, D), rand(B, kv_heads, S, D)
    cache_position = torch.arange(context, context + T, device=device)
    return q, k, v, k_cache, v_cache, cache_position, cache_position.expand(B, T).contiguous()


def hf_static_cache_step(module, q, k, v, k_cache, v_cache, cache_position, mask, scale):
    """One HF attention call: StaticLayer.update's index_copy_, then SDPA over the whole cache."""
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    return sdpa_attention_forward(module, q, k_cache, v_cache, mask, scaling=scale)[0]


def run(h) -> None:
    """--cases full (no window), window, chunked and / or mla; all by default."""
    device = h.device
    h.measure_copy_bandwidth()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        cases = GPU_QUICK_CASES if h.quick else GPU_CASES
    else:
        cases = (CPU_QUICK_CASES if h.quick else CPU_CASES + [CPU_PREFILL_CASE]) + [ISSUE_CPU_CASE]
    if h.cases is not None and "full" not in h.cases:
        cases = []
    if h.cases is not None and "layers" in h.cases:
        run_layers(h, dtype)
    usable = _extension.usable_backends(device)
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, is_causal=True)
    scale = D ** -0.5
    for B, T, context, S in cases:
        # (cache_position shared by all rows, as in HF)
        q, k, v, k_cache, v_cache, cache_position, positions = random_step(device, dtype, B, HQ, HKV, T, context, S)
        mask = (torch.arange(S, device=device)[None, :] <= cache_position[:, None]).expand(B, 1, T, S)
        # every candidate writes the same k / v at the same slots, so they can share the caches
        candidates = {
            "hf_static_cache": lambda: hf_static_cache_step(module, q, k, v, k_cache, v_cache,
                                                            cache_position, mask, scale),
            "ours_auto": lambda: ops.kv_cache_attention(q, k, v, k_cache, v_cache, cache_position),
        }
        if _extension.has_kernel("kv_cache_attention", "CUDA" if device.type == "cuda" else "CPU"):
            candidates["ours_kernel"] = lambda: torch.ops.gptfast_kernels.kv_cache_attention(
                q, k, v, k_cache, v_cache, positions, scale)
        if device.type == "cuda":
            if "cuda" in usable:
                candidates["ours_cuda"] = lambda: ops.kv_cache_attention(
                    q, k, v, k_cache, v_cache, cache_position, backend="cuda")
            if "triton" in usable:
                from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

                candidates["ours_triton"] = lambda: ops.kv_cache_attention(
                    q, k, v, k_cache, v_cache, cache_position, backend="triton")
                candidates["ours_triton_kernel"] = lambda: kv_cache_attention_triton(
                    q, k, v, k_cache, v_cache, positions, scale)
        add_cpu_isa_rows(candidates, device, "ours_kernel")
        elem = q.element_size()
        nbytes = 2 * B * HKV * (context + T) * D * elem + 2 * B * HQ * T * D * elem
        case = {"B": B, "T": T, "context": context, "S": S, "fill": round(context / S, 2),
                "dtype": str(dtype)[6:], "issue_target": (B, T, context, S) == ISSUE_CPU_CASE
                and device.type == "cpu", **cpu_isa_of_row(device)}
        # the kernels alone also as CUDA-graph replays, as a compiled decode step runs them (the
        # baseline stays eager: transformers' attention path is not checked for host syncs)
        h.compare("kv_cache_attention", case, candidates, baseline="hf_static_cache", nbytes=nbytes,
                  graphed=("ours_kernel", "ours_triton_kernel"))
        del q, k, v, k_cache, v_cache, mask
    if h.cases is None or "window" in h.cases:
        run_local(h, dtype, usable, module, scale, "window")
    if h.cases is None or "chunked" in h.cases:
        run_local(h, dtype, usable, module, scale, "chunk_size")
    if h.cases is None or "mla" in h.cases:
        run_latent(h, dtype)
    if h.cases is None or "alibi" in h.cases:
        run_alibi(h, dtype, module, scale)


# --cases layers: a decode step's attention calls as they run in it, back to back in one CUDA graph,
# each layer over its own caches (together several times the L2, so every layer reads cold keys and
# values), rather than one call between two events after an L2 flush (whose fixed cost is a large
# share of a call that reads a few MB). A row is the time of all the layers (GB/s: all their bytes).
# (B, T, context, S)
GPU_LAYERS_CASES = [(1, 1, 4096, 8192), (1, 1, 16384, 32768), (8, 1, 4096, 8192), (32, 1, 4096, 8192),
                    (1, 5, 4096, 8192), (8, 5, 4096, 8192)]
LAYERS_BYTES = 512 << 20  # bytes the layers read together


def fused_combine_candidates(steps, scale, B, T) -> dict:
    """The Triton decode with its fused combine (the last split program of a group combines: one
    launch a layer, no combine kernel), its counts zeroed per call ("..._kernel": a memset in the
    graph) or one workspace kept across the layers ("..._kept_counts_kernel": what a cache could own)."""
    from gptfast_kernels.triton import kv_cache_attention as kv

    device = steps[0][0].device
    tune, num_sms = kv._tuning(device, D)
    tune = tune._replace(fused_combine=True)
    # one count per (row, kv head, query-row block of at least 16 rows)
    counts = torch.zeros(B * HKV * -(-(HQ // HKV) * T // 16), dtype=torch.int32, device=device)

    def layers(kept):
        return lambda: [kv.kv_cache_attention_tuned(q, k, v, kc, vc, pos, scale, tune, num_sms,
                                                    counts=counts if kept else None)
                        for q, k, v, kc, vc, _, pos in steps]

    return {"ours_triton_fused_combine_kernel": layers(False),
            "ours_triton_fused_combine_kept_counts_kernel": layers(True)}


def run_layers(h, dtype) -> None:
    device = h.device
    cases = GPU_LAYERS_CASES if device.type == "cuda" else [(1, 1, 1024, 2048)]
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, is_causal=True)
    scale = D ** -0.5
    has_kernel = _extension.has_kernel("kv_cache_attention", "CUDA" if device.type == "cuda" else "CPU")
    op = torch.ops.gptfast_kernels.kv_cache_attention
    for B, T, context, S in cases:
        elem = torch.finfo(dtype).bits // 8
        nbytes = 2 * B * HKV * (context + T) * D * elem + 2 * B * HQ * T * D * elem
        layers = max(2, (LAYERS_BYTES if device.type == "cuda" else 16 << 20) // nbytes)
        steps = [random_step(device, dtype, B, HQ, HKV, T, context, S) for _ in range(layers)]
        cache_position = steps[0][5]
        mask = (torch.arange(S, device=device)[None, :] <= cache_position[:, None]).expand(B, 1, T, S)
        candidates = {"hf_static_cache": lambda: [hf_static_cache_step(module, q, k, v, kc, vc, cache_position, mask,
                                                                       scale) for q, k, v, kc, vc, _, _ in steps]}
        if has_kernel:
            candidates["ours_kernel"] = lambda: [op(q, k, v, kc, vc, pos, scale) for q, k, v, kc, vc, _, pos in steps]
        if device.type == "cuda" and "triton" in _extension.usable_backends(device):
            from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

            candidates["ours_triton_kernel" + PDL_SUFFIX] = lambda: [
                kv_cache_attention_triton(q, k, v, kc, vc, pos, scale) for q, k, v, kc, vc, _, pos in steps]
            if not PDL_SUFFIX:
                candidates.update(fused_combine_candidates(steps, scale, B, T))
        if device.type == "cuda" and not PDL_SUFFIX:  # the K / V slots read, one launch a layer
            candidates.update(read_floor_candidates([
                cache.view(B * HKV, S * D)[:, :(context + T) * D] for *_, kc, vc, _, _ in steps for cache in (kc, vc)]))
        case = {"B": B, "T": T, "context": context, "S": S, "fill": round(context / S, 2), "dtype": str(dtype)[6:],
                "layers": layers}
        h.compare("kv_cache_attention", case, candidates, baseline="hf_static_cache", nbytes=layers * nbytes,
                  graphed=tuple(candidates))
        del steps, mask


ALIBI_HEADS = 32  # MPT-7B, BLOOM-7B1: multi-head attention, D = 128
# (B, T, context, S)
GPU_ALIBI_CASES = [(B, T, 4096, 8192) for B in BATCHES for T in TOKENS]
GPU_QUICK_ALIBI_CASES = [(1, 1, 4096, 8192), (32, 1, 4096, 8192)]
CPU_ALIBI_CASES = [(1, 1, 1024, 2048), (1, 5, 1024, 2048)]


def run_alibi(h, dtype, module, scale) -> None:
    """ALiBi attention against transformers' static-cache step with the bias in SDPA's mask."""
    device = h.device
    cases = (GPU_QUICK_ALIBI_CASES if h.quick else GPU_ALIBI_CASES) if device.type == "cuda" else CPU_ALIBI_CASES
    heads = ALIBI_HEADS
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    slopes = 2.0 ** (-8 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)
    op = torch.ops.gptfast_kernels.kv_cache_attention
    has_kernel = _extension.has_kernel("kv_cache_attention", "CUDA" if device.type == "cuda" else "CPU")
    for B, T, context, S in cases:
        q, k, v, k_cache, v_cache, cache_position, positions = random_step(device, dtype, B, heads, heads, T, context,
                                                                           S)
        slots = torch.arange(S, device=device)
        bias = (slopes[:, None, None] * slots.to(torch.float32)).expand(heads, T, S)
        allowed = slots[None, :] <= cache_position[:, None]  # [T, S]
        mask = bias.masked_fill(~allowed, float("-inf")).to(dtype).expand(B, heads, T, S)
        candidates = {
            "hf_static_cache_alibi": lambda: hf_static_cache_step(module, q, k, v, k_cache, v_cache,
                                                                  cache_position, mask, scale),
            "ours_auto": lambda: ops.kv_cache_attention(q, k, v, k_cache, v_cache, cache_position,
                                                        alibi_slopes=slopes),
        }
        if has_kernel:
            candidates["ours_kernel"] = lambda: op(q, k, v, k_cache, v_cache, positions, scale,
                                                   alibi_slopes=slopes)
            candidates["ours_kernel_no_alibi"] = lambda: op(q, k, v, k_cache, v_cache, positions, scale)
        if device.type == "cuda" and "triton" in _extension.usable_backends(device):
            from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

            candidates["ours_triton_kernel"] = lambda: kv_cache_attention_triton(
                q, k, v, k_cache, v_cache, positions, scale, alibi_slopes=slopes)
        elem = q.element_size()
        nbytes = 2 * B * heads * (context + T) * D * elem + 2 * B * heads * T * D * elem
        case = {"B": B, "T": T, "context": context, "S": S, "heads": heads, "kv_heads": heads, "alibi": True,
                "dtype": str(dtype)[6:]}
        h.compare("kv_cache_attention", case, candidates, baseline="hf_static_cache_alibi", nbytes=nbytes,
                  graphed=tuple(name for name in candidates if "kernel" in name))
        del q, k, v, k_cache, v_cache, mask


MLA_HEADS, MLA_RANK, MLA_ROPE = 128, 512, 64  # DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64
# (B, T, context, S)
GPU_MLA_CASES = [(B, T, 4096, 8192) for B in BATCHES for T in TOKENS] + [(1, 1, 32768, 65536)]
GPU_QUICK_MLA_CASES = [(1, 1, 4096, 8192), (32, 1, 4096, 8192)]
CPU_MLA_CASES = [(1, 1, 1024, 2048)]


def run_latent(h, dtype) -> None:
    """Absorbed multi-head latent attention, values in the keys against a separate value cache."""
    device = h.device
    cases = (GPU_QUICK_MLA_CASES if h.quick else GPU_MLA_CASES) if device.type == "cuda" else CPU_MLA_CASES
    if not _extension.has_kernel("kv_cache_attention", "CUDA" if device.type == "cuda" else "CPU"):
        return
    D = MLA_RANK + MLA_ROPE
    scale = D ** -0.5
    empty = torch.empty(0, device=device, dtype=dtype)
    for B, T, context, S in cases:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, MLA_HEADS, T, D, generator=g, device=device, dtype=dtype)
        k = torch.randn(B, 1, T, D, generator=g, device=device, dtype=dtype)
        k_cache = torch.randn(B, 1, S, D, generator=g, device=device, dtype=dtype)
        v_cache = k_cache.clone()
        positions = torch.arange(context, context + T, device=device).expand(B, T).contiguous()
        op = torch.ops.gptfast_kernels.kv_cache_attention
        candidates = {
            "ours_kernel_separate_values": lambda: op(q, k, k, k_cache, v_cache, positions, scale),
            "ours_kernel": lambda: op(q, k, empty, k_cache, empty, positions, scale, value_dim=MLA_RANK),
        }
        if device.type == "cuda" and "triton" in _extension.usable_backends(device):
            from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

            candidates["ours_triton_kernel"] = lambda: kv_cache_attention_triton(
                q, k, empty, k_cache, empty, positions, scale, value_dim=MLA_RANK)
        elem = q.element_size()
        nbytes = B * (context + T) * D * elem + B * MLA_HEADS * T * (D + MLA_RANK) * elem
        case = {"B": B, "T": T, "context": context, "S": S, "heads": MLA_HEADS, "kv_heads": 1, "head_dim": D,
                "value_dim": MLA_RANK, "dtype": str(dtype)[6:]}
        h.compare("kv_cache_attention", case, candidates, baseline="ours_kernel_separate_values", nbytes=nbytes,
                  graphed=tuple(candidates))
        del q, k, k_cache, v_cache


def run_local(h, dtype, usable, module, scale, rule: str) -> None:
    """Decode / verification where a query sees only its last slots (``rule`` "window": a sliding
    window far behind the position) or its chunk's ("chunk_size"); see the docstring."""
    device = h.device
    if rule == "window":
        gpu_cases, quick_cases, cpu_cases = GPU_WINDOW_CASES, GPU_QUICK_WINDOW_CASES, CPU_WINDOW_CASES
    else:
        gpu_cases, quick_cases, cpu_cases = GPU_CHUNK_CASES, GPU_QUICK_CHUNK_CASES, CPU_CHUNK_CASES
    if device.type == "cuda":
        cases = quick_cases if h.quick else gpu_cases
    else:
        cases = cpu_cases[:1] if h.quick else cpu_cases
    for B, T, context, S, reach in cases:  # reach: the window, or the chunk
        q, k, v, k_cache, v_cache, cache_position, positions = random_step(device, dtype, B, HQ, HKV, T, context, S)
        if rule == "window":
            starts = cache_position - reach + 1  # each query's first slot
        else:
            starts = cache_position - cache_position % reach
        first = int(starts[0])  # the earliest slot any of the T queries sees
        slots = torch.arange(first, context + T, device=device)[None, :]
        mask = ((slots <= cache_position[:, None]) & (slots >= starts[:, None])).expand(B, 1, T, -1)

        def hf_local():
            k_cache.index_copy_(2, cache_position, k)
            v_cache.index_copy_(2, cache_position, v)
            return sdpa_attention_forward(module, q, k_cache[:, :, first:context + T], v_cache[:, :, first:context + T],
                                          mask, scaling=scale)[0]

        baseline = "hf_sliding_window" if rule == "window" else "hf_chunked"
        kwargs = {rule: reach}
        window, chunk = (reach, 0) if rule == "window" else (0, reach)
        candidates = {
            baseline: hf_local,
            "ours_auto": lambda: ops.kv_cache_attention(q, k, v, k_cache, v_cache, cache_position, **kwargs),
        }
        ring_k, ring_v = (torch.randn(B, HKV, reach + RING_EXTRA, D, device=device, dtype=dtype) for _ in range(2))
        if _extension.has_kernel("kv_cache_attention", "CUDA" if device.type == "cuda" else "CPU"):
            op = torch.ops.gptfast_kernels.kv_cache_attention
            candidates["ours_kernel"] = lambda: op(q, k, v, k_cache, v_cache, positions, scale, window, 0.0, None,
                                                   False, 0, chunk)
            candidates["ours_ring_kernel"] = lambda: op(q, k, v, ring_k, ring_v, positions, scale, window, 0.0, None,
                                                        True, 0, chunk)
        if device.type == "cuda" and "triton" in usable:
            from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

            candidates["ours_triton_kernel"] = lambda: kv_cache_attention_triton(
                q, k, v, k_cache, v_cache, positions, scale, window, 0.0, None, False, 0, chunk)
            candidates["ours_ring_triton_kernel"] = lambda: kv_cache_attention_triton(
                q, k, v, ring_k, ring_v, positions, scale, window, 0.0, None, True, 0, chunk)
        add_cpu_isa_rows(candidates, device, "ours_kernel")
        elem = q.element_size()
        nbytes = 2 * B * HKV * (context + T - first) * D * elem + 2 * B * HQ * T * D * elem
        case = {"B": B, "T": T, "context": context, "S": S, rule.split("_")[0]: reach, "dtype": str(dtype)[6:],
                **cpu_isa_of_row(device)}
        h.compare("kv_cache_attention", case, candidates, baseline=baseline, nbytes=nbytes,
                  graphed=("ours_kernel", "ours_triton_kernel", "ours_ring_kernel", "ours_ring_triton_kernel"))
        del q, k, v, k_cache, v_cache, ring_k, ring_v, mask
