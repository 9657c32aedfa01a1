"""Dory (transformers' ``dory``: NVIDIA's Nemotron-Labs Dory, an nGPT model) over a StaticKVCache.

Its decoder runs a few input layers, then a recurrent section of layers ``n_recurrent_loops`` times
over, then a few output layers. Each run of the section attends:

- ``recurrent_kv_cache_mode="per_loop"``: run i > 0 keeps keys and values of its own, in cache layers
  after the model's own (``layer_idx + cache_offset``: families.cache_layer_sources lays the
  StaticKVCache out the same way). The fused attention is told that cache layer
  (``gptfast_cache_layer``), as the module's ``layer_idx`` is the section's first run's.
- ``"last_loop"``: one cache layer per section layer, written by the last run; transformers' earlier
  runs attend over the cache's past and their own tokens without writing. Here every run writes its
  keys and values at the step's positions and attends as the kernel does (past and own tokens), and
  the last run overwrites them within the same forward: the same attention, and the cache ends
  holding the last run's.

Called without a StaticKVCache the attention module runs transformers' forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from gptfast_kernels.modules.int8_linear import OUTPUT_HEAD, Int8Linear, _skipped

ATTENTION_CLASS = "DoryAttention"
HEAD_CLASS = "DoryLMHead"


def patch_dory_(model: nn.Module, int8: bool, skip: tuple[str, ...] = ()) -> None:
    """In place: the attention modules get ``attention_forward``; with ``int8`` the output head becomes an
    Int8DoryLMHead, unless ``skip`` (patch_model's int8_skip) names it."""
    for module in model.modules():
        if type(module).__name__ == ATTENTION_CLASS:
            module.forward = types.MethodType(attention_forward, module)
    head = model.get_output_embeddings()
    if int8 and type(head).__name__ == HEAD_CLASS and not _skipped(OUTPUT_HEAD, skip):
        model.set_output_embeddings(Int8DoryLMHead.from_head(head))


class Int8DoryLMHead(Int8Linear):
    """Dory's output head with int8 weights: x @ W.T through int8_linear, in float32, times its learned
    per-token logit scale (float32, the product DoryLMHead forms each call): [..., hidden] ->
    [..., vocab] float32. (quantize_int8_ leaves DoryLMHead float: an nn.Linear subclass with a forward of
    its own.) Float, its 336M weights (of 3.98B) were 16% of an int8 Dory-4B's bytes per step."""

    @classmethod
    def from_head(cls, head: nn.Linear) -> "Int8DoryLMHead":
        new = cls.from_float(head, linear_subclasses=(HEAD_CLASS,))  # (its product; the scale below)
        scale = head.logit_scale.detach().float() * head.logit_scale_factor
        new.register_buffer("logit_scale", scale)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float() * self.logit_scale


def attention_forward(self, hidden_states, *args, cache_offset: int = 0, shared_kv_states=None, **kwargs):
    """A Dory attention module's forward: transformers', told the cache layer of this run of the
    recurrent section when the patched model passes a StaticKVCache (``gptfast_cache``), and with the
    earlier runs' read-only keys and values (last_loop mode) left to the kernel, which writes them."""
    if kwargs.get("gptfast_cache") is None:
        return type(self).forward(self, hidden_states, *args, cache_offset=cache_offset,
                                  shared_kv_states=shared_kv_states, **kwargs)
    return type(self).forward(self, hidden_states, *args, cache_offset=cache_offset, shared_kv_states=None,
                              gptfast_cache_layer=self.layer_idx + cache_offset, **kwargs)
