"""ALiBi slopes for the families whose attention adds a linear position bias (BLOOM, MPT, Falcon-RW).

Each reads its slopes off transformers' own bias builder for the family (so a release that changes
them changes ours) and keeps them on the attention module (``slopes_of``), whose fused attention
passes them to ``kv_cache_attention(alibi_slopes=...)``: head h's score of the key at position s,
for a query at position p, gains slope_h * (s - p). transformers adds slope_h * s instead (BLOOM,
Falcon: each key's position; MPT: s minus the last key's); the two differ by slope_h * p for every key
of a query, which its softmax drops.

The kernels add the bias in float32. transformers rounds it: Falcon rounds each slope_h * s to
bfloat16, in any dtype; BLOOM casts its bias to the model's dtype. Those roundings grow with the
position (slope_h * s reaches hundreds), and they are not the same for every key of a query, so
the logits of a patched model differ from transformers' by them. Measured on the tiny test models
(12 heads, logits of size 3 to 4, 2026-11-25): Falcon-RW in float32 differs from transformers by
4e-3 at 12 tokens and 0.08 at 200 (python_tests/models/test_falcon.py holds the first); BLOOM in
bfloat16 by 0.02 and 0.4, where the float32 model is the better judge: at 200 tokens transformers'
bfloat16 logits are 0.41 from its float32 ones, the patched model's 0.03. Falcon's slopes
themselves are rounded to bfloat16 as transformers rounds them.

The slopes are held as the bits of their float32 values in an int32 buffer (not persistent: no
state_dict entry), which moves with the module but, being integers, is left alone by a cast of
the model's dtype: patching before or after ``model.to(torch.bfloat16)`` gives the same slopes.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

BUFFER = "_gptfast_alibi_slope_bits"


def install_slopes(module: nn.Module, slopes: torch.Tensor) -> None:
    """Keeps ``slopes`` [heads] (as float32) on ``module`` for ``slopes_of``, on the device of the
    module's weights (parameters, or an int8 module's buffers)."""
    device = next(itertools.chain(module.parameters(), module.buffers())).device
    bits = slopes.detach().to(device=device, dtype=torch.float32).contiguous().view(torch.int32)
    module.register_buffer(BUFFER, bits, persistent=False)


def slopes_of(module: nn.Module) -> torch.Tensor | None:
    """The float32 slopes [heads] ``install_slopes`` kept on ``module`` (a view, no copy), or None."""
    bits = getattr(module, BUFFER, None)
    return None if bits is None else bits.view(torch.float32)


def slopes_from_key_positions(build, num_heads: int) -> torch.Tensor:
    """The slopes of a builder ``build(attention_mask [B, L], num_heads, dtype) -> [B * heads, 1, L]``
    that adds slope_h * (the key's position) (BLOOM's and Falcon's ``build_alibi_tensor``): its bias at
    position 1 of a two-token mask."""
    bias = build(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32).reshape(num_heads, 2)
    return bias[:, 1] - bias[:, 0]
