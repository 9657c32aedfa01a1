"""ALiBi slopes for the families whose attention adds a linear position bias (BLOOM, MPT, Falcon-RW).

Each reads its slopes off transformers' own bias builder for the family (so a release that changes
them changes ours), and keeps them as a float32 buffer of the attention module, ``_gptfast_alibi_slopes``
[heads], which the fused attention passes to ``kv_cache_attention(alibi_slopes=...)``: head h's score
of the key at position s, for a query at position p, gains slope_h * (s - p). transformers adds
slope_h * s instead (BLOOM, Falcon: each key's position; MPT: s minus the last key's); the two differ
by slope_h * p for every key of a query, which its softmax drops.

The buffer is not persistent (no state_dict entry) and moves with the module; casting the model to
a 16-bit dtype after ``patch_model`` casts it too, rounding the slopes as transformers rounds its bias.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

BUFFER = "_gptfast_alibi_slopes"


def install_slopes(module: nn.Module, slopes: torch.Tensor) -> None:
    """Registers ``slopes`` [heads] (float32) on ``module`` as the buffer the fused attention reads,
    on the device of the module's weights (parameters, or an int8 module's buffers)."""
    device = next(itertools.chain(module.parameters(), module.buffers())).device
    module.register_buffer(BUFFER, slopes.detach().to(device=device, dtype=torch.float32), persistent=False)


def slopes_from_key_positions(build, num_heads: int) -> torch.Tensor:
    """The slopes of a builder ``build(attention_mask [B, L], num_heads, dtype) -> [B * heads, 1, L]``
    that adds slope_h * (the key's position) (BLOOM's and Falcon's ``build_alibi_tensor``): its bias at
    position 1 of a two-token mask."""
    bias = build(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)
    return bias.reshape(num_heads, 2)[:, 1] - bias.reshape(num_heads, 2)[:, 0]
