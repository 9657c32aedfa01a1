"""Building blocks of the Triton kv_cache_attention kernels (kv_cache_attention_decode.py,
kv_cache_attention_prefill.py): positions and the slots a query sees, plain and ring caches, the
scores and the online-softmax step, each also for a head dim in two blocks (kv_cache_attention.py
says why and when). Inlined into the kernels; nothing here launches."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from gptfast_kernels.triton import dot as _dot

LOG2_E = 1.0 / math.log(2.0)  # the kernels use exp2 / log2
LOG2E_: tl.constexpr = tl.constexpr(LOG2_E)  # the same, inside the kernels (attention sinks come in nats)
# Largest valid position of a ring cache (ring=True): positions are int32 in the kernels and the
# span ends (position + 1) must fit too. Larger values are padding.
MAX_RING_POSITION = 2**31 - 2
MAX_RING_POSITION_: tl.constexpr = tl.constexpr(MAX_RING_POSITION)


@triton.jit
def _clean_positions(pos, S, RING: tl.constexpr):
    """Positions outside [0, S) (ring: [0, MAX_RING_POSITION]) become -1 (padding): no slot outside
    the cache is ever touched, and position + 1 fits in int32."""
    if RING:
        return tl.where((pos >= 0) & (pos <= MAX_RING_POSITION_), pos, -1).to(tl.int32)
    return tl.where((pos >= 0) & (pos < S), pos, -1).to(tl.int32)


@triton.jit
def _first_slots(pos, window, CHUNK: tl.constexpr):
    """The first slot (ring: absolute position) a query at each (clean) position sees: its window's
    start, its chunk's start (CHUNK > 0, never with a window), or 0 (window 0). (A padding position's
    value is never used: _span_start skips it and no slot is allowed to it.)"""
    if CHUNK > 0:
        first = pos - pos % CHUNK
    else:
        first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    return first


@triton.jit
def _span_start(pos, first, span_end, S, RING: tl.constexpr):
    """The earliest of the first slots (ring: positions) of the non-padding positions; span_end
    when all are padding. Ring: int64 (the spans' tiles may pass 2^31 - 1), and never more than S
    positions before span_end, which only a caller breaking the span contract reaches: its results
    are unspecified, but no loop then runs over up to 2^31 positions."""
    # (one return: Triton types every return of a function alike, a constexpr branch's included)
    if RING:
        first = tl.minimum(tl.min(tl.where(pos >= 0, first, span_end), axis=0), span_end)
        start = tl.maximum(first, span_end - S).to(tl.int64)
    else:
        start = tl.minimum(tl.min(tl.where(pos >= 0, first, S), axis=0), span_end)
    return start


@triton.jit
def _ring_slots(n0, S, BLOCK_N: tl.constexpr):
    """The ring-cache slots of positions n0 .. n0 + BLOCK_N - 1 (n0 >= 0, int64): one 64-bit
    remainder, then int32 (slot + BLOCK_N fits)."""
    return ((n0 % S).to(tl.int32) + tl.arange(0, BLOCK_N)) % S


@triton.jit
def _soft_cap(s, cap, inv_cap):
    """cap * tanh(s / cap) for scores s and a cap in the same (log2) units, inv_cap = 1 / cap, to
    float32 rounding for any cap: where |s / cap| < 0.1, s times tanh's series in (s / cap)^2 (the
    exp2 form's 1 - e loses s / cap there, and s / cap itself may be subnormal under a huge cap:
    (s / cap)^2 then flushes to 0 and the result is s, as it should be); elsewhere tanh from exp2
    (no overflow: the exponent is never positive)."""
    x = s * inv_cap
    r = x * x
    series = s * (1.0 + r * (-1.0 / 3.0 + r * (2.0 / 15.0 + r * (-17.0 / 315.0))))
    e = tl.math.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = cap * ((1.0 - e) / (1.0 + e))
    return tl.where(tl.abs(x) < 0.1, series, tl.where(x < 0, -t, t))


@triton.jit
def _online_softmax_step(s, allowed, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """One key tile of the online softmax: scores s [M, N] (log2 domain), allowed [M, N], v [N, D]
    -> the running max m_i [M], sum l_i [M] and output acc [M, D] updated."""
    s = tl.where(allowed, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing allowed yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    # the row sum takes the probabilities as rounded for the dot: the output is then a weighted
    # mean of v whose weights' rounding largely cancels in the ratio (a third less 16-bit error)
    p = p.to(v.dtype)
    return m_new, l_i * alpha + tl.sum(p.to(tl.float32), axis=1), acc * alpha[:, None] + _dot(p, v, FP32_DOT)


@triton.jit
def _online_softmax_step_split(s, allowed, v, v_t, m_i, l_i, acc, acc_t, FP32_DOT: tl.constexpr):
    """_online_softmax_step for a head dim in two blocks (D > MAX_BLOCK_D): v [N, BLOCK_D] and
    v_t [N, BLOCK_DT] update acc [M, BLOCK_D] and acc_t [M, BLOCK_DT] with the same probabilities."""
    s = tl.where(allowed, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    p = p.to(v.dtype)
    return (m_new, l_i * alpha + tl.sum(p.to(tl.float32), axis=1), acc * alpha[:, None] + _dot(p, v, FP32_DOT),
            acc_t * alpha[:, None] + _dot(p, v_t, FP32_DOT))


@triton.jit
def _scores(q, k, qk_scale, cap_log2, inv_cap_log2, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """q [M, D] . k [N, D]^T -> scores [M, N] in the log2 domain, soft-capped when SOFTCAP."""
    s = _dot(q, tl.trans(k), FP32_DOT) * qk_scale
    if SOFTCAP:
        s = _soft_cap(s, cap_log2, inv_cap_log2)
    return s


@triton.jit
def _scores_split(q, k, q_t, k_t, qk_scale, cap_log2, inv_cap_log2, FP32_DOT: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """_scores for a head dim in two blocks (D > MAX_BLOCK_D): q [M, BLOCK_D] . k [N, BLOCK_D]^T
    + q_t [M, BLOCK_DT] . k_t [N, BLOCK_DT]^T, then scaled (and capped) once."""
    s = (_dot(q, tl.trans(k), FP32_DOT) + _dot(q_t, tl.trans(k_t), FP32_DOT)) * qk_scale
    if SOFTCAP:
        s = _soft_cap(s, cap_log2, inv_cap_log2)
    return s
