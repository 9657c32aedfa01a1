"""Fused static-KV-cache attention with position scatter (API.md section 1)."""

from __future__ import annotations

import torch

from gptfast_kernels import _extension
from gptfast_kernels.ops import reference
from gptfast_kernels.ops._dispatch import (FLOAT_DTYPES, check_same_device, check_tensor, gpu_backend, needs_grad,
                                           is_tracing, real_number, resolve_backend, tracing_or_dispatch_mode)

OP = "kv_cache_attention"
# Multi-head latent attention runs as multi-query attention over its latents of r + dr = 512 + 64 = 576
# (DeepSeek-V2 / V3, Kimi-K2, GLM-4.7-Flash; models/latent_attention.py); Gemma 4's global layers
# take 512. Every backend takes 1..576 (csrc/kv_cache_attention.cpp checks it too).
MAX_HEAD_DIM = 576
MAX_WINDOW = 2**31 - 1  # the kernels hold positions and windows as int32
MAX_CHUNK_SIZE = 2**31 - 1  # and chunk sizes


# the smallest normal float32: the kernels take the cap as a float32, where 0 means "no cap"
SOFTCAP_MIN = torch.finfo(torch.float32).tiny
# The largest |scale| and softcap: the kernels hold both as float32 times log2(e) (they use exp2),
# which must stay finite (float32's largest is just under 2^128), and the GPU kernels the cap's
# inverse too, which must stay a normal float32 (flushed to 0 below 2^-126).
MAX_SCALE = 2.0**126
SOFTCAP_MAX = 2.0**125


