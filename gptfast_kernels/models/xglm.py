"""XGLM (transformers' ``xglm``: XGLM 564M to 7.5B) over a StaticKVCache.

Its attention (``XGLMAttention``) does not go through transformers' AttentionInterface: it scales
the queries, then multiplies, masks and softmaxes the scores over what ``cache.update`` returns
itself. Patched, its modules run ``fused_attention`` below with a StaticKVCache (the ``gptfast_cache``
keyword, which XGLM's decoder layers pass on; patch.py installs it, and without a cache they run
transformers' forward): one fused call with the module's scale. Cross-attention configs are refused by the family table
(``add_cross_attention``).

Its model grows its sinusoidal position table by the cache's length, which a fused step hides
(Family.fused_length_zero: no host sync per step, and the step traces on any transformers
release); ``ready_for_cache`` grows the table to the cache's length instead, before each eager
forward (the prefill's, before any compiled step).
"""

from __future__ import annotations

import torch


def fused_attention(self, hidden_states: torch.Tensor, attend, **kwargs) -> torch.Tensor:
    """An XGLMAttention on a StaticKVCache: hidden_states [B, T, hidden] -> [B, T, hidden]."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query, key, value = (projection(hidden_states).view(shape).transpose(1, 2)
                         for projection in (self.q_proj, self.k_proj, self.v_proj))       # [B, H, T, D]
    return self.out_proj(attend(query, key, value, scaling=self.scaling))


def ready_for_cache(model, cache) -> None:
    """Before an eager forward on ``cache``: the model's sinusoidal position table covers every
    position the cache holds (transformers grows it by the length it is told, 0 in a fused step)."""
    table = model.get_decoder().embed_positions
    needed = cache.max_cache_len + table.offset
    if table.weights.shape[0] < needed:
        table.make_weights(needed, table.embedding_dim, table.padding_idx)
