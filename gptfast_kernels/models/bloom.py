"""BLOOM (transformers' ``bloom``: BLOOM 560M to 176B, BLOOMZ) over a StaticKVCache.

Its attention (``BloomAttention``) does not go through transformers' AttentionInterface: it adds
the model's ALiBi tensor to the scaled scores itself (``baddbmm``), masks, softmaxes and adds the
block's residual to its output projection. Patched, its modules run ``fused_attention`` below with
a StaticKVCache (patch.py installs it; without one they run transformers' forward): one fused call
with the module's scale and its heads' ALiBi slopes (models/alibi.py), then the output projection and
the residual, as transformers' forward ends. Its decoder layers pass the cache as ``layer_past`` and
drop the attention keywords, so the family is ``layers_drop_keywords`` (attention.before_attention
hands the cache on). ``slow_but_exact`` (tensor-parallel pretraining's sliced output projection)
computes the same product in slices; the fused path takes it whole.
"""

from __future__ import annotations

import sys

import torch

from gptfast_kernels.models import alibi


def prepare_attention(module, config) -> None:
    """Gives a BloomAttention its ALiBi slopes (transformers' build_alibi_tensor)."""
    code = sys.modules[type(module).__module__]
    alibi.install_slopes(module, alibi.slopes_from_key_positions(code.build_alibi_tensor, module.num_heads))


def fused_attention(self, hidden_states: torch.Tensor, attend, residual: torch.Tensor, **kwargs) -> torch.Tensor:
    """A BloomAttention on a StaticKVCache: hidden_states and residual [B, T, hidden] -> [B, T, hidden]."""
    code = sys.modules[type(self).__module__]
    B, T, _ = hidden_states.shape
    # the fused projection holds q, k, v per head, interleaved: [B, T, heads, 3, D]
    qkv = self.query_key_value(hidden_states).view(B, T, self.num_heads, 3, self.head_dim)
    query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))              # [B, H, T, D]
    context = attend(query, key, value, scaling=self.inv_norm_factor, alibi_slopes=alibi.slopes_of(self))
    return code.dropout_add(self.dense(context), residual, self.hidden_dropout, self.training)
