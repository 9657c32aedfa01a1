"""XGLM (transformers' ``xglm``: XGLM 564M to 7.5B) over a StaticKVCache.

Its attention (``XGLMAttention``) does not go through transformers' AttentionInterface: it scales
the queries, then multiplies, masks and softmaxes the scores over what ``cache.update`` returns
itself. Patched, its modules get ``attention_forward`` below (patch.py installs it, with the name
of the registered attention function to call as ``_gptfast_attention``): with a StaticKVCache (the
``gptfast_cache`` keyword, which XGLM's decoder layers pass on) one fused call with the module's
scale; without one, transformers' forward. Cross-attention configs are refused by the family table
(``add_cross_attention``).
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def attention_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """An XGLMAttention's forward: hidden_states [B, T, hidden] -> ([B, T, hidden], None)."""
    cache = kwargs.pop("gptfast_cache", None)
    if cache is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query, key, value = (projection(hidden_states).view(shape).transpose(1, 2)
                         for projection in (self.q_proj, self.k_proj, self.v_proj))       # [B, H, T, D]
    attend = ALL_ATTENTION_FUNCTIONS[self._gptfast_attention]
    out, _ = attend(self, query, key, value, None, scaling=self.scaling, gptfast_cache=cache)
    return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1)), None
