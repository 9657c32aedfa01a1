"""``StaticKVCache``: a transformers ``Cache`` with preallocated [B, Hkv, S, D] buffers per layer and
one length per batch row, so rows of a batch can sit at different positions (ragged prompts,
speculative rounds that accepted different numbers of tokens).

With a patched model (``patch_model``) the cache does not copy anything itself: each forward plans
the positions of its new tokens once (``plan_step``), and every attention layer hands its new K/V
and the cache buffers to ``kv_cache_attention``, which writes and attends in one call. The lengths
advance when the forward returns (``commit_step``), so a forward that raises leaves them unchanged.

An unpatched model may use the cache as well (HF calls ``update``); rows then share one length, as
in transformers' own ``StaticCache``.

Sliding-window layers can keep a ring buffer instead of max_cache_len slots (``max_step_tokens``):
a layer of window W then holds W + C - 1 slots, position p in slot p % (W + C - 1), where C is the
most tokens one forward writes per row. Every query still finds its whole window (the C - 1 extra
slots hold what this forward's own tokens would otherwise overwrite), and a rollback of up to C
tokens (a rejected speculative round) never needs a slot that was overwritten. Chunked-attention
layers (Llama 4's, chunks of A positions) do the same with A in place of W: a query sees at most
its own chunk's A positions, so A + C - 1 slots hold them.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from gptfast_kernels.modules.cache_layers import NoCacheLayer, StaticKVLayer, StaticKVStateLayer
from gptfast_kernels.modules.state_history import StateHistory, recurrent_states, row_mask
from gptfast_kernels.ops._dispatch import check_int, check_tensor, is_tracing


def layer_geometry(config) -> list[tuple[int, ...]]:
    """Per decoder layer of a supported family's config: (kv heads, head dim), or (kv heads, head
    dim, value dim) for a layer whose values are its keys' first numbers (Family.layer_geometry)."""
    from gptfast_kernels.models.families import family_of

    return family_of(config).layer_geometry(config.get_text_config(decoder=True))


def sliding_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for a layer attending to every position. As
    transformers reads a config: the ``layer_types`` in families.SLIDING ("sliding_attention", ZAYA1's
    "hybrid_sliding") have the config's ``sliding_window``; without layer types every layer has it
    (Mistral, Phi-3, StarCoder2). GPT-Neo's "local" ``attention_layers`` have its ``window_size``."""
    from gptfast_kernels.models.families import SLIDING, layer_types

    config = config.get_text_config(decoder=True)
    if config.model_type == "gpt_neo":
        return [config.window_size if kind == "local" else None for kind in config.attention_layers]
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return [None] * config.num_hidden_layers
    if getattr(config, "layer_types", None) is None:
        return [window] * config.num_hidden_layers
    return [window if kind in SLIDING else None for kind in layer_types(config)]


# The layer_types entry of a chunked-attention layer (Llama 4's; models/llama4.py passes it the chunk).
CHUNKED_ATTENTION = "chunked_attention"


def attention_chunks(config) -> list[int | None]:
    """Per decoder layer: its attention chunk (a query at p sees only p - p % chunk .. p), or None. As
    models/llama4.py passes it: the ``layer_types`` named "chunked_attention" have the config's
    ``attention_chunk_size``; without layer types (which no Llama 4 config lacks) no layer has one."""
    from gptfast_kernels.models.families import layer_types

    config = config.get_text_config(decoder=True)
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
    if not chunked or getattr(config, "layer_types", None) is None:
        return [None] * config.num_hidden_layers
    return [chunk if kind == CHUNKED_ATTENTION else None for kind in layer_types(config)]


def layer_kinds(config) -> list[str]:
    """Per decoder layer of a supported family's config: "attention", "recurrent", "both" or "none"
    (see Family.layer_kinds)."""
    from gptfast_kernels.models.families import family_of

    return family_of(config).layer_kinds(config.get_text_config(decoder=True))


def cache_layer_sources(config) -> list[int]:
    """Per layer of a StaticKVCache for ``config``: the decoder layer it serves (families.cache_layer_sources)."""
    from gptfast_kernels.models import families

    return families.cache_layer_sources(config.get_text_config(decoder=True))


