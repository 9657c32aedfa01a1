"""The per-layer entries of a ``StaticKVCache`` (modules/static_kv_cache.py): a layer's preallocated
key / value buffers (``StaticKVLayer``), the same beside transformers' recurrent states
(``StaticKVStateLayer``, Falcon-H1's layers), and the entry of a layer that keeps nothing
(``NoCacheLayer``)."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer


class NoCacheLayer:
    """The cache entry of a layer that keeps nothing (a hybrid's MLP / MoE block as a layer of its own)."""

    is_compileable = True
    is_sliding = False
    is_initialized = True
    supports_early_init = False
    keys = values = None

    def reset(self) -> None: ...
    def crop(self, tokens_to_remove: int) -> None: ...
    def reorder_cache(self, beam_idx: torch.Tensor) -> None: ...
    def offload(self) -> None: ...
    def prefetch(self) -> None: ...

    def get_max_length(self) -> int:
        return -1


class StaticKVLayer(CacheLayerMixin):
    """One layer's buffers: keys / values [B, Hkv, S, D], allocated up front at static addresses.
    ``ring_window``: a sliding-window layer's window when its buffers are a ring (position p in slot
    p % S, S = max_cache_len here), else None; ``ring_chunk`` likewise a chunked-attention layer's
    chunk (at most one of the two is set: ``is_ring``). ``value_dim``: the values are the keys' first
    value_dim numbers (multi-head latent attention's latent), so ``values`` is empty ([B, Hkv, S, 0]);
    else None. Values narrower than the keys (MiMo-V2-Flash's) fill the first columns of ``values``."""

    is_compileable = True
    is_sliding = False
    supports_early_init = True

    def __init__(self, batch_size: int, num_heads: int, max_cache_len: int, head_dim: int, value_dim: int | None = None,
                 *, device: torch.device, dtype: torch.dtype, ring_window: int | None = None,
                 ring_chunk: int | None = None):
        super().__init__()
        if ring_window is not None and ring_chunk is not None:
            raise ValueError("StaticKVLayer: a ring buffer is sized for a window or for a chunk, not both; got "
                             f"ring_window {ring_window}, ring_chunk {ring_chunk}")
        self.ring_window, self.ring_chunk, self.value_dim = ring_window, ring_chunk, value_dim
        self.batch_size, self.num_heads = batch_size, num_heads
        self.max_cache_len, self.head_dim = max_cache_len, head_dim
        self.device, self.dtype = device, dtype
        # kv_cache_attention's backend per call signature whose inputs were checked (models/attention.py)
        self.checked_calls: dict[tuple, str] = {}
        shape = (batch_size, num_heads, max_cache_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape if value_dim is None else shape[:3] + (0,), dtype=dtype, device=device)
        if not torch.compiler.is_compiling():
            # fixed data pointers: a compiled decode step can be captured in a CUDA graph
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def first_rows(self, batch_size: int) -> "StaticKVLayer":
        """This layer over its first ``batch_size`` rows: views of its buffers, at their addresses,
        marked static (StaticKVCache.first_rows)."""
        rows = copy.copy(self)
        rows.batch_size, rows.checked_calls = batch_size, {}
        rows.keys, rows.values = self.keys[:batch_size], self.values[:batch_size]
        torch._dynamo.mark_static_address(rows.keys)
        torch._dynamo.mark_static_address(rows.values)
        return rows

    @property
    def is_ring(self) -> bool:
        """Whether the buffers are a ring (position p in slot p % S), for a window or a chunk."""
        return self.ring_window is not None or self.ring_chunk is not None

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        return None

    def update(self, key_states, value_states, *args, **kwargs):  # StaticKVCache.update does the work
        raise NotImplementedError("StaticKVLayer is updated through StaticKVCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError("lengths are per row: use StaticKVCache.get_seq_length / seq_lengths")

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # its name before transformers 5.13

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


class StaticKVStateLayer(LinearAttentionLayer, StaticKVLayer):
    """A layer that has both (Falcon-H1's: attention and Mamba side by side): static keys / values,
    and transformers' recurrent states (as its ``LinearAttentionAndStaticFullAttentionLayer``)."""

    def __init__(self, batch_size: int, num_heads: int, max_cache_len: int, head_dim: int, value_dim: int | None = None,
                 *, device: torch.device, dtype: torch.dtype, ring_window: int | None = None,
                 ring_chunk: int | None = None):
        StaticKVLayer.__init__(self, batch_size, num_heads, max_cache_len, head_dim, value_dim, device=device,
                               dtype=dtype, ring_window=ring_window, ring_chunk=ring_chunk)
        LinearAttentionLayer.__init__(self)  # device / dtype become the states' (set when they first arrive)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if not args:  # the states' (keywords); the key / value buffers exist from the start
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        StaticKVLayer.reset(self)