def check_inputs(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring, value_dim,
                 chunk_size=None, alibi_slopes=None, op: str = OP) -> None:
    check_tensor(op, "q", q, dtypes=FLOAT_DTYPES, ndim=4)
    if value_dim is not None:
        if isinstance(value_dim, bool) or not isinstance(value_dim, int) or not 1 <= value_dim <= q.shape[-1]:
            raise ValueError(f"{op}: value_dim must be None or an int in 1..D = 1..{q.shape[-1]} (the values being "
                             f"the keys' first value_dim numbers), got {value_dim!r}")
        for name, t in (("v", v), ("v_cache", v_cache)):
            if t is not None:
                raise ValueError(f"{op}: with value_dim the values are read from k_cache, so {name} must be None, "
                                 f"got {type(t).__name__}")
        v, v_cache = k, k_cache  # checked as such below
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t, ndim=4)
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
    check_tensor(op, "positions", positions, dtypes=(torch.int32, torch.int64), ndim=(1, 2))
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if tuple(k.shape) != (B, Hkv, T, D):
        raise ValueError(f"{op}: k must have shape [B, Hkv, T, D] = [{B}, Hkv, {T}, {D}] to match "
                         f"q {list(q.shape)}, got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{op}: v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    if Hkv == 0 or Hq == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: q's heads (Hq = {Hq}) must be a positive multiple of k's heads "
                         f"(Hkv = {Hkv})")
    if D == 0 or D > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D must be in 1..{MAX_HEAD_DIM}, got {D}")
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"{op}: k_cache must have shape [B, Hkv, S, D] = [{B}, {Hkv}, S, {D}], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (it is written in place)")
    expected_positions = ((T,), (B, T))
    if tuple(positions.shape) not in expected_positions:
        raise ValueError(f"{op}: positions must have shape [T] = [{T}] or [B, T] = [{B}, {T}], "
                         f"got {list(positions.shape)}")
    scale_value, softcap_value = real_number(scale), real_number(softcap)  # (NaN fails every comparison)
    if scale is not None and (scale_value is None or not abs(scale_value) <= MAX_SCALE):
        raise ValueError(f"{op}: scale must be None or a number with |scale| <= 2^126 (finite as float32 "
                         f"times log2(e)), got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= MAX_WINDOW):
        raise ValueError(f"{op}: window must be None or an int in 1..{MAX_WINDOW} (the number of latest "
                         f"slots a query sees, itself included), got {window!r}")
    if softcap is not None and (softcap_value is None or not SOFTCAP_MIN <= softcap_value <= SOFTCAP_MAX):
        # (a smaller cap would flush to zero in float32, which the kernels read as "no cap")
        raise ValueError(f"{op}: softcap must be None or a number in [{SOFTCAP_MIN}, 2^125], got {softcap!r}")
    if not isinstance(ring, bool):
        raise ValueError(f"{op}: ring must be True or False, got {ring!r}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"{op}: chunk_size must be None or an int in 1..{MAX_CHUNK_SIZE} (the tokens per chunk "
                             f"of chunked attention), got {chunk_size!r}")
        # a query's chunk and a window are two different rules for what it sees
        if window is not None:
            raise ValueError(f"{op}: chunk_size (chunked attention) cannot be combined with a window; "
                             f"got chunk_size {chunk_size}, window {window!r}")
    # a ring buffer must hold every position a query sees: its window, or its chunk
    reach = query_reach(window, chunk_size)
    if ring and (reach is None or reach > k_cache.shape[2]):
        raise ValueError(f"{op}: ring=True (a ring-buffer cache) needs a window or a chunk_size in 1..S = "
                         f"1..{k_cache.shape[2]}, the cache's slots; got window {window!r}, chunk_size {chunk_size!r}")
    _check_per_head("sinks", sinks, "logit", FLOAT_DTYPES, q.shape[1], op)
    _check_per_head("alibi_slopes", alibi_slopes, "slope", (*FLOAT_DTYPES, torch.float64), q.shape[1], op)
    check_same_device(op, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, positions=positions, sinks=sinks,
                      alibi_slopes=alibi_slopes)


def _check_per_head(name: str, tensor: torch.Tensor | None, what: str, dtypes, heads: int, op: str = OP) -> None:
    """A per-query-head vector argument (``sinks``, ``alibi_slopes``): None, or [Hq] of ``dtypes``."""
    if tensor is None:
        return
    check_tensor(op, name, tensor, dtypes=dtypes, ndim=1)
    if tensor.shape[0] != heads:
        raise ValueError(f"{op}: {name} must have one {what} per query head, [Hq] = [{heads}], "
                         f"got {list(tensor.shape)}")


def query_reach(window: int | None, chunk_size: int | None) -> int | None:
    """The most positions a query sees, which a ring buffer's slots must cover: a window's W, or a
    chunk's C (a query at p sees p - p % C .. p); None with neither (the two never come together)."""
    return window if window is not None else chunk_size


def _check_position_values(positions: torch.Tensor, S: int, window: int | None, ring: bool,
                           chunk_size: int | None = None) -> None:
    """Value checks that need the data (one host synchronisation); skipped while tracing."""
    if positions.numel() == 0:
        return
    rows = positions if positions.dim() == 2 else positions.unsqueeze(0)
    sorted_rows = rows.sort(dim=-1).values.to(torch.int64)
    repeated = ((sorted_rows[:, 1:] == sorted_rows[:, :-1]) & (sorted_rows[:, 1:] >= 0)).any()
    facts = [sorted_rows[:, 0].min(), sorted_rows[:, -1].max(), repeated.to(torch.int64)]
    if ring:  # the longest span of a row: its largest valid position minus its smallest (0: padding only)
        smallest = torch.where(sorted_rows >= 0, sorted_rows, sorted_rows[:, -1:]).min(dim=-1).values
        facts.append((sorted_rows[:, -1] - smallest).clamp(min=0).max())
    # one host synchronisation for all of them
    low, high, any_repeated, *span = torch.stack(facts).tolist()
    limit = MAX_WINDOW if ring else S
    if low < -1 or high >= limit:
        raise ValueError(f"{OP}: positions must lie in [-1, {'2^31 - 1' if ring else 'S'}) = [-1, {limit}) "
                         f"(-1 marks padding); got values from {low} to {high}")
    if ring:
        bound, reach = ("window", window) if window is not None else ("chunk_size", chunk_size)
        if span[0] + reach > S:
            raise ValueError(f"{OP}: with ring=True a row's positions may span at most S - {bound} = {S - reach} "
                             f"(its new tokens would overwrite slots its queries read), got a span of {span[0]}")
    if any_repeated:
        raise ValueError(f"{OP}: positions must not repeat a slot within a row (two tokens "
                         "cannot be written to one cache slot)")


# Measured on an H100 (bench/results/nvidia-h100-80gb-hbm3_2026-11-23_*, Llama-3-8B heads, half
# fill), eager calls: the CUDA kernel is the faster for one row of 8 kv heads (T = 1 at S = 32768: 93 us
# against Triton's 189), Triton's split kernel from 8 rows on (B = 32, T = 1, S = 32768: 1.09 ms against
# 2.27) and for verification at long caches (B = 1, T = 5, S = 32768: 92 us against 271); but on
# short caches the CUDA kernel's single launch wins at any batch (S = 2048, T = 1: 60 / 183 us at
# B = 8 / 32 against 80 / 217), and for verification up to 8 rows (B = 8, T = 5: 173 against 250;
# B = 32: 565 against 202). Much of Triton's eager time is its launcher on the host, which a CUDA
# graph does not replay: on an H200 (bench/results/nvidia-h200_2026-11-28_*), in CUDA graphs, Triton
# is the faster in every case measured, 1 to 32 rows, T = 1 and 5, S = 2048 to 32768 (B = 1, T = 1,
# S = 8192: 24 us against 38; 31 such layers back to back: 0.63 ms against 0.99; B = 8, T = 5: 132 us
# against 650), so under torch.compile or a graph capture (``graphed``) auto takes Triton. Both GPU
# kernels take every head dim up to MAX_HEAD_DIM; these rules were measured at D = 128 only, so for
# larger heads (Gemma 4's 512, MLA's 576) a graph keeps the eager rule. bench/check_auto.py holds the
# rules against a run.
CUDA_MAX_HEAD_ROWS = 8
CUDA_MAX_SLOTS_FOR_VERIFY = 8192
CUDA_MAX_SLOTS_ANY_ROWS = 2048
CUDA_MAX_HEAD_ROWS_SHORT_VERIFY = 64
GRAPHED_TRITON_MAX_HEAD_DIM = 128


def auto_backend(usable: list[str], head_rows: int, T: int, S: int, head_dim: int = 128,
                 graphed: bool = False) -> str:
    """backend="auto" for ``head_rows`` = B * Hkv (batch rows times kv heads), T new tokens, a cache
    of S slots and heads of ``head_dim``, eager or ``graphed`` (traced by torch.compile or captured
    in a CUDA graph): on a GPU the CUDA kernel or Triton by shape (only sizes known on the host, so
    a CUDA graph keeps its choice), on a CPU the C++ kernel; else the reference."""
    if graphed and head_dim <= GRAPHED_TRITON_MAX_HEAD_DIM:
        return gpu_backend(usable, False)
    few_rows = head_rows <= CUDA_MAX_HEAD_ROWS and (T == 1 or S <= CUDA_MAX_SLOTS_FOR_VERIFY)
    short_cache = S <= CUDA_MAX_SLOTS_ANY_ROWS and (T == 1 or head_rows <= CUDA_MAX_HEAD_ROWS_SHORT_VERIFY)
    return gpu_backend(usable, few_rows or short_cache)


def kv_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor | None, positions: torch.Tensor, scale: float | None = None,
                       *, window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None, ring: bool = False, value_dim: int | None = None,
                       chunk_size: int | None = None, alibi_slopes: torch.Tensor | None = None,
                       backend: str = "auto", check_positions: bool = True) -> torch.Tensor:
    """Writes k, v into the caches at ``positions`` and attends, in one kernel launch.

    q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D] (mutated in place);
    positions [B, T] or [T] int32/int64, -1 = padding -> out [B, Hq, T, D] in q's dtype.
    Query (b, t) attends to cache slots 0..positions[b, t] of its head group; with a sliding
    ``window`` (Mistral, Gemma 2 / 3, Qwen2 ...) to the latest ``window`` of them only,
    positions[b, t] - window < slot <= positions[b, t], and the kernels read no slot before that.
    ``softcap`` caps the scaled scores at +-softcap by softcap * tanh(score / softcap) (Gemma 2).
    ``sinks`` [Hq] adds one logit per query head to the softmax's denominator, attending to nothing
    (GPT-OSS's attention sinks): out = sum_s e^(score_s) v_s / (e^sink + sum_s e^(score_s)).
    ``ring=True``: the caches are ring buffers (a sliding-window layer's, window <= S, or a chunked
    layer's, chunk_size <= S): position p lives in slot p % S, positions may exceed S, and a row's new
    positions may span at most S - window (S - chunk_size), so that no token written by this call
    overwrites a slot one of its queries reads.
    ``value_dim`` Dv (multi-head latent attention, whose keys are [latent, rope part] and whose
    values are the latent): the values are the keys' first Dv numbers, so there is no value cache
    (v and v_cache must be None), only k is written, and out is [B, Hq, T, Dv].
    ``chunk_size`` C (Llama 4's chunked attention, ``attention_chunk_size``): the sequence is cut into
    chunks of C positions and a query sees only its own chunk's slots up to itself,
    positions[b, t] - positions[b, t] % C <= slot <= positions[b, t] (with ``ring``: those positions,
    each read from its slot); not with ``window``.
    ``alibi_slopes`` [Hq] (ALiBi: BLOOM, MPT, Falcon-RW): query head h's score of the slot holding
    position s, for a query at position p, gains alibi_slopes[h] * (s - p) (after the soft cap; a
    linear penalty on distance for positive slopes). Slopes are taken as float32; a sink's logit
    gets no bias.
    In eager mode the position values are checked (one host synchronisation) unless
    ``check_positions=False``, for callers that validated them already (StaticKVCache checks them
    once per forward, not once per layer); the kernels never access memory out of bounds either way.
    """
    chosen = checked_backend(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring, value_dim,
                             backend, chunk_size, alibi_slopes)
    if check_positions and not tracing_or_dispatch_mode():
        _check_position_values(positions, k_cache.shape[2], window, ring, chunk_size)
    return run_kv_cache_attention(chosen, q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring,
                                  value_dim, chunk_size, alibi_slopes)


def checked_backend(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring, value_dim,
                    backend, chunk_size=None, alibi_slopes=None) -> str:
    """kv_cache_attention's input checks (all but the position values') and its backend choice: the
    backend ``run_kv_cache_attention`` may then be called with, for these inputs or any others of
    the same shapes, dtypes, devices and scalar arguments."""
    check_inputs(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring, value_dim, chunk_size,
                  alibi_slopes)
    return resolve_backend(OP, backend, q.device,
                           auto=lambda usable: auto_backend(usable, q.shape[0] * k.shape[1], q.shape[2],
                                                            k_cache.shape[2], q.shape[3], is_tracing()))


class _NoGradient(torch.autograd.Function):
    """The op's output as it is, tied to the inputs that require a gradient, with a backward that
    raises: the op writes the cache in place and has no gradient, and a backward must not pass by
    its inputs silently (the kernels' outputs would be constants, or the autograd fallback would give
    them no gradient with a warning)."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("kv_cache_attention has no gradient (it writes the new keys and values into the cache "
                           "in place), so backward cannot reach q, k, v; train without a StaticKVCache (a patched "
                           "model then runs transformers' own attention), or run the forward under torch.no_grad()")


def run_kv_cache_attention(chosen: str, q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks,
                           ring, value_dim=None, chunk_size=None, alibi_slopes=None) -> torch.Tensor:
    """kv_cache_attention on inputs that passed ``checked_backend``, which returned ``chosen`` (the
    patched attention's path: it checks each layer's inputs once per shape, not on every call)."""
    if needs_grad(q, k, v, sinks, alibi_slopes):
        with torch.no_grad():
            out = run_kv_cache_attention(chosen, q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks,
                                         ring, value_dim, chunk_size, alibi_slopes)
        return _NoGradient.apply(out, *(t for t in (q, k, v, sinks, alibi_slopes) if t is not None))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if chosen == "reference":
        return reference.kv_cache_attention(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks,
                                            ring, value_dim, chunk_size, alibi_slopes)
    if value_dim is not None:  # the kernels take empty, unused v and v_cache, and value_dim 0 for "v_cache"
        v = v_cache = q.new_empty(0)
    value_dim = value_dim or 0
    # the kernels' encoding of "none": window 0, softcap 0, chunk_size 0
    window = 0 if window is None else window
    softcap = 0.0 if softcap is None else float(softcap)
    chunk_size = chunk_size or 0
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    if positions.dim() != 2 or positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = reference.broadcast_positions(positions, q.shape[0]).contiguous()
    # kernels take any strides except in the head dim (HF's [B, T, H, D] -> [B, H, T, D] views pass)
    q, k, v = _unit_head_stride(q), _unit_head_stride(k), _unit_head_stride(v)
    if chosen == "triton":  # (checked above; see tracing_or_dispatch_mode)
        from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton, kv_cache_attention_unchecked

        run = kv_cache_attention_triton if tracing_or_dispatch_mode() else kv_cache_attention_unchecked
        return run(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring, value_dim, chunk_size,
                   alibi_slopes)
    return torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, positions, scale, window,
                                                        softcap, sinks, ring, value_dim, chunk_size, alibi_slopes)


def _unit_head_stride(t: torch.Tensor) -> torch.Tensor:
    """t with stride 1 in its head (last) dim, which the kernels need: a copy where it has another
    stride, or, for a head dim of one number (whose stride indexes nothing, so .contiguous() keeps
    it), a view of the same memory with stride 1."""
    if t.stride(-1) == 1:
        return t
    if t.shape[-1] == 1:
        return t.as_strided(t.shape, (*t.stride()[:-1], 1))
    return t.contiguous()


def output_shape(q: torch.Tensor, value_dim: int) -> tuple[int, ...]:
    """The op's output shape: q's, with a head dim of value_dim when the values are in the keys."""
    return (*q.shape[:-1], value_dim or q.shape[-1])


def kv_cache_attention_fake(q, k, v, k_cache, v_cache, positions, scale, window=0, softcap=0.0, sinks=None,
                            ring=False, value_dim=0, chunk_size=0, alibi_slopes=None):
    """The fake (meta) implementation of the C++ and Triton kv_cache_attention ops; also their Meta
    kernel, so a call with one argument on meta and the rest elsewhere raises rather than answers."""
    check_same_device(OP, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, positions=positions, sinks=sinks,
                      alibi_slopes=alibi_slopes)
    # the kernels return a contiguous tensor, whatever q's strides
    return q.new_empty(output_shape(q, value_dim))


if _extension.has_kernel(OP, "CPU"):
    torch.library.register_fake(f"gptfast_kernels::{OP}")(kv_cache_attention_fake)
