"""Llama 4 (transformers' ``llama4_text``: Llama4ForCausalLM) over a StaticKVCache.

Three things set its text model apart, and each gets a forward of ours once patched:

- **Chunked attention.** Its RoPE layers ("chunked_attention" in ``layer_types``) cut the sequence
  into chunks of ``attention_chunk_size`` tokens (8192), and a token attends only to its own
  chunk's tokens up to itself: ``kv_cache_attention(..., chunk_size=C)``. transformers expresses
  that as a mask, which the fused path does not build, so the attention forward below passes the
  chunk size to the attention function itself.
- **Query temperature on the NoPE layers.** Layers without RoPE scale each query by
  1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at its position p. transformers takes p
  from one past length for the whole batch (``get_seq_length``); rows of a StaticKVCache sit at
  positions of their own (ragged prompts, speculative rounds that accepted different numbers of
  drafts), so ours takes each row's own positions. For a batch without padding the two agree.
- **Experts on router-scaled inputs.** Llama4TextMoe multiplies each token by the sigmoid of its
  chosen experts' router logits *before* the experts (not their outputs, as other MoE models do),
  and runs every expert densely on every token (zero inputs where not chosen). With int8 it becomes
  ``Int8Llama4Moe``: the chosen (token, expert) rows alone through ``Int8Experts`` (int8 weights,
  one ``int8_expert_linear`` launch per projection in a decode step), plus the shared expert.

Called without a StaticKVCache the attention module runs transformers' forward.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from gptfast_kernels.modules.int8_experts import HalvesGating, Int8Experts, quantize_expert_weights
from gptfast_kernels.modules.static_kv_cache import attention_chunks

ATTENTION_CLASS = "Llama4TextAttention"
MOE_CLASS = "Llama4TextMoe"


def patch_llama4_(model: nn.Module, int8: bool, skip: tuple[str, ...] = ()) -> None:
    """In place: the attention modules get ``attention_forward`` and their layer's chunk (the one the
    StaticKVCache sizes chunked layers by: ``attention_chunks``); with ``int8`` every MoE block
    becomes an Int8Llama4Moe (after patch_model's int8 pass, which left its router float and made
    its shared expert int8)."""
    chunks = attention_chunks(model.config)
    for module in model.modules():
        if type(module).__name__ == ATTENTION_CLASS:
            module._gptfast_chunk = chunks[module.layer_idx]
            module.forward = types.MethodType(attention_forward, module)
    if int8:
        blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ == MOE_CLASS]
        for name, module in blocks:
            model.set_submodule(name, Int8Llama4Moe.from_float(module))


def query_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """positions [B, T] (-1: padding) -> [B, T] float32: Llama 4's query scale on NoPE layers,
    1 + attn_scale * log1p(floor((p + 1) / floor_scale)) (computed as transformers does)."""
    positions = positions.clamp(min=0).to(torch.float32)
    return torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0


def attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, *args, **kwargs):
    """A Llama4TextAttention's forward: hidden_states [B, T, hidden] -> ([B, T, hidden], None). With a
    StaticKVCache (the ``gptfast_cache`` keyword a patched model passes): per-row query temperature
    and the chunk size reach the fused attention; else transformers' forward."""
    cache = kwargs.get("gptfast_cache")
    if cache is None:
        # (the cache, positional or by keyword: ``past_key_values`` before transformers 5.24, ``cache`` from it)
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    code = sys.modules[type(self).__module__]
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)
    key = self.k_proj(hidden_states).view(hidden_shape)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if self.use_rope:
        query, key = code.apply_rotary_emb(query, key, position_embeddings.to(query.device))
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        scales = query_temperature(cache.step_positions(), self.floor_scale, self.attn_scale)
        query = (query * scales[..., None, None]).to(query.dtype)
    attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, _ = attend(self, query.transpose(1, 2), key.transpose(1, 2), value, None, scaling=self.scaling,
                    attention_chunk_size=self._gptfast_chunk, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class Int8Llama4Moe(nn.Module):
    """Llama4TextMoe with int8 experts: ``router`` (float, Llama4Router: an nn.Linear), ``experts``
    (an Int8Experts of gate / up halves and SiLU), ``shared_expert`` (its MLP, int8 as patched).
    forward(hidden [..., H]) -> ([tokens, H], router logits [tokens, E]), as Llama4TextMoe."""

    def __init__(self, router: nn.Linear, experts: Int8Experts, shared_expert: nn.Module, top_k: int):
        super().__init__()
        self.router, self.experts, self.shared_expert, self.top_k = router, experts, shared_expert, top_k

    @classmethod
    def from_float(cls, moe: nn.Module) -> "Int8Llama4Moe":
        experts = moe.experts  # gate_up_proj [E, H, 2I] (gate then up), down_proj [E, I, H]: inputs first
        int8_experts = Int8Experts(quantize_expert_weights(experts.gate_up_proj, transposed=True),
                                   quantize_expert_weights(experts.down_proj, transposed=True),
                                   HalvesGating(experts.act_fn))
        return cls(moe.router, int8_experts, moe.shared_expert, moe.top_k)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_logits = nn.Linear.forward(self.router, x)
        top_logits, top_experts = torch.topk(router_logits, self.top_k, dim=1)
        # each chosen expert sees the token scaled by its sigmoid score (in the activations' dtype, as
        # transformers); an expert's output is not weighted again
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)
        rows = (x[:, None, :] * scores[..., None]).reshape(-1, x.shape[-1])  # row t * k + j: token t, expert j
        routed = self.experts.run(rows, top_experts.reshape(-1)).view(x.shape[0], self.top_k, -1).sum(dim=1)
        return self.shared_expert(x) + routed, router_logits
