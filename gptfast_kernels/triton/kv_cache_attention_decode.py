"""The Triton kv_cache_attention decode / verification kernels (T <= DECODE_MAX_T): flash-decoding over
splits of a row's slots with the scatter fused in, and the combine of the splits' partial outputs
(kv_cache_attention.py has the design and launches them)."""

import triton
import triton.language as tl

from gptfast_kernels.triton import allow_dependents, wait_for_inputs
from gptfast_kernels.triton.kv_cache_attention_common import (LOG2E_, _clean_positions, _first_slots,
                                                              _online_softmax_step, _online_softmax_step_split,
                                                              _ring_slots, _scores, _scores_split, _span_start)


@triton.jit
def _row_split(Pos_ptr, b, T, S, window, NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr):
    """Row b's T positions [BLOCK_T], the slots (ring: positions) [row_first, row_len) its queries
    see (row_len = largest position + 1; row_first > 0 only with a window or chunks) and the slots
    per split: the same in the attention and the combine kernel, a multiple of BLOCK_N."""
    offs_t = tl.arange(0, BLOCK_T)
    pos = _clean_positions(tl.load(Pos_ptr + b * T + offs_t, mask=offs_t < T, other=-1), S, RING)
    row_len = tl.max(pos, axis=0) + 1
    row_first = _span_start(pos, _first_slots(pos, window, CHUNK), row_len, S, RING)
    split_len = tl.cdiv(tl.cdiv(row_len - row_first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return pos, row_first, row_len, tl.maximum(split_len, MIN_SPLIT_LEN)


@triton.jit
def _new_rows(src_ptr, offs_t, T, stride_t, offs_d, mask_d):
    """One head's new rows offs_t (< T) of src_ptr (token stride stride_t), columns offs_d where
    mask_d -> [BLOCK_T, len(offs_d)]."""
    return tl.load(src_ptr + offs_t[:, None].to(tl.int64) * stride_t + offs_d[None, :],
                   mask=(offs_t < T)[:, None] & mask_d[None, :])


@triton.jit
def _store_rows(cache_ptr, cache_rows, write, rows, offs_d, mask_d):
    """rows [BLOCK_T, len(offs_d)] where `write`, columns offs_d where mask_d, into the cache rows at
    offsets cache_rows (slot x slot stride) from cache_ptr."""
    tl.store(cache_ptr + cache_rows[:, None] + offs_d[None, :], rows, mask=write[:, None] & mask_d[None, :])


@triton.jit
def _kv_cache_attention_decode_kernel(
        Q_ptr, K_ptr, V_ptr, KC_ptr, VC_ptr, Pos_ptr, Sinks_ptr, Alibi_ptr, Out_ptr, OPart_ptr, LsePart_ptr,
        Count_ptr, qk_scale, cap_log2, inv_cap_log2, window, T, S, D, G, Hq,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_cb, stride_ch, stride_cs,
        NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, NUM_M_BLOCKS: tl.constexpr,
        FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, RING: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DT: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr = False,
        PDL: tl.constexpr = False, FUSED_COMBINE: tl.constexpr = False, COMBINE_ROWS: tl.constexpr = 1,
        COMBINE_SPLITS: tl.constexpr = 1):
    # PDL: a programmatic dependent launch (gptfast_kernels.triton.programmatic_launch). Everything
    # this kernel reads may come from the kernel before it, so it waits first. It lets the next
    # kernel launch only after its tile loop (below). Called first (as through 016c046), it let the
    # combine kernel, and through it the next layer's programs, become resident while this grid ran,
    # waiting and holding slots: the guess for why the H200 timed the attention 10-20 % slower so
    # (a284fc8); the late call is not timed yet.
    wait_for_inputs(PDL)
    # Ring: splits, tiles and the fused scatter's ownership work on positions, the cache on their slots.
    # A row's span is at most S positions (row_first), so its splits own distinct slots.
    # BLOCK_DT > 0 (D > MAX_BLOCK_D): head-dim columns BLOCK_D.. are a second block (the "_t" tensors).
    # DV > 0: values in the keys (V_ptr / VC_ptr unused); the output holds the key tiles' first DV columns.
    # HAS_ALIBI: scores gain Alibi_ptr[head] * (position - query position) (log2 units after LOG2E_).
    # FUSED_COMBINE (NUM_SPLITS > 1): no combine kernel; the last split program of each (row, kv head,
    # query-row block) to store its partials combines them (_combine_if_last), counted in Count_ptr.
    TAIL_VALUES: tl.constexpr = BLOCK_DT > 0 and (DV == 0 or DV > BLOCK_D)  # acc_t needed
    split = tl.program_id(0)
    h = (tl.program_id(1) // NUM_M_BLOCKS).to(tl.int64)  # h * stride_ch may pass 2^31
    m_block = tl.program_id(1) % NUM_M_BLOCKS
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if BLOCK_DT > 0:
        offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        mask_dt = offs_dt < D
    k_new_ptr = K_ptr + b * stride_kb + h * stride_kh
    kc_ptr = KC_ptr + b * stride_cb + h * stride_ch
    if DV == 0:  # values in v / v_cache
        v_new_ptr = V_ptr + b * stride_vb + h * stride_vh
        vc_ptr = VC_ptr + b * stride_cb + h * stride_ch

    # Rows of the tile: m = g * T + t for query head h * G + g and token t.
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < G * T
    t_m = offs_m % T
    hq_m = (h * G + offs_m // T).to(tl.int64)
    pos_m = _clean_positions(tl.load(Pos_ptr + b * T + t_m, mask=row_ok, other=-1), S, RING)
    first_m = _first_slots(pos_m, window, CHUNK)
    # 16-bit: the queries are loaded here, beside the positions and the new rows, so the first key
    # tiles' loads after the barrier wait for none of them. float32 (the correctness path) loads them
    # after the barrier: held across it, a large head's float32 queries make ptxas spill.
    EARLY_Q: tl.constexpr = not FP32_DOT
    q_row_ptrs = Q_ptr + b * stride_qb + hq_m[:, None] * stride_qh + t_m[:, None] * stride_qt
    if EARLY_Q:
        q = tl.load(q_row_ptrs + offs_d[None, :], mask=row_ok[:, None] & mask_d[None, :], other=0.0)
        if BLOCK_DT > 0:
            q_t = tl.load(q_row_ptrs + offs_dt[None, :], mask=row_ok[:, None] & mask_dt[None, :], other=0.0)

    # The fused scatter, before any read of the cache: this program writes the new K/V of the tokens
    # whose positions fall in its range [start, end) into the cache, waits for its threads' stores,
    # and then reads the cache alone. Only it reads those slots (the splits' ranges are disjoint); the
    # programs of the other query-row blocks of the same range store the same bytes. With a position
    # repeated in the row, the last token writing it wins, as in a sequential scatter. The new rows
    # are loaded first, all T of them whoever owns them, so their loads wait for nothing (a few hundred
    # bytes, from L2 for all but one program) and run beside the positions' load.
    offs_t = tl.arange(0, BLOCK_T)
    k_rows = _new_rows(k_new_ptr, offs_t, T, stride_kt, offs_d, mask_d)
    if DV == 0:
        v_rows = _new_rows(v_new_ptr, offs_t, T, stride_vt, offs_d, mask_d)
    if BLOCK_DT > 0:  # the head dim's second block
        k_rows_t = _new_rows(k_new_ptr, offs_t, T, stride_kt, offs_dt, mask_dt)
        if DV == 0:
            v_rows_t = _new_rows(v_new_ptr, offs_t, T, stride_vt, offs_dt, mask_dt)
    pos_row, row_first, row_len, split_len = _row_split(Pos_ptr, b, T, S, window, NUM_SPLITS, MIN_SPLIT_LEN,
                                                        BLOCK_N, BLOCK_T, RING, CHUNK)
    start = row_first + split * split_len
    if NUM_SPLITS > 1:
        if FUSED_COMBINE:  # split 0 of a row with nothing to attend to (all padding) writes its zeros
            if (split > 0) & (start >= row_len):
                return
        elif start >= row_len:  # nothing of this row here: the combine kernel skips this split
            return
    end = tl.minimum(start + split_len, row_len)
    owned = (pos_row >= start) & (pos_row < end)  # padding (-1) never: start >= 0
    repeated = (pos_row[None, :] == pos_row[:, None]) & (offs_t[None, :] > offs_t[:, None])
    write = owned & (tl.max(repeated.to(tl.int32), axis=1) == 0)
    if RING:
        write_rows = (pos_row.to(tl.int64) % S) * stride_cs
    else:
        write_rows = pos_row.to(tl.int64) * stride_cs
    _store_rows(kc_ptr, write_rows, write, k_rows, offs_d, mask_d)
    if DV == 0:
        _store_rows(vc_ptr, write_rows, write, v_rows, offs_d, mask_d)
    if BLOCK_DT > 0:
        _store_rows(kc_ptr, write_rows, write, k_rows_t, offs_dt, mask_dt)
        if DV == 0:
            _store_rows(vc_ptr, write_rows, write, v_rows_t, offs_dt, mask_dt)
    tl.debug_barrier()  # the stores above are visible to every thread of the program from here on
    if not EARLY_Q:
        q = tl.load(q_row_ptrs + offs_d[None, :], mask=row_ok[:, None] & mask_d[None, :], other=0.0)
        if BLOCK_DT > 0:
            q_t = tl.load(q_row_ptrs + offs_dt[None, :], mask=row_ok[:, None] & mask_dt[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # with several splits the combine adds the sink, once
        m_i = tl.where(row_ok, tl.load(Sinks_ptr + hq_m, mask=row_ok, other=0.0) * LOG2E_, m_i)
        l_i = tl.where(row_ok, 1.0, l_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if TAIL_VALUES:
        acc_t = tl.zeros((BLOCK_M, BLOCK_DT), dtype=tl.float32)
    if HAS_ALIBI:  # each row's head's slope, log2 units
        slope_m = tl.load(Alibi_ptr + hq_m, mask=row_ok, other=0.0) * LOG2E_
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        if RING:
            cache_rows = _ring_slots(n0, S, BLOCK_N)[:, None].to(tl.int64) * stride_cs
        else:
            cache_rows = offs_n[:, None].to(tl.int64) * stride_cs
        tile_mask = in_range[:, None] & mask_d[None, :]
        k = tl.load(kc_ptr + cache_rows + offs_d[None, :], mask=tile_mask, other=0.0)
        if DV == 0:
            v = tl.load(vc_ptr + cache_rows + offs_d[None, :], mask=tile_mask, other=0.0)
        else:  # the key tile itself: its columns from DV on never reach the output
            v = k
        if BLOCK_DT > 0:  # the same for the head dim's second block
            tile_mask = in_range[:, None] & mask_dt[None, :]
            k_t = tl.load(kc_ptr + cache_rows + offs_dt[None, :], mask=tile_mask, other=0.0)
            if DV == 0:
                v_t = tl.load(vc_ptr + cache_rows + offs_dt[None, :], mask=tile_mask, other=0.0)
            elif TAIL_VALUES:  # DV > BLOCK_D: the values reach into the tail
                v_t = k_t
            s = _scores_split(q, k, q_t, k_t, qk_scale, cap_log2, inv_cap_log2, FP32_DOT, SOFTCAP)
        else:
            s = _scores(q, k, qk_scale, cap_log2, inv_cap_log2, FP32_DOT, SOFTCAP)
        if HAS_ALIBI:
            s += slope_m[:, None] * (offs_n[None, :] - pos_m[:, None]).to(tl.float32)
        allowed = ((offs_n[None, :] <= pos_m[:, None]) & (offs_n[None, :] >= first_m[:, None])
                   & in_range[None, :])
        if TAIL_VALUES:
            m_i, l_i, acc, acc_t = _online_softmax_step_split(s, allowed, v, v_t, m_i, l_i, acc, acc_t, FP32_DOT)
        else:  # one value block (values in the keys with DV <= BLOCK_D: a tail only adds to the scores)
            m_i, l_i, acc = _online_softmax_step(s, allowed, v, m_i, l_i, acc, FP32_DOT)
    allow_dependents(PDL)  # (a program that returned early above allows them by exiting)

    rows = (b * Hq + hq_m) * T + t_m  # row of the [B, Hq, T] output
    has_any = l_i > 0
    norm = tl.where(has_any, l_i, 1.0)[:, None]
    out = acc / norm
    if DV > 0:  # output rows of DV columns
        out_d, out_mask_d = DV, offs_d < DV
        if TAIL_VALUES:
            out_mask_dt = offs_dt < DV
    else:
        out_d, out_mask_d = D, mask_d
        if TAIL_VALUES:
            out_mask_dt = mask_dt
    store_mask = row_ok[:, None] & out_mask_d[None, :]
    if NUM_SPLITS == 1:  # padding rows (nothing allowed) get zeros
        out_rows = Out_ptr + rows[:, None] * out_d
    else:  # this split's float32 partial output, and its log2-sum-exp below
        lse = tl.where(has_any, m_i + tl.math.log2(tl.where(has_any, l_i, 1.0)), -float("inf"))
        part = rows * NUM_SPLITS + split
        out_rows = OPart_ptr + part[:, None] * out_d
    tl.store(out_rows + offs_d[None, :], out.to(out_rows.dtype.element_ty), mask=store_mask)
    if TAIL_VALUES:
        tl.store(out_rows + offs_dt[None, :], (acc_t / norm).to(out_rows.dtype.element_ty),
                 mask=row_ok[:, None] & out_mask_dt[None, :])
    if NUM_SPLITS > 1:
        tl.store(LsePart_ptr + part, lse, mask=row_ok)
        if FUSED_COMBINE:
            num_active = tl.maximum(tl.cdiv(row_len - row_first, split_len), 1)  # (split 0 of an empty row)
            group = (b * (Hq // G) + h) * NUM_M_BLOCKS + m_block
            _combine_if_last(Count_ptr + group, num_active, OPart_ptr, LsePart_ptr, Sinks_ptr, Out_ptr, b, h,
                             m_block, G, T, Hq, out_d, HAS_SINKS, NUM_SPLITS, BLOCK_M, COMBINE_ROWS,
                             COMBINE_SPLITS, BLOCK_D, BLOCK_DT, TAIL_VALUES)


@triton.jit
def _combine_if_last(count_ptr, num_active, OPart_ptr, LsePart_ptr, Sinks_ptr, Out_ptr, b, h, m_block, G, T, Hq,
                     out_d, HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                     COMBINE_ROWS: tl.constexpr, COMBINE_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DT: tl.constexpr, TAIL_VALUES: tl.constexpr):
    """The fused combine: a split program that has stored its partial outputs counts itself in
    count_ptr (zero before the call); the one that brings the count to num_active (every split that
    holds some of the row) reduces its query-row block's partials into Out_ptr and sets the count
    back to zero. A block barrier first, so that every thread's stores are issued before one
    thread's acquire-release atomic publishes them (as CUTLASS's semaphores do); the last program's
    loads follow its acquire (which invalidates its SM's L1: the partial rows' loads bypass L1 with
    .cg, the log-sum-exps' go through it). The reduction is an online log-sum-exp over steps
    of COMBINE_ROWS rows x COMBINE_SPLITS splits, each step's log-sum-exps and partial rows loaded
    together, three steps in flight (Triton pipelines the loop through shared memory: one program
    does what the combine kernel spreads over one program per row). The same mathematics as the
    combine kernel, written again on purpose: sharing one routine raised that kernel's registers
    from 48 to 64-123 (sm_90a), and it is the default path, timed on an H200 as it is."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_active - 1:
        tl.store(count_ptr, 0)  # ready for the next call (the caller's workspace may be kept)
        rows_here = tl.minimum(G * T - m_block * BLOCK_M, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        out_mask_d = offs_d < out_d
        if TAIL_VALUES:
            offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
            out_mask_dt = offs_dt < out_d
        for r0 in range(0, rows_here, COMBINE_ROWS):
            offs_r = r0 + tl.arange(0, COMBINE_ROWS)
            row_ok = offs_r < rows_here
            m = m_block * BLOCK_M + offs_r
            hq = (h * G + m // T).to(tl.int64)
            rows = (b * Hq + hq) * T + m % T  # rows of the [B, Hq, T] output
            if HAS_SINKS:  # one more term of the denominator, with no value
                m_i = tl.load(Sinks_ptr + hq, mask=row_ok, other=0.0) * LOG2E_
                l_i = tl.full((COMBINE_ROWS,), 1.0, dtype=tl.float32)
            else:
                m_i = tl.full((COMBINE_ROWS,), -float("inf"), dtype=tl.float32)
                l_i = tl.zeros((COMBINE_ROWS,), dtype=tl.float32)
            acc = tl.zeros((COMBINE_ROWS, BLOCK_D), dtype=tl.float32)
            if TAIL_VALUES:
                acc_t = tl.zeros((COMBINE_ROWS, BLOCK_DT), dtype=tl.float32)
            for s0 in tl.range(0, num_active, COMBINE_SPLITS, num_stages=3):
                offs_s = s0 + tl.arange(0, COMBINE_SPLITS)
                mask_rs = row_ok[:, None] & (offs_s < num_active)[None, :]
                part = rows[:, None] * NUM_SPLITS + offs_s[None, :]  # [rows, splits]
                lse = tl.load(LsePart_ptr + part, mask=mask_rs, other=-float("inf"), cache_modifier=".cg")
                o = _partial_rows(OPart_ptr + part * out_d, mask_rs, offs_d, out_mask_d)
                if TAIL_VALUES:
                    o_t = _partial_rows(OPart_ptr + part * out_d, mask_rs, offs_dt, out_mask_dt)
                m_new = tl.maximum(m_i, tl.max(lse, axis=1))
                m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing yet: every weight 0
                alpha = tl.math.exp2(m_i - m_use)
                w = tl.math.exp2(lse - m_use[:, None])
                l_i = l_i * alpha + tl.sum(w, axis=1)
                acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
                if TAIL_VALUES:
                    acc_t = acc_t * alpha[:, None] + tl.sum(w[:, :, None] * o_t, axis=1)
                m_i = m_new
            norm = tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_rows = Out_ptr + rows[:, None] * out_d
            tl.store(out_rows + offs_d[None, :], (acc / norm).to(Out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & out_mask_d[None, :])
            if TAIL_VALUES:
                tl.store(out_rows + offs_dt[None, :], (acc_t / norm).to(Out_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & out_mask_dt[None, :])


@triton.jit
def _partial_rows(part_ptrs, mask_rs, offs_d, mask_d):
    """The columns offs_d (mask_d: < the row width) of the partial rows part_ptrs [R, S] where
    mask_rs [R, S] (else 0) -> [R, S, len(offs_d)], past L1."""
    return tl.load(part_ptrs[:, :, None] + offs_d[None, None, :], mask=mask_rs[:, :, None] & mask_d[None, None, :],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _weighted_sum(row_ptrs, w, mask_s, offs_d, mask_d):
    """sum_s w[s] * the columns offs_d (mask_d: < D) of rows row_ptrs [S, 1] where mask_s [S]
    -> [len(offs_d)]."""
    o = tl.load(row_ptrs + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    return tl.sum(w[:, None] * o, axis=0)


@triton.jit
def _kv_cache_attention_combine_kernel(
        Pos_ptr, Sinks_ptr, OPart_ptr, LsePart_ptr, Out_ptr, window, T, S, D, Hq,
        HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr, RING: tl.constexpr, CHUNK: tl.constexpr,
        PDL: tl.constexpr = False):
    wait_for_inputs(PDL)  # the attention kernel's partial outputs; allow_dependents at the end
    row = tl.program_id(0).to(tl.int64)  # (b * Hq + hq) * T + t
    b = row // (Hq * T)
    _, row_first, row_len, split_len = _row_split(Pos_ptr, b, T, S, window, NUM_SPLITS, MIN_SPLIT_LEN, BLOCK_N,
                                                  BLOCK_T, RING, CHUNK)
    num_active = tl.cdiv(row_len - row_first, split_len)  # the splits the attention kernel wrote
    offs_all = tl.arange(0, BLOCK_SPLITS)
    lse_all = tl.load(LsePart_ptr + row * NUM_SPLITS + offs_all, mask=offs_all < num_active,
                      other=-float("inf"))
    lse_max = tl.max(lse_all, axis=0)
    if HAS_SINKS:  # one more term of the denominator, with no value
        sink = tl.load(Sinks_ptr + (row // T) % Hq) * LOG2E_
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == -float("inf"), 0.0, lse_max)  # padding query: all weights 0
    total = tl.sum(tl.math.exp2(lse_all - lse_max), axis=0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - lse_max)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if BLOCK_DT > 0:  # the head dim's second block (D > MAX_BLOCK_D)
        offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        mask_dt = offs_dt < D
        acc_t = tl.zeros((BLOCK_DT,), dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_active
        w = tl.math.exp2(tl.load(LsePart_ptr + row * NUM_SPLITS + offs_s, mask=mask_s,
                                 other=-float("inf")) - lse_max)
        part_rows = OPart_ptr + (row * NUM_SPLITS + offs_s[:, None]) * D
        acc += _weighted_sum(part_rows, w, mask_s, offs_d, mask_d)
        if BLOCK_DT > 0:
            acc_t += _weighted_sum(part_rows, w, mask_s, offs_dt, mask_dt)
    allow_dependents(PDL)
    norm = tl.where(total > 0, total, 1.0)
    out = acc / norm
    tl.store(Out_ptr + row * D + offs_d, out.to(Out_ptr.dtype.element_ty), mask=mask_d)
    if BLOCK_DT > 0:
        tl.store(Out_ptr + row * D + offs_dt, (acc_t / norm).to(Out_ptr.dtype.element_ty), mask=mask_dt)
