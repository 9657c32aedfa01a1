"""Mamba, Mamba-2 and Falcon-Mamba (attention-free: families.py): their output head in int8.

Their models cast the final hidden states to ``lm_head.weight.dtype`` before the head, a weight an
Int8Linear does not have. ``Int8OutputHead`` is an Int8Linear whose ``weight`` is a zero-size tensor of
the model's float dtype, which that cast reads; the product is int8_linear's, as for any Int8Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from gptfast_kernels.modules.int8_linear import Int8Linear


class Int8OutputHead(Int8Linear):
    """An Int8Linear output head whose ``weight`` says the model's float dtype (zero-size: no weight
    is stored as float), for model code that reads ``lm_head.weight.dtype``."""

    @classmethod
    def of(cls, head: Int8Linear, dtype: torch.dtype) -> "Int8OutputHead":
        new = cls.concat([head])  # (a copy of its buffers, as this class)
        new.register_buffer("weight", torch.empty(0, dtype=dtype, device=head.qweight.device), persistent=False)
        return new


def patch_mamba_(model: nn.Module, int8: bool, skip: tuple[str, ...] = ()) -> None:
    """In place: an int8 output head (patch_model's int8 pass made it an Int8Linear, unless int8_skip
    kept it float) becomes an Int8OutputHead of the input embeddings' dtype."""
    head = model.get_output_embeddings()
    if int8 and type(head) is Int8Linear:
        model.set_output_embeddings(Int8OutputHead.of(head, model.get_input_embeddings().weight.dtype))
