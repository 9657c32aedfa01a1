"""Multi-head latent attention (MLA: DeepSeek-V2 / V3 and the families built on them) over a
StaticKVCache, with the up-projections absorbed.

transformers caches MLA's compressed latents (the normed ``kv_nope`` [B, 1, T, r] and the rotated
shared key ``k_rot`` [B, 1, T, dr]) and, every step, expands the whole cache through ``kv_b_proj``
into per-head keys and values: S x r x H (dn + dv) multiply-adds per layer and token. Absorbed, as
DeepSeek's own inference does, nothing is expanded: ``kv_b_proj``'s weight is per head a key part
W_k [dn, r] and a value part W_v [dv, r], and

    q_nope . (W_k c) = (q_nope W_k) . c        softmax(s) (W_v c) = W_v (softmax(s) c)

so each head's query becomes [q_nope W_k, q_rot] (r + dr wide) against one shared "kv head"
[c, k_rot] per token, and the attention's output over c goes through W_v once per query. That is
multi-query attention with head dim r + dr (576 for DeepSeek-V3), which ``kv_cache_attention`` runs
as it runs any layer: it writes the new latents at the step's positions and attends. The values
are the keys' first r numbers, the latent c itself (the kernel's ``value_dim``), so the cache holds
one [c, k_rot] row per token and layer, r + dr numbers, and no per-head keys or values.

With int8 weights ``kv_b_proj`` is an Int8Linear like the other projections (quantized per output
channel, i.e. per (head, row of W_k or W_v)), and both absorbed products run as one
``int8_expert_linear`` call each, the head as the expert: per head, W_v [dv, r] is an int8 weight
with its own per-row scales, and W_k [dn, r] is read transposed, [r, dn] (a copy made when the
model is patched), its per-row scales then scaling the query's input features instead, in float32:
q_nope diag(s) W_kq = q_nope W_k. The query and output of every head go through the int8 weights
of their own head only, each read once per step, in int8.

``patch_model`` gives each MLA attention module this forward; called without a StaticKVCache it
is transformers' own.
"""

from __future__ import annotations

import sys
import types

import torch

from gptfast_kernels.models import attention
from gptfast_kernels.modules.int8_linear import Int8Linear
from gptfast_kernels.ops.int8_expert_linear import int8_expert_linear

# Family.latent_attention: how the family's code rotates q_rot / k_rot
COMPLEX_ROPE = "complex"   # DeepSeek-V2: apply_rotary_emb(q, k, freqs_cis), position_embeddings complex
COS_SIN_ROPE = "cos_sin"   # the others: apply_rotary_pos_emb(q, k, cos, sin), or its _interleave variant
NO_ROPE = "none"           # Kimi Linear: MLA without positions (its linear-attention layers carry order)
ROPES = (COMPLEX_ROPE, COS_SIN_ROPE, NO_ROPE)


def latent_head_dim(config) -> int:
    """The head dim of an MLA layer's cache: the latent's width r plus the shared rotary key's dr."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def patch_latent_attention_(model, attention_class: str, rope: str) -> int:
    """In place: every module of class name ``attention_class`` runs ``latent_forward`` (transformers'
    forward without a StaticKVCache). Returns how many modules."""
    patched = 0
    for module in model.modules():
        if type(module).__name__ != attention_class:
            continue
        kv_b_proj = module.kv_b_proj
        if kv_b_proj.bias is not None or not isinstance(kv_b_proj, (torch.nn.Linear, Int8Linear)):
            raise ValueError(f"patch_model: {attention_class}.kv_b_proj must be a bias-free nn.Linear (or its "
                             "Int8Linear), whose weight the absorbed attention reads")
        if isinstance(kv_b_proj, Int8Linear):
            _absorb_int8_(module)
        module._gptfast_rope = rope
        module.forward = types.MethodType(latent_forward, module)
        patched += 1
    return patched


def _absorb_int8_(module) -> None:
    """The per-head int8 weights of an Int8Linear kv_b_proj ([H (dn + dv), r]), as buffers of the
    attention module (not saved in its state dict): W_k transposed [H, r, dn] with unit scales, the
    key rows' scales [H, dn] (they scale the query's features), W_v [H, dv, r] with its scales [H, dv],
    and the head indices 0..H-1 (the experts of one token's H rows)."""
    H, dn, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    qweight = module.kv_b_proj.qweight.view(H, dn + dv, -1)
    scales = module.kv_b_proj.scales.to(torch.float32).view(H, dn + dv)
    buffers = {"_gptfast_wk_t": qweight[:, :dn].transpose(1, 2), "_gptfast_wk_scales": scales[:, :dn],
               "_gptfast_wk_ones": scales.new_ones(H, qweight.shape[-1]),
               "_gptfast_wv": qweight[:, dn:], "_gptfast_wv_scales": scales[:, dn:],
               "_gptfast_heads": torch.arange(H, device=qweight.device)}
    for name, value in buffers.items():
        module.register_buffer(name, value.contiguous(), persistent=False)


def _per_head(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, K] -> [B, T, H, N]: head h's rows through its int8 weight[h] [N, K] (int8_expert_linear,
    the head as the expert: ``experts`` [B T H] = 0..H-1 per token)."""
    rows = x.reshape(-1, x.shape[-1])
    return int8_expert_linear(rows, weight, scales, experts, check_experts=False).view(*x.shape[:-1], -1)


def _rotate(module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings):
    """The family's own rotary embedding of q_rot [B, H, T, dr] and k_rot [B, 1, T, dr]."""
    if module._gptfast_rope == NO_ROPE:
        return q_rot, k_rot
    code = sys.modules[type(module).__module__]
    if module._gptfast_rope == COMPLEX_ROPE:
        return code.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))
    cos, sin = position_embeddings
    if getattr(module.config, "rope_interleave", False):
        return code.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return code.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)


