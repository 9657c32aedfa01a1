"""Tiny Hugging Face configs (never downloaded), one per supported family: ``tiny_config``, and the
sizes and per-family overrides it builds them from. python_tests/tiny_models.py builds the models."""

from __future__ import annotations

import pytest
import transformers
from gptfast_kernels.models.families import FAMILIES as FAMILY_TABLE, transformers_before
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers import (AutoConfig, CohereConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig,
                          GlmConfig, GPT2Config, GPTNeoXConfig, GraniteConfig, HeliumConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, OlmoConfig, Olmo2Config, OlmoeConfig, PhiConfig, Phi3Config, Qwen2Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config, Starcoder2Config)

VOCAB = 97
PAD, EOS = 0, 1
# a larger initializer spreads the logits, so float-rounding differences cannot flip an argmax
INIT_RANGE = 0.1
# Sliding windows shorter than the tests' prompts (6 to 12 tokens), so that every family test on
# a windowed family attends through the window; Gemma 2's attention scores (about +-1 in these
# tiny models) are capped at 1, so the tanh changes every one of them.
WINDOW = 4
ATTENTION_SOFTCAP = 1.0
# Llama 4's attention chunks (attention_chunk_size), shorter than the tests' prompts as WINDOW is
CHUNK = 4


