"""Tiny Hugging Face models built from configs (never downloaded), one per supported family; the
family lists the tests run over, and helpers comparing patched models with transformers'."""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AutoModelForCausalLM

# (some re-exported: tests import the configs' constants from here too)
from python_tests.tiny_configs import (  # noqa: F401
    ATTENTION_SOFTCAP, AUTO_CONFIGS, CHUNK, EOS, MLA_DIMS, OWN_DIMS_CONFIGS, PAD, VOCAB, WINDOW, tiny_config)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "cohere",
            "olmo", "helium", "smollm3", "phi3", "glm", "phi", "starcoder2", "gpt2", "gpt_neox", "mixtral", "qwen2_moe",
            "qwen3_moe", "olmoe", *AUTO_CONFIGS, *OWN_DIMS_CONFIGS)
# mixture-of-experts families (their experts become Int8Experts; GPT-OSS's are biased, transposed, with
# gate / up interleaved and a clamped gate)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "ernie4_5_moe", "flex_olmo", "gpt_oss",
       "granitemoeshared", "minimax_m2", "solar_open", "dots1", "hunyuan_v1_moe", "exaone_moe", "cohere2_moe", "laguna",
       "mellum", "granitemoe_swa", "afmoe", "hy_v3", "beam", "aria_text", "kolibri1", "flint", "qwen3_5_moe_text",
       "qwen3_next",
       "jamba", "granitemoehybrid", "nemotron_h", "lfm2_moe", "dbrx", "phimoe", "gemma4_text", "deepseek_v3", "zaya",
       "deepseek_v2", "glm4_moe_lite", "axk1", "llama4_text", "kimi_linear", "mimo_v2_flash", "lara_mini",
       "sarvam_moe", "sarvam_mla")
# families with multi-head latent attention (their caches hold one latent per token)
LATENT = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "axk1", "minicpm3", "youtu", "kimi_linear", "sarvam_mla")
# families whose tiny configs attend through sliding windows (WINDOW) in some or all layers
WINDOWED = ("mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "starcoder2", "cohere2", "olmo3", "ministral",
            "exaone4", "gpt_oss", "exaone_moe", "cohere2_moe", "laguna", "mellum", "granitemoe_swa", "afmoe", "cwm",
            "vaultgemma", "granite_swa", "kolibri1", "flint", "beam", "lfm3", "gemma4_text", "gemma4_unified_text",
            "gemma3n_text", "modernbert-decoder", "zaya", "mimo_v2_flash", "gpt_neo", "cohere_compass_text",
            "lara_mini", "dory")
# families whose tiny configs' last 2 of 4 layers attend over the first 2's keys and values (Gemma 4)
KV_SHARING = ("gemma4_text", "gemma4_unified_text", "gemma3n_text")
# hybrid families (recurrent layers: no right padding; speculative rounds roll their states back through the
# cache's state history)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "jamba", "bamba", "granitemoehybrid",
          "nemotron_h", "lfm2", "lfm2_moe", "lfm3", "falcon_h1", "zaya", "kimi_linear", "lara_mini", "mamba",
          "falcon_mamba", "mamba2", "zamba2", "zamba")
# attention-free families (recurrent layers alone: Mamba), among HYBRID
ATTENTION_FREE = ("mamba", "falcon_mamba", "mamba2")
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
    return draw_zero_initialised_(model)


def draw_zero_initialised_(model):
    """transformers initialises biases, attention sinks, some routers and routers' score-correction
    biases to zero: trained ones are not, and the tests must see them (a zero router ties every
    expert; a zero sink or bias hides a path that drops it). Draws them, in place; -> ``model``."""
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
        # (Dory's output head: int8 as models/dory.py's Int8DoryLMHead, its logit scale float)
        if _plain_linear(module, family.linear_subclasses) or type(module).__name__ == "DoryLMHead":
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


def left_pad(ids, mask):
    """The same prompts left-padded (transformers only generates correctly from left padding)."""
    out_ids, out_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for b in range(ids.shape[0]):
        real = ids[b][mask[b] == 1]
        out_ids[b, ids.shape[1] - len(real):] = real
        out_mask[b, ids.shape[1] - len(real):] = 1
    return out_ids, out_mask


def draft_of(target, layers: int = 1):
    """A draft that shares the target's embeddings, head and first ``layers`` blocks: it agrees
    with the target often but not always, like a real draft model."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "num_kv_shared_layers", 0):  # Gemma 4: the draft's layers keep their own keys and values
        config.num_kv_shared_layers = 0
    if config.model_type in ("zamba", "zamba2"):  # Zamba builds its layers from its layer types
        config.layers_block_type = config.layers_block_type[:layers]
        if hasattr(config, "hybrid_layer_ids"):
            config.hybrid_layer_ids = [i for i in config.hybrid_layer_ids if i < layers]
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
