"""GPT-Neo (transformers' ``gpt_neo``: GPT-Neo 125M / 1.3B / 2.7B) over a StaticKVCache.

Its attention (``GPTNeoSelfAttention``) does not go through transformers' AttentionInterface: it
masks and softmaxes the scores itself, unscaled (no 1 / sqrt(D)), and its "local" layers attend to
the last ``window_size`` tokens alone (a key j for query i when i - j < window_size: transformers'
sliding-window rule). Patched, those modules run ``fused_attention`` below with a StaticKVCache
(patch.py installs it; without one they run transformers' forward): one fused call with scale 1
and, on local layers, the window. Its attention wrapper drops the attention keywords and passes the cache as
``layer_past``, so the family is ``layers_drop_keywords`` (attention.before_attention hands the cache
on). The cache reads the local layers' windows off ``attention_layers`` (static_kv_cache.sliding_windows),
so generation keeps them as ring buffers as it does other families' sliding-window layers.
"""

from __future__ import annotations

import torch


def fused_attention(self, hidden_states: torch.Tensor, attend, **kwargs) -> torch.Tensor:
    """A GPTNeoSelfAttention on a StaticKVCache: hidden_states [B, T, hidden] -> [B, T, hidden]."""
    query, key, value = (self._split_heads(projection(hidden_states), self.num_heads, self.head_dim)
                         for projection in (self.q_proj, self.k_proj, self.v_proj))       # [B, H, T, D]
    window = self.config.window_size if self.attention_type == "local" else None
    return self.resid_dropout(self.out_proj(attend(query, key, value, scaling=1.0, sliding_window=window)))
