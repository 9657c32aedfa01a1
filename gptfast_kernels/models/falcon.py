"""Falcon (transformers' ``falcon``: Falcon-7B / 40B / 180B, Falcon-11B) over a StaticKVCache.

Falcon's attention does not go through transformers' AttentionInterface: it splits one fused
q / k / v projection itself and calls SDPA (or its own eager softmax) on what the cache returns.
Its three layouts also widen the keys and values before the cache sees them:

- ``new_decoder_architecture`` (40B, 180B, 11B): the projection holds, per kv head, its group of
  query heads, then one key and one value head; transformers broadcasts each key / value head to
  its whole group, so a cache of its own would hold every key once per query head of the group;
- ``multi_query`` (7B): one key and one value head for all query heads;
- neither: one of each per query head (multi-head attention).

Patched, its attention modules get ``attention_forward`` below (patch.py installs it, with the
name of the registered attention function to call as ``_gptfast_attention``): with a StaticKVCache
it takes the kv heads from the projection as they are (groups of query heads next to each other,
as ``kv_cache_attention`` maps query head h to kv head h // G), rotates q / k and makes one fused
call, so the cache holds each kv head once (the family table reads the kv heads the same way:
families.falcon_kv_heads). Without a StaticKVCache it runs transformers' forward. Falcon's decoder
layers pass the cache to their attention as ``layer_past`` and drop the attention keywords, so the
family is ``layers_drop_keywords`` (attention.before_attention hands the cache on). ALiBi configs
(Falcon-RW) are refused: the fused kernel adds no position bias.
"""

from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def split_projection(module, fused_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Falcon attention's fused projection [B, T, (Hq + 2 Hkv) D] -> q [B, T, Hq, D] and k, v
    [B, T, Hkv, D], Hkv = falcon_kv_heads (not broadcast to the query heads), query head h of kv
    head h // (Hq / Hkv)."""
    B, T, _ = fused_qkv.shape
    D, heads = module.head_dim, module.num_heads
    if module.new_decoder_architecture:
        kv_heads = module.num_kv_heads
        qkv = fused_qkv.view(B, T, kv_heads, heads // kv_heads + 2, D)
        return qkv[:, :, :, :-2].reshape(B, T, heads, D), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if module.multi_query:
        qkv = fused_qkv.view(B, T, heads + 2, D)
        return qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    qkv = fused_qkv.view(B, T, heads, 3, D)
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def attention_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """A FalconAttention's forward: hidden_states [B, T, hidden] -> ([B, T, hidden], None). With a
    StaticKVCache (the ``gptfast_cache`` keyword attention.before_attention adds): one fused
    attention call on the unbroadcast kv heads; else transformers' forward."""
    cache = kwargs.pop("gptfast_cache", None)
    if cache is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    code = sys.modules[type(self).__module__]
    query, key, value = (x.transpose(1, 2) for x in split_projection(self, self.query_key_value(hidden_states)))
    cos, sin = kwargs["position_embeddings"]
    query, key = code.apply_rotary_pos_emb(query, key, cos, sin)
    attend = ALL_ATTENTION_FUNCTIONS[self._gptfast_attention]
    out, _ = attend(self, query, key, value, None, scaling=self.inv_norm_factor, gptfast_cache=cache)
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), None
