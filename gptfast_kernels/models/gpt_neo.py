"""GPT-Neo (transformers' ``gpt_neo``: GPT-Neo 125M / 1.3B / 2.7B) over a StaticKVCache.

Its attention (``GPTNeoSelfAttention``) does not go through transformers' AttentionInterface: it
masks and softmaxes the scores itself, unscaled (no 1 / sqrt(D)), and its "local" layers attend to
the last ``window_size`` tokens alone (a key j for query i when i - j < window_size: transformers'
sliding-window rule). Patched, those modules get ``attention_forward`` below (patch.py installs it,
with the name of the registered attention function to call as ``_gptfast_attention``): with a
StaticKVCache one fused call with scale 1 and, on local layers, the window; without one,
transformers' forward. Its attention wrapper drops the attention keywords and passes the cache as
``layer_past``, so the family is ``layers_drop_keywords`` (attention.before_attention hands the cache
on). The cache reads the local layers' windows off ``attention_layers`` (static_kv_cache.sliding_windows),
so generation keeps them as ring buffers as it does other families' sliding-window layers.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def attention_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """A GPTNeoSelfAttention's forward: hidden_states [B, T, hidden] -> ([B, T, hidden], None)."""
    cache = kwargs.pop("gptfast_cache", None)
    if cache is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    query, key, value = (self._split_heads(projection(hidden_states), self.num_heads, self.head_dim)
                         for projection in (self.q_proj, self.k_proj, self.v_proj))       # [B, H, T, D]
    window = self.config.window_size if self.attention_type == "local" else None
    attend = ALL_ATTENTION_FUNCTIONS[self._gptfast_attention]
    out, _ = attend(self, query, key, value, None, scaling=1.0, sliding_window=window, gptfast_cache=cache)
    return self.resid_dropout(self.out_proj(out.reshape(*hidden_states.shape[:-1], -1))), None