def latent_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """An MLA module's forward: hidden_states [B, T, hidden] -> ([B, T, hidden], None). With a
    StaticKVCache (the ``gptfast_cache`` keyword a patched model passes) the absorbed attention
    through ``kv_cache_attention``; else transformers' forward."""
    cache = kwargs.get("gptfast_cache")
    if cache is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if "position_embeddings" not in kwargs and self._gptfast_rope != NO_ROPE:
        raise ValueError(f"patch_model: {type(self).__name__} was called without position_embeddings as a keyword")
    B, T = hidden_states.shape[:2]
    H, dn, dv, r = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, T, H, dn + self.qk_rope_head_dim).transpose(1, 2)
    q_nope, q_rot = q.split([dn, self.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([r, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, T, r)
    k_rot = k_rot.view(B, 1, T, self.qk_rope_head_dim)
    q_rot, k_rot = _rotate(self, q_rot, k_rot, kwargs.get("position_embeddings"))
    int8 = isinstance(self.kv_b_proj, Int8Linear)
    if int8:  # q_nope W_k per head: the key rows' scales scale q_nope's features (float32), then W_k^T in int8
        experts = self._gptfast_heads.repeat(B * T)  # rows (token, head) of both products
        scaled = q_nope.transpose(1, 2).to(torch.float32) * self._gptfast_wk_scales  # [B, T, H, dn]
        absorbed = _per_head(scaled, self._gptfast_wk_t, self._gptfast_wk_ones, experts)
        absorbed = absorbed.to(q_nope.dtype).transpose(1, 2)                          # [B, H, T, r]
    else:  # kv_b_proj's weight [H (dn + dv), r], per head its key rows then its value rows
        weight = self.kv_b_proj.weight.view(H, dn + dv, r)
        w_k, w_v = weight[:, :dn], weight[:, dn:]
        absorbed = torch.matmul(q_nope, w_k.to(q_nope.dtype))                          # [B, H, T, r]
    query = torch.cat([absorbed, q_rot], dim=-1)                                        # [B, H, T, r + dr]
    latent = torch.cat([kv_nope, k_rot.to(kv_nope.dtype)], dim=-1)                    # [B, 1, T, r + dr]
    backend = "reference" if self.config._attn_implementation == attention.UNFUSED else "auto"
    # the cache's layer takes values in its keys: the output is over the latents' first r numbers alone
    out, _ = attention._cached_attention(self, query, latent, None, None, backend=backend, scaling=self.scaling,
                                         gptfast_cache=cache)                        # [B, T, H, r]
    if int8:
        out = _per_head(out, self._gptfast_wv, self._gptfast_wv_scales, experts)    # [B, T, H, dv]
    else:
        out = torch.matmul(out.transpose(1, 2), w_v.transpose(1, 2).to(out.dtype)).transpose(1, 2)
    return self.o_proj(out.reshape(B, T, H * dv)), None
