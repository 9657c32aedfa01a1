"""How a patched model reaches ``kv_cache_attention``, through transformers' own hooks.

- Two attention functions are registered with transformers' AttentionInterface: "gptfast_kernels"
  (the fused kernel) and "gptfast_kernels_unfused" (the same semantics in plain PyTorch: a scatter,
  then masked attention). Each layer's ``sliding_window``, ``softcap`` and ``s_aux`` keywords
  (Mistral, Qwen2, Gemma 2 / 3, GPT-OSS ...) become the kernel's ``window``, ``softcap`` and
  ``sinks``; the families whose attention is ours (patch.OWN_ATTENTION) may pass ``alibi_slopes``
  (BLOOM, MPT, Falcon-RW). Without a StaticKVCache both defer to transformers' SDPA attention, or to plain PyTorch
  attention where the scores are soft-capped or have sinks (SDPA can do neither).
- A forward pre-hook on the patched model sees its cache (``cache``, or ``past_key_values`` before
  transformers 5.24): for a StaticKVCache it plans the step's positions once (per-row lengths,
  padding from ``attention_mask``), passes them to RoPE / position embeddings as ``position_ids``,
  drops the 2-D mask (positions carry padding and causality) and hands the cache to every attention
  layer as the keyword ``gptfast_cache``, which transformers forwards to the attention function
  (for families whose decoder layers drop those keywords, a pre-hook on each attention module adds
  it). A forward hook then advances the row lengths.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from gptfast_kernels.modules.static_kv_cache import StaticKVCache
from gptfast_kernels.ops._dispatch import is_tracing
from gptfast_kernels.ops.kv_cache_attention import checked_backend, kv_cache_attention, run_kv_cache_attention

FUSED = "gptfast_kernels"
UNFUSED = "gptfast_kernels_unfused"
# Call signatures a cache layer remembers as checked (see _attend): a decode loop has a few (prefill
# lengths, T = 1, k + 1), a long-lived cache fed prompts of many lengths would collect one per length.
MAX_CHECKED_SIGNATURES = 64
# transformers' keywords for a forward's cache: "cache" from 5.24 on, "past_key_values" before (from
# 5.24 deprecated, until 5.40), "cache_params" for Mamba models before 5.24
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def _plain_attention(query, key, value, attention_mask, scaling, softcap=None, sinks=None):
    """Attention with soft-capped scores and / or sinks in plain PyTorch, float32 softmax: q [B, Hq,
    T, D], k / v [B, Hkv, L, D], mask [B, 1, T, L] boolean (True: attend) or additive, or None
    (causal, the queries being the last T of the L keys), sinks [Hq] -> [B, T, Hq, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query @ key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        T, L = scores.shape[-2:]
        attention_mask = torch.ones(T, L, dtype=torch.bool, device=scores.device).tril(L - T)
    # masked scores at float32's lowest, not -inf, as transformers' eager attention: a query that may
    # attend to nothing (a left-padded row's padding) then gets finite weights rather than NaN, which
    # the next layer's keys and values would carry into every query of the row (0 * NaN)
    lowest = torch.finfo(scores.dtype).min
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, lowest)
    else:
        scores = (scores + attention_mask).clamp(min=lowest)
    L = scores.shape[-1]
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :L].to(value.dtype)
    return (probs @ value).transpose(1, 2).contiguous()


