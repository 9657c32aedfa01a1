"""Tiny Hugging Face models built from configs (never downloaded), one per supported family."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import transformers
from gptfast_kernels.models.families import FAMILIES as FAMILY_TABLE, transformers_before
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers import (AutoConfig, AutoModelForCausalLM, CohereConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig,
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
    # sinusoidal positions (offset by 2), scaled embeddings, LayerNorms
    "xglm": lambda layers: dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=layers,
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


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "cohere",
            "olmo", "helium", "smollm3", "phi3", "glm", "phi", "starcoder2", "gpt2", "gpt_neox", "mixtral", "qwen2_moe",
            "qwen3_moe", "olmoe", *AUTO_CONFIGS, *OWN_DIMS_CONFIGS)
# mixture-of-experts families (their experts become Int8Experts; GPT-OSS's are biased, transposed, with
# gate / up interleaved and a clamped gate)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "ernie4_5_moe", "flex_olmo", "gpt_oss",
       "granitemoeshared", "minimax_m2", "solar_open", "dots1", "hunyuan_v1_moe", "exaone_moe", "cohere2_moe", "laguna",
       "mellum", "granitemoe_swa", "afmoe", "hy_v3", "aria_text", "kolibri1", "flint", "qwen3_5_moe_text", "qwen3_next",
       "jamba", "granitemoehybrid", "nemotron_h", "lfm2_moe", "dbrx", "phimoe", "gemma4_text", "deepseek_v3", "zaya",
       "deepseek_v2", "glm4_moe_lite", "axk1", "llama4_text", "kimi_linear", "mimo_v2_flash", "lara_mini",
       "sarvam_moe", "sarvam_mla")
# families with multi-head latent attention (their caches hold one latent per token)
LATENT = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "axk1", "minicpm3", "youtu", "kimi_linear", "sarvam_mla")
# families whose tiny configs attend through sliding windows (WINDOW) in some or all layers
WINDOWED = ("mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "starcoder2", "cohere2", "olmo3", "ministral",
            "exaone4", "gpt_oss", "exaone_moe", "cohere2_moe", "laguna", "mellum", "granitemoe_swa", "afmoe", "cwm",
            "vaultgemma", "granite_swa", "kolibri1", "flint", "lfm3", "gemma4_text", "gemma4_unified_text",
            "gemma3n_text", "modernbert-decoder", "zaya", "mimo_v2_flash", "gpt_neo", "cohere_compass_text",
            "lara_mini")
# families whose tiny configs' last 2 of 4 layers attend over the first 2's keys and values (Gemma 4)
KV_SHARING = ("gemma4_text", "gemma4_unified_text", "gemma3n_text")
# hybrid families (recurrent layers: no speculative decoding, no right padding)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "jamba", "bamba", "granitemoehybrid",
          "nemotron_h", "lfm2", "lfm2_moe", "lfm3", "falcon_h1", "zaya", "kimi_linear", "lara_mini")
# hybrids whose layers run attention and a recurrent block side by side (every layer has both caches)
PARALLEL_HYBRID = ("falcon_h1", "zaya")
# families whose tiny configs soft-cap attention scores (ATTENTION_SOFTCAP) or have attention sinks
SOFTCAPPED = ("gemma2", "vaultgemma")
WITH_SINKS = ("gpt_oss", "granitemoe_swa", "granite_swa", "flint", "mimo_v2_flash")
# families whose transformers models take some position-dependent quantity from a token's index in the
# padded batch rather than its position (Llama 4's query temperature on NoPE layers): against them, rows
# are padded on the right, where the two agree
INDEX_POSITIONED = ("llama4_text",)
# families whose MLP has separate gate / up projections and whose attention separate q / k / v ones
SEPARATE_PROJECTIONS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite",
                        "cohere", "olmo", "helium", "smollm3")


# transformers 5.8 to 5.17 (at least) defaults Gemma 2 to SDPA, which drops its attention soft-capping: the
# reference model must run eager attention, as transformers recommends for Gemma 2
REFERENCE_ATTENTION = {"gemma2": "eager", "gpt_oss": "eager",  # GPT-OSS, MiMo-V2-Flash: SDPA would drop sinks
                       "vaultgemma": "eager", "mimo_v2_flash": "eager"}


# standard deviation of the random biases tiny models get (of the same order as their weights', INIT_RANGE)
BIAS_STD = 0.1


def experts_per_token(config) -> int:
    """The top-k of a mixture-of-experts config (Aria's is moe_topk, Gemma 4's top_k_experts, DBRX's in
    its ffn_config)."""
    if hasattr(config, "ffn_config"):
        return config.ffn_config.moe_top_k
    for name in ("num_experts_per_tok", "top_k_experts"):
        if hasattr(config, name):
            return getattr(config, name)
    return config.moe_topk


def tiny_model(family: str, *, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    options = {"attn_implementation": REFERENCE_ATTENTION[family]} if family in REFERENCE_ATTENTION else {}
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), **options).eval()
    # transformers initialises biases, attention sinks, some routers and routers' score-correction biases to
    # zero: trained ones are not, and the tests must see them (a zero router ties every expert; a zero
    # sink or bias hides a path that drops it)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            zero_parameter = isinstance(tensor, torch.nn.Parameter) and not tensor.any()
            if tensor.dim() >= 1 and tensor.is_floating_point() and (
                    name.endswith(("bias", "correction_bias")) or zero_parameter):
                tensor.normal_(0.0, BIAS_STD)
    return model


def dequantized_copy(model):
    """A copy of ``model`` whose Linear / Conv1D weights and 3-D expert weights are rounded to int8 and
    back (per output channel, as patch_model's int8 does): patched int8 logits must equal its logits
    up to float summation order, routing included (the routers are not rounded)."""
    from transformers.pytorch_utils import Conv1D

    from gptfast_kernels.modules.int8_experts import Int8Experts
    from gptfast_kernels.ops import reference

    def rounded(weight):  # [..., N, K]
        flat = weight.reshape(-1, weight.shape[-1])
        qweight, scales = reference.quantize_int8(flat)
        return (qweight.float() * scales[:, None]).to(weight.dtype).reshape(weight.shape)

    def rounded_experts(weight, transposed):  # [E, N, K], or [E, K, N] transposed (GPT-OSS)
        return rounded(weight.transpose(1, 2)).transpose(1, 2) if transposed else rounded(weight)

    from gptfast_kernels.models.families import family_of

    from gptfast_kernels.modules.int8_linear import _plain_linear, _skipped

    family = family_of(model.config)
    experts = family.experts_classes
    copy_ = copy.deepcopy(model)
    for name, module in copy_.named_modules():
        if _skipped(name, family.float_linears):  # what patch_model keeps float (routers)
            continue
        # new Parameters, not in-place writes: a head tied to the input embeddings must not round them
        # not nn.Linear subclasses with a forward of their own (PhiMoE's router), but for a family's plain ones
        if _plain_linear(module, family.linear_subclasses):
            module.weight = torch.nn.Parameter(rounded(module.weight.data))
        elif isinstance(module, Conv1D):  # weight [in, out]
            module.weight = torch.nn.Parameter(rounded(module.weight.data.t()).t().contiguous())
        elif type(module).__name__ in experts and hasattr(module, "mlp"):  # DBRX: w1 / v1 / w2 [E * I, H]
            mlp, E = module.mlp, module.num_experts
            mlp.w1.data, mlp.v1.data = rounded(mlp.w1.data), rounded(mlp.v1.data)  # rows: output channels
            mlp.w2.data = rounded_experts(mlp.w2.data.view(E, -1, mlp.w2.shape[1]), True).reshape(mlp.w2.shape)
        elif type(module).__name__ == "Llama4TextExperts":  # [E, H, 2I] / [E, I, H]: inputs first (Int8Llama4Moe)
            module.gate_up_proj.data = rounded_experts(module.gate_up_proj.data, True)
            module.down_proj.data = rounded_experts(module.down_proj.data, True)
        elif type(module).__name__ in experts and Int8Experts.supports(module):  # what patch_model makes int8
            transposed = getattr(module, "is_transposed", False)  # biases stay float, as in Int8Experts
            first = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj  # ungated: up
            first.data = rounded_experts(first.data, transposed)
            module.down_proj.data = rounded_experts(module.down_proj.data, transposed)
    return copy_


def record_caches(monkeypatch, module: str) -> list:
    """Makes the generation module ``module``'s ``cache_for`` ("gptfast_kernels.generation.speculative",
    ...) append every cache it allocates to the returned list. (By module object: the package's
    ``generate`` attribute is the function, not its module.)"""
    from gptfast_kernels.generation import forward

    caches = []
    cache_for = forward.cache_for
    monkeypatch.setattr(sys.modules[module], "cache_for",
                        lambda *args, **kwargs: caches.append(cache_for(*args, **kwargs)) or caches[-1])
    return caches


def stepwise_logits(model, ids, cache, prompt: int):
    """``ids``' first ``prompt`` columns in one forward through ``cache``, then one decode step per
    further column -> the logits of every column, [B, T, V]."""
    with torch.no_grad():
        steps = [model(ids[:, :prompt], past_key_values=cache).logits]
        steps += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, dim=1)


def patched_copy(model, **kwargs):
    from gptfast_kernels import patch_model

    return patch_model(copy.deepcopy(model), **kwargs)


def ragged_prompts(batch: int, length: int, side: str, *, seed: int = 0, vocab: int = VOCAB):
    """input_ids [B, length] with rows of different real lengths padded on ``side``, and the mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = (b * 2) % length if b else 0
        if side == "left":
            mask[b, :pad] = 0
        else:
            mask[b, length - pad:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def draft_of(target, layers: int = 1):
    """A draft that shares the target's embeddings, head and first ``layers`` blocks: it agrees
    with the target often but not always, like a real draft model."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "num_kv_shared_layers", 0):  # Gemma 4: the draft's layers keep their own keys and values
        config.num_kv_shared_layers = 0
    draft = AutoModelForCausalLM.from_config(config).eval()
    own = draft.state_dict()
    # tables packing every layer's part (Gemma 4's per-layer embeddings, layer after layer): the first layers'
    state = {name: tensor[tuple(slice(0, n) for n in own[name].shape)] if name in own else tensor
             for name, tensor in target.state_dict().items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert not missing, missing
    return draft


def hf_greedy(model, ids, mask, new: int, **kwargs):
    """transformers' own greedy generate, the reference our decoding is compared with."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


class RecordingStreamer:
    """A transformers-style streamer that keeps what it was given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert self.ended == 0, "put after end"
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1
