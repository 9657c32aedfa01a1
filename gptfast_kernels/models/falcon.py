"""Falcon (transformers' ``falcon``: Falcon-7B / 40B / 180B, Falcon-11B) over a StaticKVCache.

Falcon's attention does not go through transformers' AttentionInterface: it splits one fused
q / k / v projection itself and calls SDPA (or its own eager softmax) on what the cache returns.
Its three layouts also widen the keys and values before the cache sees them:

- ``new_decoder_architecture`` (40B, 180B, 11B): the projection holds, per kv head, its group of
  query heads, then one key and one value head; transformers broadcasts each key / value head to
  its whole group, so a cache of its own would hold every key once per query head of the group;
- ``multi_query`` (7B): one key and one value head for all query heads;
- neither: one of each per query head (multi-head attention).

Patched, its attention modules run ``fused_attention`` below with a StaticKVCache (patch.py installs
it: their forward, which defers to transformers' without one, calls it): it takes the kv heads from the projection as they are (groups of query heads next to each other,
as ``kv_cache_attention`` maps query head h to kv head h // G), rotates q / k and makes one fused
call, so the cache holds each kv head once (the family table reads the kv heads the same way:
families.falcon_kv_heads). Falcon's decoder layers pass the cache to their attention as ``layer_past`` and drop the attention keywords, so the
family is ``layers_drop_keywords`` (attention.before_attention hands the cache on). ALiBi configs
(``alibi=True``: Falcon-RW) rotate nothing; transformers adds the slopes times each key's position to
the scores before scaling them, so their slopes here (models/alibi.py) are transformers' (rounded to
bfloat16 as its builder rounds them) times the softmax scale.
"""

from __future__ import annotations

import sys

import torch

from gptfast_kernels.models import alibi


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


def prepare_attention(module, config) -> None:
    """Gives the FalconAttention of an ALiBi config its slopes, scaled by its softmax scale."""
    if config.alibi:
        code = sys.modules[type(module).__module__]
        slopes = alibi.slopes_from_key_positions(code.build_alibi_tensor, module.num_heads)
        alibi.install_slopes(module, slopes * module.inv_norm_factor)


def fused_attention(self, hidden_states: torch.Tensor, attend, **kwargs) -> torch.Tensor:
    """A FalconAttention on a StaticKVCache: hidden_states [B, T, hidden] -> [B, T, hidden], one fused
    attention call (``attend``, see patch.py) on the unbroadcast kv heads."""
    code = sys.modules[type(self).__module__]
    query, key, value = (x.transpose(1, 2) for x in split_projection(self, self.query_key_value(hidden_states)))
    slopes = alibi.slopes_of(self)
    if slopes is None:  # rotary positions (ALiBi configs have none)
        cos, sin = kwargs["position_embeddings"]
        query, key = code.apply_rotary_pos_emb(query, key, cos, sin)
    return self.dense(attend(query, key, value, scaling=self.inv_norm_factor, alibi_slopes=slopes))