def _cached_attention(module, query, key, value, attention_mask, *, backend: str, scaling=None, dropout=0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, attention_chunk_size: int | None = None,
                      alibi_slopes: torch.Tensor | None = None, gptfast_cache: StaticKVCache | None = None,
                      gptfast_cache_layer: int | None = None, **kwargs):
    """transformers attention-function signature; q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv]
    with Dv <= D (the new tokens only, when a StaticKVCache is active) -> ([B, T, Hq, Dv], None). ``attention_chunk_size``
    (Llama 4's chunked layers: passed by models/llama4.py with a StaticKVCache only) becomes the
    kernel's ``chunk_size``. A layer whose buffers are a ring (sized for a window or a chunk) passes
    ``ring=True`` with that window or chunk. ``alibi_slopes`` [Hq] (passed by the own-attention families
    with ALiBi, with a StaticKVCache only) become the kernel's. ``gptfast_cache_layer``: the cache layer
    this call serves, where it is not the module's ``layer_idx`` (a looped model's later runs: models/dory.py)."""
    if gptfast_cache is None:
        if alibi_slopes is not None:  # (those families run transformers' own attention without one)
            raise ValueError("patch_model: alibi_slopes are served with a StaticKVCache only")
        if softcap is not None or s_aux is not None:
            if dropout:
                raise ValueError("patch_model: attention dropout with soft-capped scores or sinks is not supported "
                                 "(call model.eval())")
            return _plain_attention(query, key, value, attention_mask, scaling, softcap, s_aux), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if sliding_window is None:  # (a family whose window is in its mask alone: Family.window_in_mask)
        sliding_window = getattr(module, "_gptfast_sliding_window", None)
    if not torch.compiler.is_compiling():
        gptfast_cache.attention_calls += 1  # checked by after_forward
    positions = gptfast_cache.step_positions()
    layer_idx = module.layer_idx if gptfast_cache_layer is None else gptfast_cache_layer
    source = gptfast_cache.kv_sources[layer_idx]
    layer = gptfast_cache.layers[source]
    if source != layer_idx:
        # a layer reusing an earlier layer's keys and values (Gemma 4) gets that layer's new ones, which
        # the kernel writes again to the same slots (no change), and attends over its buffers; transformers
        # may run such layers for the last queries alone (logits_to_keep): those take the last positions
        T = query.shape[2]
        key, value, positions = key[:, :, -T:], value[:, :, -T:], positions[:, -T:]
    ring = layer.is_ring
    # the cache read the window / chunk off the config: the layer must attend with that one
    if layer.ring_window is not None and sliding_window != layer.ring_window:
        raise ValueError(f"StaticKVCache: layer {layer_idx}'s ring buffer was sized for a sliding window of "
                         f"{layer.ring_window} (the config's), but the layer attends with window {sliding_window}")
    if layer.ring_chunk is not None and attention_chunk_size != layer.ring_chunk:
        raise ValueError(f"StaticKVCache: layer {layer_idx}'s ring buffer was sized for an attention chunk of "
                         f"{layer.ring_chunk} (the config's), but the layer attends with attention_chunk_size "
                         f"{attention_chunk_size}")
    dtype = layer.keys.dtype
    # chunks as long as the layer's buffers never cut one (every position is in the first chunk) are not
    # passed; a ring's positions run past its slots, so there the chunk is always needed
    needs_chunk = attention_chunk_size and (ring or attention_chunk_size < layer.keys.shape[2])
    chunk = attention_chunk_size if needs_chunk else None
    value_width = None if layer.value_dim else value.shape[-1]
    if value_width is not None and value_width != key.shape[-1]:
        # values narrower than the keys (MiMo-V2-Flash): the layer's value buffers are as wide as its keys and
        # hold them zero-padded, and the output's columns past the values' width are dropped
        if value_width > key.shape[-1]:
            raise ValueError(f"StaticKVCache: layer {layer_idx}'s values are {value_width} wide, wider than its "
                             f"keys ({key.shape[-1]}); the cache holds values at most as wide as the keys")
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - value_width))
    out = _attend(layer, query.to(dtype), key.to(dtype), None if layer.value_dim else value.to(dtype), positions,
                  scaling, sliding_window, softcap, s_aux, ring, backend, chunk, alibi_slopes)
    if value_width is not None and value_width != out.shape[-1]:
        out = out[..., :value_width]
    # [B, T, Hq, D] contiguous, as transformers' attention functions return it (AFMoE .view()s it); for
    # T = 1 the transpose is contiguous already and this copies nothing
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _attend(layer, q, k, v, positions, scale, window, softcap, sinks, ring: bool, backend: str,
            chunk_size: int | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """kv_cache_attention over one cache layer's buffers (v None for a layer whose values are its
    keys' first ``value_dim`` numbers). Its input checks and backend choice cost more than a small
    model's kernel (tens of microseconds in Python, for every layer of every step), so in eager mode
    they run once per call signature (shapes, dtypes, devices and the scalar arguments: all they
    depend on) and the layer keeps the chosen backend; the position values are checked once per
    forward by plan_step. Compiled code traces the full wrapper (whose backend choice for graphs may
    differ from eager's)."""
    value_dim = layer.value_dim
    v_cache = None if value_dim else layer.values
    if torch.compiler.is_compiling():
        return kv_cache_attention(q, k, v, layer.keys, v_cache, positions, scale, window=window, softcap=softcap,
                                  sinks=sinks, ring=ring, value_dim=value_dim, chunk_size=chunk_size,
                                  alibi_slopes=alibi_slopes, backend=backend, check_positions=False)
    signature = (_tensor_signature(q), _tensor_signature(k), _tensor_signature(v), _tensor_signature(positions),
                 scale, window, softcap, ring, backend, _tensor_signature(sinks), chunk_size,
                 _tensor_signature(alibi_slopes))
    chosen = layer.checked_calls.get(signature)
    if chosen is None:
        chosen = checked_backend(q, k, v, layer.keys, v_cache, positions, scale, window, softcap, sinks, ring,
                                 value_dim, backend, chunk_size, alibi_slopes)
        if len(layer.checked_calls) >= MAX_CHECKED_SIGNATURES:  # prompts of ever new lengths: start afresh
            layer.checked_calls.clear()
        layer.checked_calls[signature] = chosen
    return run_kv_cache_attention(chosen, q, k, v, layer.keys, v_cache, positions, scale, window, softcap,
                                  sinks, ring, value_dim, chunk_size, alibi_slopes)


def _tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """What kv_cache_attention's input checks read of a tensor argument: shape, dtype, device."""
    return None if t is None else (t.shape, t.dtype, t.device)


def fused_attention(module, query, key, value, attention_mask, **kwargs):
    return _cached_attention(module, query, key, value, attention_mask, backend="auto", **kwargs)


def unfused_attention(module, query, key, value, attention_mask, **kwargs):
    return _cached_attention(module, query, key, value, attention_mask, backend="reference", **kwargs)


def register_attention_functions() -> None:
    """Idempotent: registers both attention functions and their mask builder (SDPA's)."""
    for name, function in ((FUSED, fused_attention), (UNFUSED, unfused_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)


def _tokens_of(args, kwargs) -> torch.Tensor:
    for value in (kwargs.get("input_ids"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError("a patched model needs input_ids or inputs_embeds")


def _check_left_padded(mask: torch.Tensor) -> None:
    """A hybrid model's rows may be padded on the left only: padding after a row's real tokens would
    still advance its recurrent state (the decay of a linear-attention layer applies to any input)."""
    mask = mask != 0
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("attention_mask: a hybrid model's recurrent (linear-attention) layers take padding on the "
                         "left only; padding after a row's real tokens would change its state (pad prompts on "
                         "the left, as transformers' generate does; gptfast_kernels.generate takes any padding)")


def _runs(geometry: tuple) -> str:
    """A cache geometry (per layer: (kv heads, head dim), or None) as runs: "2 x (8, 128), 1 x None"."""
    runs: list[list] = []
    for entry in geometry:
        if runs and runs[-1][1] == entry:
            runs[-1][0] += 1
        else:
            runs.append([1, entry])
    return ", ".join(f"{count} x {entry}" for count, entry in runs)


def static_cache_in(kwargs, names: tuple[str, ...] = CACHE_KEYWORDS) -> StaticKVCache | None:
    """The StaticKVCache a model or attention call got, by either of transformers' names for it
    (``cache`` from transformers 5.24 on, ``past_key_values`` before and, deprecated, after), or
    by another of ``names`` (Falcon's layers pass it to their attention as ``layer_past``)."""
    for name in names:
        if isinstance(kwargs.get(name), StaticKVCache):
            return kwargs[name]
    return None


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` still works there, with a FutureWarning), ``past_key_values`` before, but
    ``cache_params`` for Mamba models (which ignore a ``past_key_values``)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "cache_params") if name in parameters), "past_key_values")


def before_forward(model, args, kwargs):
    """Forward pre-hook (with_kwargs=True) of a patched model."""
    cache = static_cache_in(kwargs)
    if cache is None:
        return None
    if cache.geometry != model._gptfast_cache_geometry:
        keyword = next(name for name in CACHE_KEYWORDS if kwargs.get(name) is cache)
        raise ValueError(f"{keyword}: this StaticKVCache's layers hold (kv heads, head dim) "
                         f"{_runs(cache.geometry)}, this model needs {_runs(model._gptfast_cache_geometry)}; build "
                         "the cache from the model's own config")
    tokens = _tokens_of(args, kwargs)
    if tokens.dim() < 2 or tokens.shape[0] != cache.batch_size:
        raise ValueError(f"input_ids must be [B, T] with B = the StaticKVCache's batch_size "
                         f"({cache.batch_size}), got {list(tokens.shape)}")
    mask = kwargs.get("attention_mask")
    # The fused attention needs no mask (positions carry padding). A hybrid model's recurrent layers
    # do: they zero the padding's inputs, which would otherwise enter their states.
    hybrid_mask = mask[:, -tokens.shape[1]:] if mask is not None and cache.has_recurrent_layers else None
    if hybrid_mask is not None and tokens.shape[1] > 1 and not is_tracing():
        _check_left_padded(hybrid_mask)
    ready = getattr(model, "_gptfast_ready_for_cache", None)
    if ready is not None and not is_tracing():
        ready(model, cache)
    positions = cache.plan_step(tokens.shape[1], mask, kwargs.get("position_ids"),
                                hide_length=model._gptfast_fused_length_zero)
    # the cache goes on by the keyword this model's forward takes (the other one it would ignore: a
    # transformers before 5.24 given cache=, or 5.24's deprecated past_key_values= beside cache=None)
    kwargs = {name: value for name, value in kwargs.items() if name not in CACHE_KEYWORDS}
    kwargs.update({model._gptfast_cache_keyword: cache, "position_ids": positions.clamp(min=0),
                   "attention_mask": hybrid_mask, "gptfast_cache": cache})
    return args, kwargs


def before_attention(module, args, kwargs):
    """Forward pre-hook (with_kwargs=True) of the attention modules of a family whose decoder layers
    pass them the cache (as ``cache`` / ``past_key_values``, Falcon's as ``layer_past``) but drop the
    model's other keywords: the attention function gets the cache as ``gptfast_cache`` all the same."""
    cache = static_cache_in(kwargs, (*CACHE_KEYWORDS, "layer_past"))
    if cache is None or "gptfast_cache" in kwargs:
        return None
    return args, {**kwargs, "gptfast_cache": cache}


def after_forward(model, args, kwargs, output):
    """Forward hook (with_kwargs=True, always_call=True): the step succeeded, so the rows' lengths
    advance. In eager mode it also checks that every layer's attention got the cache: a model whose
    layers drop the attention keywords would otherwise have attended to the new tokens alone,
    silently. A forward that raised (output None) ends its step with the lengths unchanged, so the
    cache reports them again (a fused step's get_seq_length() may hide them: plan_step)."""
    cache = static_cache_in(kwargs)
    if cache is not None and output is None:
        cache.discard_step()
    elif cache is not None:
        layers = cache.attention_modules
        if not torch.compiler.is_compiling() and cache.attention_calls != layers:
            calls = cache.attention_calls
            cache.discard_step()  # the lengths stay: what this forward wrote is never read
            raise RuntimeError(f"patch_model: {calls} of this {type(model).__name__}'s {layers} attention layers "
                               "received the StaticKVCache; its layers do not pass transformers' attention "
                               "keywords on, so the fused path cannot serve it (its transformers version or "
                               "family is unsupported)")
        cache.commit_step()
    return None
