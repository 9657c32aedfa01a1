"""End-to-end decoding: gptfast_kernels.generate (patched: int8 weights + fused attention) against
transformers' own generate on the unpatched model, same random-weight Llama-shaped model, batch 1
(and more rows on a GPU), greedy.

CPU: a 125M-parameter Llama shape (hidden 768, 12 layers, vocab 32000), fp32 baseline; ours both
eager (as transformers' generate runs there) and with ``compile=True`` (inductor's C++ code; the
warm-up call compiles).
GPU: Llama-3-8B shapes in bf16, baseline HF generate with its static cache (which transformers
compiles itself for static caches on CUDA), ours with ``compile=True`` (decode step in a CUDA
graph), batch 1, 8 and 32 rows. tokens_per_s includes the prefill of a 32-token prompt;
decode_tokens_per_s leaves it out (the time of a run with 1 new token subtracted), the figure to
hold against the decode anchors.
Cases (``--cases``): batch1, batch8, batch32; small (Qwen2.5-0.5B's shapes, batch 1: a model small
enough that the host's per-step work may set the pace on a GPU; ``host_fraction``); mla (a DeepSeek-V2-Lite-shaped model, multi-head latent
attention, batch 1 and on a GPU 8: transformers expands its latent cache every step, ours attends over
the latents); llama4 (4 of Llama-4-Scout's layers, batch 1 and on a GPU 8: chunked attention,
NoPE layers, 16 experts top-1 beside a shared expert, which transformers runs densely on every token);
mamba2 (Mamba-2 2.7B's shapes, attention-free, batch 1 and on a GPU 8: both run transformers' own
mixer code, here without the mamba_ssm kernels, ours with int8 projections, compiled into one graph, and
its states in the StaticKVCache; transformers' generate gets its default cache for it, not a static one).
Published anchor for batch 1 (torchao int8 weight-only, Llama-3.1-8B, H100): 198.85 tok/s; the
issue's target for ours is >= 260 tok/s.
"""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Llama4ForCausalLM, Llama4TextConfig, LlamaConfig,
                          LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM)

from bench import cuda_graph_records
from bench.harness import best_seconds, best_seconds_and_host, default_dtype, tokens_digest

CPU_CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000, max_position_embeddings=2048)
GPU_CONFIG = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
# Multi-head latent attention: DeepSeek-V2-Lite's attention (16 heads, latent 512 + rotary key 64, per
# head nope 128 / value 128, full-rank queries) in 27 dense layers (its MoE left out: the attention and
# its cache are what this case measures); CPU: the same structure, smaller
MLA_GPU_CONFIG = dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                      num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=27, vocab_size=102400,
                      max_position_embeddings=4096)
MLA_CPU_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128, qk_rope_head_dim=32,
                      qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=4, vocab_size=32000,
                      max_position_embeddings=2048)
# Llama 4: Llama-4-Scout's layer shapes (hidden 5120, 40 heads over 8 kv heads, 16 experts top-1 of width
# 8192 beside a shared one, every 4th layer NoPE and global) in 4 of its 48 layers (11B parameters), so the
# bf16 baseline, its copy being patched and the int8 model fit one GPU together; CPU: the same structure, smaller, with chunks of 32 tokens so
# that the prompt and the decode cross chunk boundaries
LLAMA4_GPU_CONFIG = dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=4,
                         num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
                         num_experts_per_tok=1, vocab_size=202048, max_position_embeddings=8192)
LLAMA4_CPU_CONFIG = dict(hidden_size=512, intermediate_size=512, intermediate_size_mlp=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
                         num_experts_per_tok=1, vocab_size=32000, max_position_embeddings=2048, attention_chunk_size=32)
# Mamba-2 2.7B's shapes (hidden 2560, 64 layers, 80 heads of 64 with a state of 128, one group, vocab 50288);
# CPU: the same structure, smaller
MAMBA2_GPU_CONFIG = dict(hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128,
                         n_groups=1, expand=2, vocab_size=50288)
MAMBA2_CPU_CONFIG = dict(hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64, state_size=64, n_groups=1,
                         expand=2, vocab_size=32000)
# A small model on a GPU: Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads over 2 kv heads of 64,
# vocab 151936) as a Llama. Its decode step reads ~0.5 GB of int8 weights, a fraction of a millisecond
# on an H100 / H200, about what the host spends a step on its 24 layers' per-call work (dynamo's guards
# and inputs, the CUDA graph's replay, the step's eager ops): the case where the host, not the GPU, may
# set the pace (host_fraction). CPU: the same structure, 4 layers
SMALL_GPU_CONFIG = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=8192)
SMALL_CPU_CONFIG = dict(SMALL_GPU_CONFIG, num_hidden_layers=4, vocab_size=32000)
PROMPT_LEN = 32


