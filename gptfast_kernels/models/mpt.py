"""MPT (transformers' ``mpt``: MPT-7B / 30B and their chat / instruct / storywriter variants) over a
StaticKVCache.

Its attention (``MptAttention``) does not go through transformers' AttentionInterface: it adds the
model's ALiBi ``position_bias`` (slopes times the keys' distance to the last key) to the scaled
scores itself, then masks and softmaxes them. Patched, its modules run ``fused_attention`` below with
a StaticKVCache (patch.py installs it; without one they run transformers' forward): the fused q / k / v
projection, its ``clip_qkv`` clamp, one fused call with the module's softmax scale and its heads'
ALiBi slopes (models/alibi.py), then the output projection. Its decoder layers pass the cache to their
attention but not the other keywords, so the family is ``layers_drop_keywords``. transformers' MPT
code reads only ``clip_qkv`` and ``softmax_scale`` of ``attn_config``: it adds ALiBi whatever
``alibi`` says, builds it with the default ``alibi_bias_max`` of 8 whatever the config's, and runs
no prefix LM or QK norm; so does this one.
"""

from __future__ import annotations

import sys

import torch

from gptfast_kernels.models import alibi


def prepare_attention(module, config) -> None:
    """Gives an MptAttention its ALiBi slopes, from transformers' build_mpt_alibi_tensor as its model
    calls it (with the default alibi_bias_max): its bias is slope_h * (key - last key), so the
    difference of its entries for two keys."""
    code = sys.modules[type(module).__module__]
    bias = code.build_mpt_alibi_tensor(module.n_heads, 2)  # [heads, 1, 2]
    alibi.install_slopes(module, bias[:, 0, 1] - bias[:, 0, 0])


def fused_attention(self, hidden_states: torch.Tensor, attend, **kwargs) -> torch.Tensor:
    """An MptAttention on a StaticKVCache: hidden_states [B, T, hidden] -> [B, T, hidden]."""
    B, T, _ = hidden_states.shape
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (x.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    context = attend(query, key, value, scaling=self.softmax_scale, alibi_slopes=alibi.slopes_of(self))
    return self.out_proj(context)
