"""The Triton kv_cache_attention prefill kernels (T > DECODE_MAX_T): the scatter of the new K/V into the
cache, then tiled flash attention over the cache (kv_cache_attention.py has the design and launches
them)."""

import triton
import triton.language as tl

from gptfast_kernels.triton.kv_cache_attention_common import (LOG2E_, _clean_positions, _first_slots,
                                                              _online_softmax_step, _online_softmax_step_split,
                                                              _ring_slots, _scores, _scores_split, _span_start)


@triton.jit
def _kv_cache_attention_scatter_kernel(
        K_ptr, V_ptr, KC_ptr, VC_ptr, Pos_ptr, T, S, D,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_cb, stride_ch, stride_cs, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
        BLOCK_LATER: tl.constexpr, RING: tl.constexpr, DV: tl.constexpr):
    # DV > 0: values in the keys, only k is written (V_ptr / VC_ptr unused)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pos = _clean_positions(tl.load(Pos_ptr + b * T + offs_t, mask=offs_t < T, other=-1), S, RING)
    if RING:  # slots from here on (padding stays -1)
        pos = tl.where(pos >= 0, pos % S, -1)
    # With repeated slots (unchecked under capture / compile; ring: also positions S apart) the
    # row's last token writing a slot wins, as in a sequential scatter and the decode kernel:
    # earlier ones skip their store.
    overwritten = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for l0 in range(tl.program_id(0) * BLOCK_T, T, BLOCK_LATER):
        offs_l = l0 + tl.arange(0, BLOCK_LATER)
        later = _clean_positions(tl.load(Pos_ptr + b * T + offs_l, mask=offs_l < T, other=-1), S, RING)
        if RING:
            later = tl.where(later >= 0, later % S, -1)
        same = (later[None, :] == pos[:, None]) & (offs_l[None, :] > offs_t[:, None])
        overwritten = tl.maximum(overwritten, tl.max(same.to(tl.int32), axis=1))
    write = (pos >= 0) & (overwritten == 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = write[:, None] & (offs_d < D)[None, :]
    src_t = offs_t[:, None].to(tl.int64)
    k = tl.load(K_ptr + b * stride_kb + h * stride_kh + src_t * stride_kt + offs_d[None, :], mask=mask)
    if DV == 0:
        v = tl.load(V_ptr + b * stride_vb + h * stride_vh + src_t * stride_vt + offs_d[None, :], mask=mask)
    dst = b * stride_cb + h * stride_ch + pos[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
    tl.store(KC_ptr + dst, k, mask=mask)
    if DV == 0:
        tl.store(VC_ptr + dst, v, mask=mask)
    if BLOCK_DT > 0:  # the same for the head dim's second block (D > MAX_BLOCK_D)
        offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        mask = write[:, None] & (offs_dt < D)[None, :]
        k = tl.load(K_ptr + b * stride_kb + h * stride_kh + src_t * stride_kt + offs_dt[None, :], mask=mask)
        if DV == 0:
            v = tl.load(V_ptr + b * stride_vb + h * stride_vh + src_t * stride_vt + offs_dt[None, :], mask=mask)
        dst = b * stride_cb + h * stride_ch + pos[:, None].to(tl.int64) * stride_cs + offs_dt[None, :]
        tl.store(KC_ptr + dst, k, mask=mask)
        if DV == 0:
            tl.store(VC_ptr + dst, v, mask=mask)


@triton.jit
def _kv_cache_attention_prefill_kernel(
        Q_ptr, KC_ptr, VC_ptr, Pos_ptr, Sinks_ptr, Alibi_ptr, Out_ptr, qk_scale, cap_log2, inv_cap_log2, window, T,
        S, D, G, Hq, stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs,
        FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, RING: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
        DV: tl.constexpr, CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr = False):
    # BLOCK_DT > 0 (D > MAX_BLOCK_D): head-dim columns BLOCK_D.. are a second block (the "_t" tensors).
    # DV > 0: values in the keys (VC_ptr unused), as in the decode kernel. HAS_ALIBI: as in the decode kernel.
    TAIL_VALUES: tl.constexpr = BLOCK_DT > 0 and (DV == 0 or DV > BLOCK_D)  # acc_t needed
    # The last (longest) query tiles first, so the short ones fill the tail of the grid.
    offs_m = ((tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    row_ok = offs_m < T
    pos_m = _clean_positions(tl.load(Pos_ptr + b * T + offs_m, mask=row_ok, other=-1), S, RING)
    tile_len = tl.max(pos_m, axis=0) + 1  # positions need not be sorted: the tile's largest
    first_m = _first_slots(pos_m, window, CHUNK)
    tile_first = _span_start(pos_m, first_m, tile_len, S, RING)  # ring: key tiles walk positions
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(Q_ptr + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_DT > 0:
        offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        mask_dt = offs_dt < D
        q_t = tl.load(Q_ptr + b * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qt + offs_dt[None, :],
                      mask=row_ok[:, None] & mask_dt[None, :], other=0.0)
    kv_head = b * stride_cb + (hq // G) * stride_ch
    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_SINKS:  # a first slot of score sink and value 0
        m_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32) + tl.load(Sinks_ptr + hq) * LOG2E_
        l_i = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if TAIL_VALUES:
        acc_t = tl.zeros((BLOCK_M, BLOCK_DT), dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi_ptr + hq) * LOG2E_
    for n0 in range(tile_first, tile_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < tile_len
        if RING:
            rows = kv_head + _ring_slots(n0, S, BLOCK_N)[:, None].to(tl.int64) * stride_cs
        else:
            rows = kv_head + offs_n[:, None].to(tl.int64) * stride_cs
        offs = rows + offs_d[None, :]
        kv_mask = in_range[:, None] & mask_d[None, :]
        k = tl.load(KC_ptr + offs, mask=kv_mask, other=0.0)
        if DV == 0:
            v = tl.load(VC_ptr + offs, mask=kv_mask, other=0.0)
        else:  # the key tile itself: its columns from DV on never reach the output
            v = k
        if BLOCK_DT > 0:  # the same for the head dim's second block
            offs = rows + offs_dt[None, :]
            kv_mask = in_range[:, None] & mask_dt[None, :]
            k_t = tl.load(KC_ptr + offs, mask=kv_mask, other=0.0)
            if DV == 0:
                v_t = tl.load(VC_ptr + offs, mask=kv_mask, other=0.0)
            elif TAIL_VALUES:  # DV > BLOCK_D: the values reach into the tail
                v_t = k_t
            s = _scores_split(q, k, q_t, k_t, qk_scale, cap_log2, inv_cap_log2, FP32_DOT, SOFTCAP)
        else:
            s = _scores(q, k, qk_scale, cap_log2, inv_cap_log2, FP32_DOT, SOFTCAP)
        if HAS_ALIBI:
            s += slope * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
        allowed = ((offs_n[None, :] <= pos_m[:, None]) & (offs_n[None, :] >= first_m[:, None])
                   & in_range[None, :])
        if TAIL_VALUES:
            m_i, l_i, acc, acc_t = _online_softmax_step_split(s, allowed, v, v_t, m_i, l_i, acc, acc_t, FP32_DOT)
        else:  # one value block (values in the keys with DV <= BLOCK_D: a tail only adds to the scores)
            m_i, l_i, acc = _online_softmax_step(s, allowed, v, m_i, l_i, acc, FP32_DOT)
    norm = tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: zeros
    out = acc / norm
    rows = (b * Hq + hq) * T + offs_m
    if DV > 0:  # output rows of DV columns
        out_d, out_mask_d = DV, offs_d < DV
        if TAIL_VALUES:
            out_mask_dt = offs_dt < DV
    else:
        out_d, out_mask_d = D, mask_d
        if TAIL_VALUES:
            out_mask_dt = mask_dt
    tl.store(Out_ptr + rows[:, None] * out_d + offs_d[None, :], out.to(Out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_mask_d[None, :])
    if TAIL_VALUES:
        tl.store(Out_ptr + rows[:, None] * out_d + offs_dt[None, :], (acc_t / norm).to(Out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & out_mask_dt[None, :])