def alternating_layers(layers: int) -> list[str]:
    """Gemma-style layer types: local (sliding-window) and global layers in turn, local first."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def alternating_linear(layers: int) -> list[str]:
    """Hybrid layer types: linear-attention (recurrent) and full-attention layers in turn, linear first."""
    return ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def dense_then_sparse(layers: int) -> list[str]:
    """MoE layer types: layer 0 a dense MLP when there are two layers or more, the others experts."""
    return ["dense" if i == 0 and layers > 1 else "sparse" for i in range(layers)]


def kv_sharing_layers(layers: int) -> dict:
    """Local / global layers, at least 4, the last half attending over the keys and values of the last
    earlier layer of its type (Gemma 4, Gemma 3n)."""
    layers = max(layers, 4)
    return dict(num_hidden_layers=layers, sliding_window=WINDOW, layer_types=alternating_layers(layers),
                num_kv_shared_layers=layers // 2)


def gemma4_layers(layers: int) -> dict:
    """Gemma 4's attention: kv_sharing_layers, the global ones with their own head dim and kv heads and keys
    as values (with double-wide MLPs)."""
    return dict(**kv_sharing_layers(layers), global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                use_double_wide_mlp=True)


def gemma3n_layers(layers: int) -> dict:
    """Gemma 3n's: kv_sharing_layers with per-layer embeddings, AltUp and LAuReL; the first half's MLPs
    sparsify their gate (0.9)."""
    shared = kv_sharing_layers(layers)
    sparse = shared["num_hidden_layers"] // 2
    return dict(**shared, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8,
                activation_sparsity_pattern=[0.9] * sparse + [0.0] * (shared["num_hidden_layers"] - sparse))


# Families whose tiny config is the model type's defaults at these sizes plus a few overrides (each a
# function of the layer count): what sets the family apart is in the override's comment.
AUTO_DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=256)
# multi-head latent attention: the latent (32) and rotary key (8) widths, per-head nope (16) and value (12)
# dims, a low-rank query (24); and a MoE of 4 experts, top 2, with one shared expert
MLA_DIMS = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                head_dim=8, v_head_dim=12)  # (head_dim: the rotary embedding's, qk_rope_head_dim)
MLA_EXPERTS = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                   topk_group=1)
AUTO_CONFIGS = {
    # sliding windows: every other layer local (4 tokens), the others global
    "cohere2": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers)),  # no RoPE on global
    "olmo3": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "ministral": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "exaone4": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "cwm": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "vaultgemma": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers),  # soft-capped
                                      query_pre_attn_scalar=16, attn_logit_softcapping=ATTENTION_SOFTCAP),
    "granite_swa": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers),  # sinks
                                       attention_multiplier=0.3),
    # RoPE per layer type: M-RoPE sections on the local layers, none on the global ones (NoPE); logit scale
    "cohere_compass_text": lambda layers: dict(sliding_window=WINDOW, layer_types=alternating_layers(layers),
                                               logit_scale=0.5, rope_parameters=dict(
                                                   sliding_attention=dict(rope_type="default", rope_theta=10000.0,
                                                                          mrope_section=[4, 2, 2]),
                                                   full_attention=None)),
    # dense
    "glm4": lambda layers: {},          # fused gate / up, norms after attention and MLP
    "seed_oss": lambda layers: {},      # biased q / k / v
    "ernie4_5": lambda layers: {},
    "arcee": lambda layers: {},         # ungated ReLU^2 MLP
    "hunyuan_v1_dense": lambda layers: {},  # q / k norms after RoPE
    "apertus": lambda layers: {},       # ungated xIELU MLP, q / k norms
    "jais2": lambda layers: {},         # ungated ReLU^2 MLP, LayerNorms, biases everywhere
    "nanochat": lambda layers: {},      # weightless norms, final-logit soft-capping
    "bitnet": lambda layers: {},        # norms inside attention (before o_proj) and MLP (before down)
    "internlm3": lambda layers: {},     # transformers' Llama model under a config of its own
    "iquestcoder": lambda layers: {},
    "exaone": lambda layers: {},
    # Apertus with its output head pruned to the vocabulary's first ids (logits narrower than the embeddings)
    "apertus1p5_text": lambda layers: dict(output_vocab_size=VOCAB - 16),
    # per-head q / k LayerNorms, q / k / v biases and the parallel residual, all on
    "stablelm": lambda layers: dict(qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=True),
    "nemotron": lambda layers: {},      # LayerNorm1P, ungated ReLU^2 MLP, partial rotary
    # residual and attention multipliers, norms after attention and MLP
    "hyperclovax": lambda layers: dict(attention_multiplier=0.3, residual_multiplier=0.5, embedding_multiplier=2.0),
    # queries scaled by 1 + beta * log(1 + position // 8): the scale changes within the tests' prompts
    "ministral3": lambda layers: dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=8, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)),
    # hybrid: gated-delta-net (linear-attention, recurrent) layers and gated full-attention layers in turn
    "qwen3_5_text": lambda layers: dict(layer_types=alternating_linear(layers), linear_key_head_dim=16,
                                        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_5_moe_text": lambda layers: dict(layer_types=alternating_linear(layers), linear_key_head_dim=16,
                                            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                            shared_expert_intermediate_size=48),
    "qwen3_next": lambda layers: dict(layer_types=alternating_linear(layers), linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=48),
    "olmo_hybrid": lambda layers: dict(layer_types=alternating_linear(layers)),
    # gated-delta-net, sliding-window (RoPE) and full-attention (NoPE) layers, one of each at least; experts
    # beside a shared expert
    "lara_mini": lambda layers: dict(num_hidden_layers=max(layers, 3),
                                     layer_types=(["linear_attention", "sliding_attention", "full_attention"]
                                                  * layers)[:max(layers, 3)],
                                     sliding_window=WINDOW, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=48,
                                     shared_expert_intermediate_size=48),
    # Mamba layers (Jamba's: attention every other layer from 1, experts likewise)
    "jamba": lambda layers: dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                 num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=2,
                                 mamba_dt_rank=8, use_mamba_kernels=False),
    "bamba": lambda layers: dict(attn_layer_indices=list(range(1, layers, 2)), mamba_n_heads=4, mamba_d_head=32,
                                 mamba_d_state=8, mamba_n_groups=1),
    "granitemoehybrid": lambda layers: dict(layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
                                            num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4,
                                            mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1),
    # Mamba-2, MoE and MLP blocks as layers of their own: at least one layer of each kind (4 layers)
    "nemotron_h": lambda layers: dict(num_hidden_layers=max(layers, 4),
                                      layer_types=(["linear_attention", "moe", "full_attention", "mlp"] * layers)[
                                          :max(layers, 4)],
                                      mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
                                      use_mamba_kernels=False),
    # short convolutions
    "lfm2": lambda layers: dict(layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)],
                                full_attn_idxs=list(range(1, layers, 2)), block_ff_dim=128,
                                block_auto_adjust_ff_dim=False, conv_L_cache=3),
    # attention and Mamba-2 side by side in every layer; muP multipliers (1 by default: here not)
    "falcon_h1": lambda layers: dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                                     mamba_n_groups=1, mamba_chunk_size=8, mlp_multipliers=[0.5, 2.0],
                                     key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                                     ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.5], ssm_in_multiplier=1.2,
                                     ssm_out_multiplier=0.9, embedding_multiplier=2.0, lm_head_multiplier=0.5),
    "lfm2_moe": lambda layers: dict(layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)],
                                    num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    conv_L_cache=3),
    # short convolutions (width 7), sliding-window and full-attention layers (one of each at least), gated
    # attention output
    "lfm3": lambda layers: dict(num_hidden_layers=max(layers, 3),
                                layer_types=(["conv", "sliding_attention", "full_attention"] * layers)[:max(layers, 3)],
                                sliding_window=WINDOW),
    # mixture of experts, 4 experts top 2 (GLM-4-MoE and ERNIE-MoE: layer 0 dense, a shared expert)
    "granitemoe": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": lambda layers: dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1),
    "sarvam_moe": lambda layers: dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1),
    "ernie4_5_moe": lambda layers: dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=48, moe_layer_start_index=1,
                                        moe_num_shared_experts=1),
    "flex_olmo": lambda layers: dict(num_experts=4, num_experts_per_tok=2),
    # sparsemixer routing (top 2 only), its router an nn.Linear subclass with its own forward
    "phimoe": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "minimax_m2": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2),  # q / k norms over all heads
    "solar_open": lambda layers: dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      n_shared_experts=1, n_group=1, topk_group=1),
    "dots1": lambda layers: dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "hunyuan_v1_moe": lambda layers: dict(num_experts=4, moe_topk=2),  # an nn.Linear router (stays float)
    "hy_v3": lambda layers: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1,
                                 mlp_layer_types=dense_then_sparse(layers)),  # score-correction bias in routing
    # sliding-window (RoPE) and full-attention (NoPE, queries scaled by position) layers, one of each at least;
    # layer 0 dense, the others experts; final-logit soft-capping
    "beam": lambda layers: dict(num_hidden_layers=max(layers, 2), num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=48, n_group=1, topk_group=1, sliding_window=WINDOW,
                                layer_types=alternating_layers(max(layers, 2)),
                                mlp_layer_types=dense_then_sparse(max(layers, 2))),
    "aria_text": lambda layers: dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
    # mixture of experts with local / global layers
    "kolibri1": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=48, sliding_window=WINDOW,
                                    layer_types=alternating_layers(layers)),
    # also attention sinks, and RoPE on the local layers only
    "flint": lambda layers: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 shared_expert_intermediate_size=48, mlp_only_layers=[0] if layers > 1 else [],
                                 sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "exaone_moe": lambda layers: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      num_shared_experts=1, first_k_dense_replace=1,
                                      mlp_layer_types=dense_then_sparse(layers), sliding_window=WINDOW,
                                      layer_types=alternating_layers(layers)),
    "cohere2_moe": lambda layers: dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                       mlp_layer_types=["sparse"] * layers, sliding_window=WINDOW,
                                       layer_types=alternating_layers(layers)),
    "laguna": lambda layers: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                  shared_expert_intermediate_size=48, mlp_layer_types=dense_then_sparse(layers),
                                  sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    "mellum": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                  mlp_layer_types=["sparse"] * layers, sliding_window=WINDOW,
                                  layer_types=alternating_layers(layers)),
    "granitemoe_swa": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                          layer_types=alternating_layers(layers)),
    "afmoe": lambda layers: dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1,
                                 num_dense_layers=1, sliding_window=WINDOW, layer_types=alternating_layers(layers)),
    # Gemma 4: see gemma4_layers; Gemma 4 also with per-layer embeddings and experts beside the MLP with a
    # router of its own; Gemma 4 unified's text decoder has neither
    "gemma4_text": lambda layers: dict(**gemma4_layers(layers), vocab_size_per_layer_input=VOCAB,
                                       hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4,
                                       top_k_experts=2, moe_intermediate_size=32),
    "gemma4_unified_text": gemma4_layers,
    # Gemma 3n: local / global layers, the last half attending over earlier layers' keys and values (as Gemma
    # 4's), value norms, AltUp, LAuReL and per-layer embeddings; the first half's MLPs sparsify their gate
    # (a Gaussian top-k)
    "gemma3n_text": gemma3n_layers,
    # multi-head latent attention: DeepSeek-V3 and the families on its code (interleaved RoPE), layer 0 dense,
    # the others experts; DeepSeek-V2 with its complex RoPE and a full-rank query (q_proj); MiniCPM3 and
    # Youtu dense, MiniCPM3 with plain RoPE
    "deepseek_v3": lambda layers: dict(**MLA_DIMS, **MLA_EXPERTS, first_k_dense_replace=1),
    "deepseek_v2": lambda layers: {**MLA_DIMS, **MLA_EXPERTS, "first_k_dense_replace": 1, "q_lora_rank": None},
    "glm4_moe_lite": lambda layers: dict(**MLA_DIMS, **MLA_EXPERTS),
    "axk1": lambda layers: dict(**MLA_DIMS, **MLA_EXPERTS),
    # Sarvam-MLA: DeepSeek-V3's code with a full-rank query (q_proj), as its releases
    "sarvam_mla": lambda layers: {**MLA_DIMS, **MLA_EXPERTS, "first_k_dense_replace": 1, "q_lora_rank": None},
    # Kimi Linear: linear-attention (KDA) layers first, then MLA layers without positions; layer 0 dense
    "kimi_linear": lambda layers: {**MLA_DIMS, **MLA_EXPERTS, "num_local_experts": 4, "linear_head_dim": 16,
                                   "linear_num_heads": 4, "layer_types": alternating_linear(layers),
                                   "mlp_layer_types": dense_then_sparse(layers)},
    "minicpm3": lambda layers: dict(**MLA_DIMS),
    "youtu": lambda layers: dict(**MLA_DIMS),
    # Llama 4: layer 0 chunked attention with RoPE (chunks of CHUNK tokens, shorter than the tests'
    # prompts) and a dense MLP, layer 1 full attention without RoPE, its queries scaled from position
    # floor_scale - 1 on, and top-1 experts on router-scaled inputs beside a shared expert
    "llama4_text": lambda layers: dict(intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
                                       num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
                                       no_rope_layers=[int(i % 2 == 0) for i in range(layers)], floor_scale=4,
                                       attn_scale=0.1),
    # compressed convolutional attention (conv and value states in every layer, local / global), top-1 experts
    # or a skip expert, an MLP router
    "zaya": lambda layers: dict(num_experts=4, moe_intermediate_size=48, router_hidden_size=16, sliding_window=WINDOW,
                                layer_types=["hybrid_sliding" if i % 2 == 0 else "hybrid" for i in range(layers)]),
    # attention sinks, local / global layers, experts that stay float
    "gpt_oss": lambda layers: dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                   layer_types=alternating_layers(layers)),
    # values narrower than the keys (16 against 24), twice the kv heads and sinks on local layers, partial
    # rotary (8 of 24), values scaled, a dense first layer then routed experts
    "mimo_v2_flash": lambda layers: dict(head_dim=24, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, sliding_window=WINDOW,
                                         layer_types=alternating_layers(layers)),
}
# Families whose configs name their sizes in their own way: the whole tiny config (a function of the layer count)
OWN_DIMS_CONFIGS = {
    "opt": lambda layers: dict(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_attention_heads=4,
                               num_hidden_layers=layers, max_position_embeddings=256),  # learned positions
    "gpt_bigcode": lambda layers: dict(n_embd=64, n_inner=128, n_head=4, n_layer=layers, n_positions=256,
                                       multi_query=True),  # one KV head
    "persimmon": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_hidden_layers=layers, max_position_embeddings=256,
                                     partial_rotary_factor=0.5),  # q / k LayerNorms, partial rotary
    # local (sliding_window = local_attention / 2) and global layers
    "modernbert-decoder": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                              num_hidden_layers=layers, max_position_embeddings=256,
                                              local_attention=2 * WINDOW, layer_types=alternating_layers(layers),
                                              cls_token_id=EOS, sep_token_id=EOS),
    # interleaved partial rotary (8 of 16), attention and MLP in parallel
    "gptj": lambda layers: dict(n_embd=64, n_inner=128, n_head=4, n_layer=layers, n_positions=256, rotary_dim=8),
    # q / k / v one Linear in model-parallel blocks (mp_num 4), interleaved partial rotary
    "codegen": lambda layers: dict(n_embd=64, n_inner=128, n_head=4, n_layer=layers, n_positions=256, n_ctx=256,
                                   rotary_dim=8),
    # learned positions (offset by 2), scaled embeddings
    "biogpt": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_hidden_layers=layers, max_position_embeddings=256),
    # sinusoidal positions, scaled embeddings
    "ctrl": lambda layers: dict(n_embd=64, dff=128, n_head=4, n_layer=layers, n_positions=256),
    # Falcon-40B's layout: per kv head (2) its group of query heads, then a key and a value head, in one
    # fused projection; attention and MLP in parallel with norms of their own (the other layouts:
    # test_patch.py's Falcon test)
    "falcon": lambda layers: dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=layers,
                                  max_position_embeddings=256, new_decoder_architecture=True, num_kv_heads=2,
                                  alibi=False, bias=True),
    # local (windowed) and global layers in turn, unscaled scores, learned positions
    "gpt_neo": lambda layers: dict(hidden_size=64, num_heads=4, num_layers=layers, intermediate_size=128,
                                   max_position_embeddings=256, window_size=WINDOW,
                                   attention_types=[[["local", "global"], layers // 2], [["local"], layers % 2]]),
    # ALiBi (12 heads: not a power of two, so the slopes come from two geometric series, the second's no
    # powers of two), the residual added inside the attention, an embedding LayerNorm, an untied head
    "bloom": lambda layers: dict(hidden_size=96, n_head=12, n_layer=layers, tie_word_embeddings=False),
    # ALiBi (transformers' MPT slopes for 12 heads: 2^-1 .. 2^-8, and 4 between them, no powers of two),
    # clipped q / k / v, no biases
    "mpt": lambda layers: dict(d_model=96, n_heads=12, n_layers=layers, expansion_ratio=2, max_seq_len=256,
                               attn_config=dict(clip_qkv=6.0)),
    # sinusoidal positions (offset by 2), scaled embeddings, LayerNorms
    "xglm": lambda layers: dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=layers,
                                max_position_embeddings=256),
    # attention-free: Mamba blocks alone (Mamba-2's multi-head, chunked scan)
    "mamba": lambda layers: dict(hidden_size=64, num_hidden_layers=layers, state_size=8, expand=2),
    "falcon_mamba": lambda layers: dict(hidden_size=64, num_hidden_layers=layers, state_size=8, expand=2),
    "mamba2": lambda layers: dict(hidden_size=64, num_hidden_layers=layers, num_heads=8, head_dim=16, state_size=8,
                                  n_groups=1, expand=2, chunk_size=8),
    # Mamba-2 layers, the last three ("hybrid") each after a shared transformer block: blocks A, B, A (two
    # blocks in turn, weights tied), per-use adapters, RoPE; attention over 2 x hidden (heads of 32)
    "zamba2": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=1, num_mem_blocks=2,
                                  adapter_rank=8, use_mem_rope=True, chunk_size=8, max_position_embeddings=256,
                                  num_hidden_layers=max(layers, 4),
                                  layers_block_type=["linear_attention"] * (max(layers, 4) - 3) + ["hybrid"] * 3),
    # the same with Mamba layers (2 heads) and one shared block (a gated MLP), used by layers 0, 1 and 3 of 4 (a
    # draft of the first 2 layers keeps 2 uses: transformers cannot build a Zamba with one)
    "zamba": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 n_mamba_heads=2, mamba_d_state=8, use_mamba_kernels=False, max_position_embeddings=256,
                                 num_hidden_layers=max(layers, 4),
                                 layers_block_type=(["hybrid", "hybrid", "linear_attention", "hybrid"]
                                                    + ["linear_attention"] * layers)[:max(layers, 4)]),
    # nGPT with a looped section: an input layer, 2 recurrent layers run twice (each run with its own keys and
    # values: per_loop), an output layer; local / global layers in turn
    "dory": lambda layers: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, num_hidden_layers=4, n_input_layers=1, n_output_layers=1,
                                n_recurrent_loops=2, sliding_window=WINDOW, layer_types=alternating_layers(4),
                                max_position_embeddings=256),
    # mixture of experts (w1 / v1 / w2 weights), clipped q / k / v, an nn.Linear router
    "dbrx": lambda layers: dict(d_model=64, n_heads=4, n_layers=layers, max_seq_len=256,
                                attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                ffn_config=dict(hidden_size=64, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2)),
}


def tiny_config(family: str, *, layers: int = 2, vocab: int = VOCAB, **overrides):
    common = dict(vocab_size=vocab, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
                  initializer_range=INIT_RANGE)
    if family == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, **common)
    elif family == "mistral":
        config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                               max_position_embeddings=256, **common)
    elif family == "qwen2":  # sliding window from layer 1 on (max_window_layers), layer 0 global
        config = Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=6,
                             num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1, **common)
    elif family == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=256, **common)
    elif family == "gpt_neox":
        config = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=256, **common)
    elif family == "qwen3":  # q / k norms; head_dim x heads != hidden
        config = Qwen3Config(hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **common)
    elif family == "gemma":  # scaled embeddings, GELU gate, head_dim x heads != hidden, one KV head
        config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=32, max_position_embeddings=256, **common)
    elif family == "gemma2":  # local / global layers, attention and final-logit soft-capping
        config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                              layer_types=alternating_layers(layers), attn_logit_softcapping=ATTENTION_SOFTCAP,
                              final_logit_softcapping=30.0, max_position_embeddings=256, **common)
    elif family == "gemma3_text":  # local / global layers with their own RoPE, q / k norms
        config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=WINDOW, layer_types=alternating_layers(layers),
                                  max_position_embeddings=256, **common)
    elif family == "olmo2":  # q / k norms over all heads, norms after attention and MLP
        config = Olmo2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, **common)
    elif family == "granite":  # attention scale other than D ** -0.5, embedding / residual / logit scales
        config = GraniteConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256, attention_multiplier=0.3,
                               embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, **common)
    elif family == "phi3":  # q / k / v and gate / up as single Linears
        config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=256,
                            sliding_window=WINDOW, **common)
    elif family == "cohere":  # attention and MLP in parallel, logit scale, tied head
        config = CohereConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256, logit_scale=0.5, **common)
    elif family == "olmo":  # non-parametric layer norms
        config = OlmoConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, **common)
    elif family == "helium":
        config = HeliumConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **common)
    elif family == "smollm3":  # layer 1 without RoPE (NoPE)
        config = SmolLM3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256,
                               no_rope_layers=[int(i % 2 == 0) for i in range(layers)], **common)
    elif family == "glm":  # fused gate / up; head_dim x heads != hidden; partial rotary
        config = GlmConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=256, **common)
    elif family == "phi":  # partial rotary, parallel attention and MLP, ungated MLP
        config = PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5, **common)
    elif family == "starcoder2":  # biases, ungated MLP
        config = Starcoder2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  sliding_window=WINDOW, **common)
    elif family == "mixtral":  # 4 experts, top 2
        config = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=256, sliding_window=None, **common)
    elif family == "qwen2_moe":  # a gated shared expert besides the routed ones; biased q / k / v
        config = Qwen2MoeConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=6,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=80, max_position_embeddings=256, **common)
    elif family == "qwen3_moe":  # layer 0 a dense MLP, layer 1 sparse; q / k norms; unnormalised top-k
        config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
                                max_position_embeddings=256, **common)
    elif family == "olmoe":  # 8 experts, top 2; q / k norms
        config = OlmoeConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=256, **common)
    elif family in AUTO_CONFIGS or family in OWN_DIMS_CONFIGS:
        if family not in CONFIG_MAPPING_NAMES:  # newer than the installed transformers
            pytest.skip(f"transformers {transformers.__version__} has no {family!r} models")
        first = FAMILY_TABLE[family].supported_from
        if first and transformers_before(first):
            pytest.skip(f"gptfast_kernels supports {family!r} from transformers {first} on")
        if family in AUTO_CONFIGS:  # (an override may change the layer count)
            sizes = {**dict(num_hidden_layers=layers, **AUTO_DIMS), **AUTO_CONFIGS[family](layers)}
        else:
            sizes = OWN_DIMS_CONFIGS[family](layers)
        config = AutoConfig.for_model(family, **sizes, **common)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
