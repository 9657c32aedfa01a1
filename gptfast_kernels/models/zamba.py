"""Zamba and Zamba2 (transformers' ``zamba``, ``zamba2``) over a StaticKVCache: Mamba (Zamba2: Mamba-2)
layers, some of them ("hybrid") preceded by a shared transformer block (attention and MLP over the
concatenated hidden state and token embeddings; Zamba2's in two blocks used in turn, with low-rank
adapters of their own per use).

Each hybrid layer holds its own attention module, whose weights transformers ties to those of the
block it repeats (Zamba2: ``num_mem_blocks`` blocks in turn), and which it calls with the hybrid layer's index
as an argument; the modules' own ``layer_idx`` is -1 (Zamba's None). The fused attention picks the cache layer by
``layer_idx``, so patching sets it to the hybrid layer's index.
"""

from __future__ import annotations

from torch import nn

ATTENTION_CLASSES = ("ZambaAttention", "Zamba2Attention")


def patch_zamba_(model: nn.Module, int8: bool, skip: tuple[str, ...] = ()) -> None:
    """In place: each hybrid layer's attention module gets the layer's index as ``layer_idx``."""
    for index, layer in enumerate(model.model.layers):
        for module in layer.modules():
            if type(module).__name__ in ATTENTION_CLASSES:
                module.layer_idx = index