def run(h) -> None:
    on_gpu = h.device.type == "cuda"
    cfg = dict(GPU_CONFIG if on_gpu else CPU_CONFIG)
    if h.quick and not on_gpu:
        cfg.update(num_hidden_layers=4)
    batches = [rows for rows in ((1, 8, 32) if on_gpu else (1,)) if h.wants(f"batch{rows}")]
    if batches:
        _compare(h, lambda: LlamaForCausalLM(LlamaConfig(**cfg)), "llama", batches)
    if h.wants("small"):
        _compare(h, lambda: LlamaForCausalLM(LlamaConfig(**(SMALL_GPU_CONFIG if on_gpu else SMALL_CPU_CONFIG))),
                 "llama-qwen2.5-0.5b-shapes", (1,))
    if h.wants("mla"):
        mla = dict(MLA_GPU_CONFIG if on_gpu else MLA_CPU_CONFIG)
        if h.quick and not on_gpu:
            mla.update(num_hidden_layers=2, first_k_dense_replace=2)
        _compare(h, lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**mla)), "deepseek-v3-mla",
                 (1, 8) if on_gpu else (1,))
    if h.wants("llama4"):
        llama4 = LLAMA4_GPU_CONFIG if on_gpu else LLAMA4_CPU_CONFIG
        _compare(h, lambda: Llama4ForCausalLM(Llama4TextConfig(**llama4)), "llama4-scout-layers",
                 (1, 8) if on_gpu else (1,))
    if h.wants("mamba2"):
        mamba2 = dict(MAMBA2_GPU_CONFIG if on_gpu else MAMBA2_CPU_CONFIG)
        if h.quick and not on_gpu:
            mamba2.update(num_hidden_layers=2)
        _compare(h, lambda: Mamba2ForCausalLM(Mamba2Config(**mamba2)), "mamba2", (1, 8) if on_gpu else (1,),
                 static_cache=False)


def _compare(h, build, name: str, batches, *, static_cache: bool = True) -> None:
    """Times transformers' generate on the random-weight model ``build()`` makes against ours on
    its patched copy, per batch size, and records both rows. ``static_cache``: transformers' generate
    runs with its static cache on a GPU (False: a model that has none, Mamba-2)."""
    from gptfast_kernels import generate, patch_model

    on_gpu = h.device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    new_tokens = 64 if on_gpu else 24
    torch.manual_seed(0)
    with torch.device(h.device), default_dtype(dtype):
        baseline = build().eval()
    cfg = baseline.config
    patched = patch_model(copy.deepcopy(baseline), int8=True, fused_attention=True)
    params = sum(p.numel() for p in baseline.parameters())
    for rows in batches:
        input_ids = torch.randint(0, cfg.vocab_size, (rows, PROMPT_LEN), device=h.device)
        mask = torch.ones_like(input_ids)
        def hf_run(tokens):
            kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, attention_mask=mask,
                          pad_token_id=0)
            if on_gpu and static_cache:
                kwargs["cache_implementation"] = "static"
            return baseline.generate(input_ids, **kwargs)

        with torch.no_grad():
            hf_seconds, hf_out = best_seconds(lambda: hf_run(new_tokens), h.device, repeats=2)
            # prefill + the first token alone: the difference is the time of the other decode steps
            hf_first, _ = best_seconds(lambda: hf_run(1), h.device, repeats=2)
        hf_tps = rows * new_tokens / hf_seconds
        steps = new_tokens - 1
        hf_decode_tps = rows * steps / max(hf_seconds - hf_first, 1e-9)
        case = {"op": "generate_e2e", "model": f"{name}-{params / 1e6:.0f}M random", "batch": rows,
                "dtype": str(dtype)[6:], "new_tokens": new_tokens, **h.meta}
        h.rows.append({**case, "impl": "hf_generate" + ("_static_cache" if on_gpu and static_cache else ""),
                       "tokens_per_s": hf_tps, "decode_tokens_per_s": hf_decode_tps, "speedup_vs_baseline": 1.0})
        # a GPU runs ours compiled (CUDA graphs); a CPU both eager, as the baseline runs, and compiled
        for impl, compiled in [("ours_int8_fused", on_gpu)] + ([] if on_gpu else [("ours_int8_fused_compiled", True)]):
            def ours_run(tokens, compiled=compiled):
                return generate(patched, input_ids, mask, max_new_tokens=tokens, eos_token_id=[], compile=compiled)

            with torch.no_grad():
                ours_seconds, ours_host, ours_out = best_seconds_and_host(lambda: ours_run(new_tokens), h.device,
                                                                          repeats=2)
                ours_first, _ = best_seconds(lambda: ours_run(1), h.device, repeats=2)
            ours_tps = rows * new_tokens / ours_seconds
            ours_decode_tps = rows * steps / max(ours_seconds - ours_first, 1e-9)
            h.rows.append({**case, "impl": impl, "compiled": compiled, "tokens_per_s": ours_tps,
                           "decode_tokens_per_s": ours_decode_tps, "speedup_vs_baseline": ours_tps / hf_tps,
                           "decode_speedup_vs_baseline": ours_decode_tps / hf_decode_tps,
                           # on a GPU, the share of the run the host took to queue it (compiled, no eos:
                           # no step waits for the GPU): near 1, the host set the pace
                           "host_fraction": ours_host / ours_seconds if on_gpu else None,
                           "same_tokens_as_float_baseline": bool(torch.equal(ours_out.sequences, hf_out)),
                           # equal across runs of the same case whose launch choices differ
                           # (GPTFAST_CUDA_PDL, TORCHINDUCTOR_ENABLE_PDL): they change no arithmetic
                           "tokens_digest": tokens_digest(ours_out.sequences),
                           # > 0: some compiled step ran without its CUDA graph (inductor said why in the log)
                           "cudagraph_skips_so_far": counters["inductor"]["cudagraph_skips"],
                           # > 0: some compiled step's graph was recorded again (cuda_graph_records)
                           "cudagraph_recorded_again_so_far": cuda_graph_records.recorded_again()})