def recurrent_loop(config) -> tuple[list[int], int, bool]:
    """A looped model's recurrent section, extra runs and whether they keep cache layers of their own
    (families.recurrent_loop)."""
    from gptfast_kernels.models import families

    return families.recurrent_loop(config.get_text_config(decoder=True))


def kv_sources(config) -> list[int]:
    """Per cache layer: the layer whose keys and values it attends over (see families.kv_sources)."""
    from gptfast_kernels.models import families

    return families.kv_sources(config.get_text_config(decoder=True))


class StaticKVCache(Cache):
    """Preallocated KV cache with per-row lengths.

    StaticKVCache(config, batch_size, max_cache_len, *, device=None, dtype=None, max_step_tokens=None):
    buffers [batch_size, Hkv, max_cache_len, D] per layer, in ``dtype`` (default: the config's dtype,
    else float32) on ``device`` (default: CPU). ``seq_lengths`` [B] int64 holds each row's length.
    Sliding-window layers (Mistral, Gemma 2 / 3, GPT-OSS ...) keep every slot as well by default.
    With ``max_step_tokens`` C, those of window W keep a ring buffer of W + C - 1 slots instead,
    where that is shorter than max_cache_len (memory: Gemma 3's 5 sliding layers of 6 hold 1024 +
    C - 1 slots, not 128k), and so do chunked-attention layers of chunk A, with A + C - 1 slots
    (Llama 4's 36 chunked layers of 48: 8192 + C - 1, not 128k); every forward may then write at
    most C tokens per row (generate feeds longer prompts in chunks), a crop may roll a row back by
    at most C tokens from the furthest position it wrote, and only a patched model can use the
    cache. The linear-attention (recurrent) layers of a hybrid model (Qwen3.5 ...) hold
    transformers' own state layer (``LinearAttentionLayer``: conv and recurrent states, updated in
    place). A recurrent state has no positions to crop: such a cache's rows can be emptied (their
    states zeroed, one row or all), and with ``rollback_tokens`` R it can roll rows back to any
    length they had since its last ``checkpoint()``, within R token columns (padding included)
    written since then (modules/state_history.py: a patched model's recurrent layers then run token
    by token and keep their states after each token; speculative decoding checkpoints every round). Layers may differ
    in kv heads and head dim (``geometry``: Gemma 4's global layers); a layer that reuses another's
    keys and values (Gemma 4's last layers) holds none and attends over that layer's buffers
    (``kv_sources``); a multi-head latent attention layer (DeepSeek-V2 / V3) holds one latent per
    token, as one kv head of width kv_lora_rank + qk_rope_head_dim whose first kv_lora_rank numbers
    are also the values (no value buffer: see models/latent_attention.py).
    """

    def __init__(self, config, batch_size: int, max_cache_len: int, *, device=None, dtype=None,
                 max_step_tokens: int | None = None, rollback_tokens: int = 0):
        if not callable(getattr(config, "get_text_config", None)):
            raise TypeError(f"StaticKVCache: config must be a transformers model config (model.config), "
                            f"got {type(config).__name__}")
        batch_size = check_int("StaticKVCache", "batch_size", batch_size, 1)
        rollback_tokens = check_int("StaticKVCache", "rollback_tokens", rollback_tokens, 0)
        max_cache_len = check_int("StaticKVCache", "max_cache_len", max_cache_len, 1)
        if max_step_tokens is not None:
            max_step_tokens = check_int("StaticKVCache", "max_step_tokens", max_step_tokens, 1)
        text_config = config.get_text_config(decoder=True)
        if dtype is None:
            dtype = getattr(text_config, "dtype", None)
            dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"StaticKVCache: dtype must be float16, bfloat16 or float32, got {dtype}")
        device = torch.device("cpu") if device is None else torch.device(device)
        attention = {"attention": StaticKVLayer, "both": StaticKVStateLayer}

        def attention_layer(kind: str, window: int | None, chunk: int | None, num_heads: int, head_dim: int,
                            value_dim: int | None = None):
            # the most positions a query of the layer sees (a layer has a window, a chunk or neither)
            reach = window if window is not None else chunk
            ring = None if reach is None or max_step_tokens is None else reach + max_step_tokens - 1
            if ring is not None and ring < max_cache_len:
                return attention[kind](batch_size, num_heads, ring, head_dim, value_dim, device=device, dtype=dtype,
                                       ring_window=window, ring_chunk=None if window is not None else chunk)
            return attention[kind](batch_size, num_heads, max_cache_len, head_dim, value_dim, device=device,
                                   dtype=dtype)

        # per cache layer, the decoder layer it serves (a looped model's extra runs of its recurrent section
        # may keep layers of their own: families.cache_layer_sources)
        sources = cache_layer_sources(config)
        kinds, windows, chunks = layer_kinds(config), sliding_windows(config), attention_chunks(config)
        # per layer, the (kv heads, head dim[, value dim]) of its buffers, None for a layer without (a recurrent
        # one, or a "shared" layer, which attends over the keys and values of the layer kv_sources names)
        self.geometry = self.geometry_of(config)
        layers = [LinearAttentionLayer() if kinds[source] == "recurrent" else NoCacheLayer() if geometry is None
                  else attention_layer(kinds[source], windows[source], chunks[source], *geometry)
                  for source, geometry in zip(sources, self.geometry)]
        super().__init__(layers=layers)
        # per layer, the layer whose buffers its attention reads and writes (its own but for shared layers),
        # and how many attention calls a forward makes (the fused path checks each one came; a looped model's
        # recurrent section calls its attention once per run)
        self.kv_sources = kv_sources(config)
        attending = [kind in ("attention", "both", "shared") for kind in kinds]
        section, extra_runs, _ = recurrent_loop(config)
        self.attention_modules = sum(attending) + extra_runs * sum(attending[i] for i in section)
        attention_indices = [i for i, layer in enumerate(layers) if isinstance(layer, StaticKVLayer)]
        self.attention_layers = [layers[i] for i in attention_indices]
        # the unfused path (HF calling update) plans a forward at its first attention layer and
        # commits it at its last (a hybrid model's first and last layers may be recurrent); an attention-free
        # model's (Mamba's) cache has none: it holds transformers' recurrent states alone, and the positions
        # and lengths of the rows, which only a patched model's forwards advance
        self._first_attention, self._last_attention = (attention_indices[0], attention_indices[-1]) \
            if attention_indices else (None, None)
        # whether some layers keep a recurrent state (a hybrid model) instead of keys and values
        self.has_recurrent_layers = any(isinstance(layer, LinearAttentionLayer) for layer in layers)
        # a hybrid's recurrent states after each token since the last checkpoint() (None: no rollback)
        self.rollback_tokens = rollback_tokens
        self.state_history = (StateHistory(rollback_tokens, batch_size, device)
                              if self.has_recurrent_layers and rollback_tokens else None)
        self._max_cache_len = max_cache_len
        self.max_step_tokens = max_step_tokens
        # whether some sliding-window or chunked layers keep a ring buffer (max_step_tokens made them shorter)
        self.has_ring_layers = any(layer.is_ring for layer in self.attention_layers)
        self.device, self.dtype = device, dtype
        self.seq_lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        # per row, one past the furthest position written since the last reset (a forward that
        # failed included): how far back a ring buffer still holds every position (crop's limit)
        self.written_lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.seq_lengths)
            torch._dynamo.mark_static_address(self.written_lengths)
        self._step_positions: torch.Tensor | None = None  # [B, T] positions of the current forward
        self._fused_step = False
        self._hide_length = False  # see plan_step
        self.attention_calls = 0  # fused attention calls of the current forward (eager forwards only)
        # plan_step checks, in eager mode, that every position fits the cache: one GPU sync per
        # forward. A decoding loop that sized the cache for every token it writes may turn it off
        # (generate / speculative_generate do for the caches they allocate).
        self.check_positions = True
        self._row_views: dict[int, StaticKVCache] = {}  # first_rows's views, per batch size

    def first_rows(self, batch_size: int) -> "StaticKVCache":
        """This cache over its first ``batch_size`` rows (``batch_size`` at most this one's): every
        buffer a view of this one's, at the same address, so a model that keeps one cache serves
        smaller batches from it without allocating, and a compiled step specialised on each batch
        size finds its static inputs where they were when it was recorded (a CUDA graph replayed, not
        recorded again). The same view is handed out again for the same size. The rows are shared:
        use one of the two at a time. Not for a cache with recurrent states (transformers makes them
        at the first forward, per cache): ValueError."""
        batch_size = check_int("StaticKVCache.first_rows", "batch_size", batch_size, 1)
        if batch_size > self.batch_size:
            raise ValueError(f"StaticKVCache.first_rows: batch_size must be at most this cache's {self.batch_size}, "
                             f"got {batch_size}")
        if batch_size == self.batch_size:
            return self
        if self.has_recurrent_layers:
            raise ValueError("StaticKVCache.first_rows: this cache's recurrent states are made per cache at its first "
                             "forward, so they cannot be shared with a view of its rows; allocate a cache of "
                             f"{batch_size} rows instead")
        views = self._row_views
        if batch_size not in views:
            rows = copy.copy(self)
            rows.layers = [layer.first_rows(batch_size) if isinstance(layer, StaticKVLayer) else layer
                           for layer in self.layers]
            rows.attention_layers = [layer for layer in rows.layers if isinstance(layer, StaticKVLayer)]
            rows.seq_lengths, rows.written_lengths = self.seq_lengths[:batch_size], self.written_lengths[:batch_size]
            torch._dynamo.mark_static_address(rows.seq_lengths)
            torch._dynamo.mark_static_address(rows.written_lengths)
            rows._row_views = {}
            views[batch_size] = rows
        return views[batch_size]

    @staticmethod
    def geometry_of(config) -> tuple:
        """Per cache layer for ``config`` (its decoder layers', then a looped model's per-loop copies:
        cache_layer_sources): (kv heads, head dim) of the key / value buffers a StaticKVCache holds
        there (and the value dim, for a layer whose values are its keys' first numbers:
        layer_geometry), None for a layer without; a cache's ``geometry`` (a patched model checks the
        cache it is given against its config's)."""
        geometry = [geometry if kind in ("attention", "both") else None
                    for kind, geometry in zip(layer_kinds(config), layer_geometry(config))]
        return tuple(geometry[source] for source in cache_layer_sources(config))

    # -- the per-forward protocol (driven by the hooks patch_model installs) -------------------------

    def plan_step(self, num_tokens: int, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, *, fused: bool = True,
                  hide_length: bool = False) -> torch.Tensor:
        """Positions [B, T] int64 of the next forward's T new tokens: each row's tokens go at its
        current length onwards (or at ``position_ids``); tokens whose ``attention_mask`` entry is 0
        are padding (-1: neither written nor attended). ``attention_mask`` is [B, T] or HF's
        [B, past + T] (its last T columns are used). ``hide_length`` (a fused forward of a model whose
        code sizes tensors by the cache's length, Family.fused_length_zero): until the step ends,
        get_seq_length() says 0, as the mask sizes and query offset of a fused step do."""
        B = self.batch_size
        if self.has_ring_layers:
            if not fused:
                raise ValueError("StaticKVCache: this cache's sliding-window / chunked layers are ring buffers "
                                 f"(max_step_tokens={self.max_step_tokens}), which only a patched model can use; "
                                 "call gptfast_kernels.patch_model, or build the cache without max_step_tokens")
            if num_tokens > self.max_step_tokens:
                raise ValueError(f"StaticKVCache: a forward of {num_tokens} tokens, but this cache's ring-buffer "
                                 f"layers take at most max_step_tokens = {self.max_step_tokens} per forward (feed "
                                 "longer inputs in chunks, as generate does)")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() == 4:
                # (a dict: one mask per layer type, as transformers' generate builds for windowed models)
                shape = "4-D" if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
                raise ValueError(f"StaticKVCache: got a {shape} attention_mask, which transformers' generate builds "
                                 "for static caches; decode with gptfast_kernels.generate (or speculative_generate), "
                                 "or call the model with the [B, T] padding mask")
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < num_tokens:
                raise ValueError(f"StaticKVCache: attention_mask must be [B, T] or [B, past + T] with B = {B}, "
                                 f"T = {num_tokens}; got {list(attention_mask.shape)}")
            real = attention_mask[:, attention_mask.shape[1] - num_tokens:].to(self.device) != 0
        else:
            real = torch.ones(B, num_tokens, dtype=torch.bool, device=self.device)
        if position_ids is not None:
            position_ids = position_ids.to(self.device, torch.int64)
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0)
            if position_ids.dim() != 2 or position_ids.shape[-1] != num_tokens or position_ids.shape[0] not in (1, B):
                raise ValueError(f"StaticKVCache: position_ids must be [B, T] or [1, T] with B = {B}, "
                                 f"T = {num_tokens}; got {list(position_ids.shape)}")
            positions = torch.where(real, position_ids.expand(B, -1), -1)
        else:
            offsets = real.to(torch.int64).cumsum(dim=1) - 1
            positions = torch.where(real, self.seq_lengths[:, None] + offsets, -1)
        if not is_tracing() and self.check_positions and positions.numel():
            low, high = (int(x) for x in torch.aminmax(positions))
            if high >= self.max_cache_len:
                raise ValueError(f"StaticKVCache is full: a token would go to position {high} but max_cache_len is "
                                 f"{self.max_cache_len}; allocate a larger cache (or crop it)")
            if low < -1:
                raise ValueError(f"StaticKVCache: position_ids must be >= 0, got {low}")
            if self.has_ring_layers and position_ids is not None:
                smallest = torch.where(positions >= 0, positions, high).min(dim=1).values
                span = int((positions.max(dim=1).values - smallest).max())
                if span >= self.max_step_tokens:
                    raise ValueError(f"StaticKVCache: position_ids of a row span {span + 1} positions, but this "
                                     f"cache's ring-buffer layers take at most max_step_tokens = "
                                     f"{self.max_step_tokens} consecutive positions per forward")
        if self.has_ring_layers:
            self.written_lengths.copy_(torch.maximum(self.written_lengths, positions.max(dim=1).values + 1))
        if self.state_history is not None and self.state_history.is_open:
            self.state_history.plan(positions)
        self._step_positions = positions
        self._fused_step = fused
        self._hide_length = fused and hide_length
        self.attention_calls = 0
        return positions

    def commit_step(self) -> None:
        """Advances every row's length past the largest position written by the last forward."""
        if self._step_positions is None:
            return
        written = self._step_positions.max(dim=1).values + 1  # 0 for an all-padding row
        self.seq_lengths.copy_(torch.maximum(self.seq_lengths, written))
        if self.state_history is not None and self.state_history.is_open:
            self.state_history.commit(self._step_positions.shape[1])
        self._step_positions = None
        self._fused_step = self._hide_length = False

    def discard_step(self) -> None:
        """Ends the current forward without advancing any row (its writes stay past the lengths;
        under a checkpoint the recurrent states go back to what they were before it)."""
        if self.state_history is not None and self.state_history.is_open:
            self.state_history.discard()
        self._step_positions = None
        self._fused_step = self._hide_length = False

    def checkpoint(self) -> None:
        """A point a later ``crop`` may roll rows back to, recurrent states included (a hybrid model's
        cache, built with ``rollback_tokens``; until that crop, its patched model's recurrent layers
        run token by token and keep their states after each token column, for at most
        rollback_tokens columns, padding included). Without recurrent layers nothing is needed: keys
        and values are cropped by length."""
        if not self.has_recurrent_layers:
            return
        if self.state_history is None:
            raise ValueError("StaticKVCache.checkpoint: this hybrid model's cache keeps no state history; build "
                             "it with rollback_tokens > 0 (the most token columns written between a checkpoint and "
                             "the crop that rolls them back)")
        self.state_history.open(self.layers, self.seq_lengths)

    def step_positions(self) -> torch.Tensor:
        if self._step_positions is None:
            raise RuntimeError("StaticKVCache: no forward is in progress (plan_step was not called)")
        return self._step_positions

    # -- transformers' Cache interface ----------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Fused path: returns the new states untouched (kv_cache_attention writes them). Unpatched
        path: copies them at the planned positions and returns the whole buffers, as HF expects."""
        if self._fused_step:
            return key_states, value_states
        if layer_idx == self._first_attention or self._step_positions is None:  # a new forward (a failed one dropped)
            self._check_unpatched_step(key_states)
            self.plan_step(key_states.shape[-2], fused=False)  # (refuses a cache with ring buffers)
        layer = self.layers[layer_idx]
        # the new states must fit the layer's own buffers (a layer whose values are in its keys has an empty
        # value buffer, which no value states fit; values narrower than the keys fill the first columns of
        # buffers as wide as the keys, MiMo-V2-Flash's)
        value_width = value_states.shape[-1]
        if (key_states.shape[1::2] != layer.keys.shape[1::2] or value_states.shape[1] != layer.values.shape[1]
                or not 0 < value_width <= layer.values.shape[3] or value_states.shape[:3] != key_states.shape[:3]):
            # (multi-head latent attention hands transformers' caches its latent and rotary key apart)
            raise ValueError(f"StaticKVCache: layer {layer_idx} holds keys / values of {layer.num_heads} heads x "
                             f"{layer.head_dim}, but the model updates it with keys {list(key_states.shape)} and "
                             f"values {list(value_states.shape)}; a model whose attention is multi-head latent "
                             "attention (DeepSeek-V2 / V3 ...) uses a StaticKVCache only once patched (patch_model)")
        positions = self._step_positions
        rows, cols = (positions >= 0).nonzero(as_tuple=True)
        # (the buffers' dtype: a StaticKVStateLayer's ``dtype`` is its recurrent states')
        layer.keys[rows, :, positions[rows, cols]] = key_states[rows, :, cols].to(layer.keys.dtype)
        values = layer.values[..., :value_width]
        values[rows, :, positions[rows, cols]] = value_states[rows, :, cols].to(values.dtype)
        if layer_idx == self._last_attention:
            self.commit_step()
        return layer.keys, values

    def _check_unpatched_step(self, key_states: torch.Tensor) -> None:
        """An unpatched model's forward: transformers positions every row's tokens at the longest row's
        length and attends over buffers in its own dtype, so the rows must be as many as the cache's,
        equally long, and the buffers in the model's dtype (a patched model handles each)."""
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"StaticKVCache: the model runs {key_states.shape[0]} rows but the cache holds "
                             f"batch_size = {self.batch_size}; build the cache for the batch")
        if key_states.dtype != self.dtype:
            raise ValueError(f"StaticKVCache: the cache holds {self.dtype} but the model computes in "
                             f"{key_states.dtype}; build it with dtype={key_states.dtype} (or patch_model the model)")
        if not is_tracing() and self.seq_lengths.numel() and bool((self.seq_lengths != self.seq_lengths[0]).any()):
            raise ValueError(f"StaticKVCache: its rows have different lengths {self.seq_lengths.tolist()} (a per-row "
                             "crop), which an unpatched model would read as the longest row's; patch the model "
                             "(patch_model), whose forwards place each row at its own length")

    def update_conv_state(self, *args, **kwargs):
        self._check_state_update()
        return super().update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args, **kwargs):
        self._check_state_update()
        return super().update_recurrent_state(*args, **kwargs)

    def _check_state_update(self) -> None:
        """An attention-free model's (Mamba's) forwards reach the cache through its recurrent states alone:
        unpatched, nothing would plan their positions or advance the rows' lengths."""
        if self._first_attention is None and self._step_positions is None:
            raise ValueError("StaticKVCache: an attention-free model (Mamba) uses a StaticKVCache only once patched "
                             "(patch_model): its forwards then plan each step's positions and advance the rows' "
                             "lengths, which its recurrent states alone cannot")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's length (``seq_lengths`` has every row's); 0 inside a fused step planned
        with ``hide_length``."""
        if self._hide_length:
            return 0
        if is_tracing():
            return self.seq_lengths.max()
        return int(self.seq_lengths.max()) if self.seq_lengths.numel() else 0

    def get_query_offset(self, layer_idx: int = 0):
        # fused: no mask is built, and reading the lengths would cost a host synchronisation
        return 0 if self._fused_step else self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        # The fused kernel needs no mask (positions carry causality and padding): report a cache
        # as long as the query, so transformers skips building a [B, 1, T, S] mask. (Earlier 5.x
        # releases pass cache_position, a [T] tensor, instead of the query length.)
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[-1]
        if self._fused_step:
            return query_length, 0
        return self.max_cache_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    @property
    def max_cache_len(self) -> int:  # a property: some transformers 5.x releases define one on Cache
        return self._max_cache_len

    @property
    def batch_size(self) -> int:
        return self.seq_lengths.shape[0]

    def crop(self, num_tokens, *, check: bool = True) -> None:
        """Shortens rows. An int n < 0 removes |n| tokens from every row (transformers' current
        convention), n > 0 keeps at most n tokens in every row (the older absolute convention), n = 0
        does nothing (as in transformers); a [B] integer tensor gives each row's new length (rows
        already shorter keep theirs). Slots past a row's length are stale and never read (a query at position p
        attends only 0..p, and new tokens overwrite from the length on). ``check=False`` skips the
        test that tensor lengths are >= 0 (a GPU sync), for callers that computed them so. A hybrid
        model's cache can have rows emptied (to 0: their recurrent states zeroed), and rolled back to
        lengths since its last ``checkpoint()`` (which this crop closes); otherwise its recurrent
        states have no positions to roll back to. With ring-buffer layers a row can go back at most
        max_step_tokens positions from the furthest it wrote since the last reset
        (``written_lengths``), or to 0: further back, the oldest slots of its window (or chunk) were
        overwritten (ValueError; checked on tensor lengths too unless ``check=False``)."""
        rollback = self.state_history is not None and self.state_history.is_open
        if self.has_recurrent_layers and not rollback:
            self._crop_recurrent(num_tokens)
            return
        if isinstance(num_tokens, torch.Tensor):
            if num_tokens.shape != self.seq_lengths.shape or num_tokens.is_floating_point():
                raise ValueError(f"StaticKVCache.crop: num_tokens must be an int or an integer tensor of shape "
                                 f"[B] = {list(self.seq_lengths.shape)}, got {num_tokens.dtype} "
                                 f"{list(num_tokens.shape)}")
            new = num_tokens.to(self.seq_lengths.device, torch.int64)
            check = check and not is_tracing()
            if check and bool((new < 0).any()):
                raise ValueError("StaticKVCache.crop: per-row lengths must be >= 0")
            new = torch.minimum(self.seq_lengths, new)
        elif isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
            check = True
            new = (self.seq_lengths.clamp(max=num_tokens) if num_tokens > 0 else
                   (self.seq_lengths + num_tokens).clamp(min=0) if num_tokens < 0 else self.seq_lengths)
        else:
            raise ValueError(f"StaticKVCache.crop: num_tokens must be an int or a [B] tensor, got {num_tokens!r}")
        if self.has_ring_layers and check:
            self._check_ring_crop(new)
        if rollback and check and not bool(new.any()):  # emptied: nothing to roll back
            self.reset()
            return
        if rollback:
            self.state_history.rollback(new, check)
        self.seq_lengths.copy_(new)
        if self.has_ring_layers:  # an emptied row starts over: every position it reads is rewritten first
            self.written_lengths.masked_fill_(self.seq_lengths == 0, 0)

    def _check_ring_crop(self, new: torch.Tensor) -> None:
        """ValueError if a ring-buffer layer no longer holds the window (or chunk) of a row cropped to
        ``new``."""
        too_far = (new > 0) & (new < self.written_lengths - self.max_step_tokens)
        if bool(too_far.any()):
            row = int(too_far.nonzero()[0, 0])
            raise ValueError(f"StaticKVCache.crop: row {row} would go back to length {int(new[row])}, but its "
                             f"ring-buffer layers (max_step_tokens = {self.max_step_tokens}) keep its window / chunk "
                             f"only from length {int(self.written_lengths[row]) - self.max_step_tokens} on (positions "
                             f"up to {int(self.written_lengths[row]) - 1} were written); crop to 0 or build the cache "
                             "with a larger max_step_tokens")

    def _crop_recurrent(self, num_tokens) -> None:
        """crop for a cache with recurrent layers: each row emptied (to 0: its recurrent states zeroed,
        as a fresh cache's) or not shortened; anything else is a ValueError."""
        if isinstance(num_tokens, torch.Tensor) and num_tokens.shape == self.seq_lengths.shape \
                and not num_tokens.is_floating_point():
            new = num_tokens.to(self.seq_lengths.device, torch.int64)
        elif isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
            new = (self.seq_lengths.clamp(max=num_tokens) if num_tokens > 0 else
                   (self.seq_lengths + num_tokens).clamp(min=0) if num_tokens < 0 else self.seq_lengths)
        else:
            raise ValueError(f"StaticKVCache.crop: num_tokens must be an int or a [B] integer tensor, got "
                             f"{num_tokens!r}")
        emptied = new <= 0
        if bool(emptied.all()):
            self.reset()
            return
        if not bool((emptied | (new >= self.seq_lengths)).all()):
            raise ValueError("StaticKVCache.crop: this model's linear-attention layers keep a recurrent state, which "
                             "has no positions to crop; rows can be emptied (to 0) or kept, or rolled back to "
                             "lengths since a checkpoint() (a cache built with rollback_tokens > 0)")
        if bool(emptied.any()):
            for state in self.recurrent_state_tensors():
                state.masked_fill_(row_mask(emptied, state), 0)
            self.seq_lengths.masked_fill_(emptied, 0)
            self.written_lengths.masked_fill_(emptied, 0)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Row ``target`` takes row ``source``'s first ``length`` positions (their keys and values,
        copied) and length ``length``: a prompt that begins as another row's tokens began skips their
        forward (prefix reuse). Only for caches whose positions all stay in place: no ring-buffer
        layers, no recurrent states (ValueError)."""
        if self.has_ring_layers or self.has_recurrent_layers:
            raise ValueError("StaticKVCache.copy_prefix: this cache's ring-buffer layers or recurrent states do not "
                             "keep a row's first positions where a copy can take them")
        for name, value in (("source", source), ("target", target), ("length", length)):
            check_int("StaticKVCache.copy_prefix", name, value, 0)
        if not (0 <= source < self.batch_size and 0 <= target < self.batch_size):
            raise ValueError(f"StaticKVCache.copy_prefix: source and target must be rows in [0, {self.batch_size}), "
                             f"got {source} and {target}")
        if not 0 <= length <= int(self.seq_lengths[source]):
            raise ValueError(f"StaticKVCache.copy_prefix: length must be in [0, {int(self.seq_lengths[source])}] "
                             f"(row {source}'s length), got {length}")
        for layer in self.attention_layers:
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            layer.values[target, :, :length] = layer.values[source, :, :length]
        self.seq_lengths[target] = length
        self.written_lengths[target] = length

    def recurrent_state_tensors(self) -> list[torch.Tensor]:
        """Every recurrent state the cache's linear-attention layers hold now, [B, ...] each (conv and
        recurrent states; none before the first forward that made them)."""
        return [states[key] for layer in self.layers if isinstance(layer, LinearAttentionLayer)
                for states, key in recurrent_states(layer)]

    def reset(self) -> None:
        if self.state_history is not None:
            self.state_history.close()
        for layer in self.layers:
            layer.reset()
        self.seq_lengths.zero_()
        self.written_lengths.zero_()
        self._step_positions = None
        self._fused_step = self._hide_length = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i takes row beam_idx[i]'s contents (beam search's reordering)."""
        check_tensor("StaticKVCache.reorder_cache", "beam_idx", beam_idx, dtypes=(torch.int64, torch.int32), ndim=1)
        if beam_idx.shape[0] != self.batch_size:
            raise ValueError(f"StaticKVCache.reorder_cache: beam_idx must hold one row index per cache row "
                             f"({self.batch_size}), got {beam_idx.shape[0]}")
        if beam_idx.numel() and not is_tracing():
            low, high = (int(x) for x in torch.aminmax(beam_idx))
            if low < 0 or high >= self.batch_size:
                raise ValueError(f"StaticKVCache.reorder_cache: beam_idx must be row indices in [0, {self.batch_size}), "
                                 f"got values from {low} to {high}")
        beam_idx = beam_idx.to(self.device)
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):  # recurrent states (Falcon-H1's layers: and keys / values)
                LinearAttentionLayer.reorder_cache(layer, beam_idx)
            if isinstance(layer, StaticKVLayer):
                layer.keys.copy_(layer.keys.index_select(0, beam_idx))
                layer.values.copy_(layer.values.index_select(0, beam_idx))
        self.seq_lengths.copy_(self.seq_lengths.index_select(0, beam_idx))
        self.written_lengths.copy_(self.written_lengths.index_select(0, beam_idx))

    def __repr__(self) -> str:
        rings = sum(layer.is_ring for layer in self.attention_layers)
        ring = f", max_step_tokens={self.max_step_tokens} ({rings} ring-buffer layers)" if rings else ""
        return (f"StaticKVCache(layers={len(self.layers)}, batch_size={self.batch_size}, "
                f"max_cache_len={self.max_cache_len}{ring}, dtype={self.dtype}, device={self.device})")
