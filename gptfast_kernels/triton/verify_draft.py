"""Triton verify_draft, the vocabulary streamed in BLOCK_V tiles.

Sampling (one program per batch row) gathers only the k draft tokens' probabilities to find the
first rejection n, then makes one pass over the row at n for the total and a tiled inverse-CDF
scan (tl.cumsum per tile plus a running carry) that stops at the tile holding the sampled index.
Greedy takes two launches, as the CUDA kernels do: the argmax of every position of every row at
once, each row split into chunks across programs so that even one batch row fills the GPU (one
program walking a row position by position reads at one SM's rate); then one program per batch
row merges its chunks' (value, index) pairs position by position and stops at the first mismatch.
All sums are float32; no host synchronisation.
Registered as the custom op ``gptfast_kernels::verify_draft_triton`` (opaque to torch.compile);
``gptfast_kernels.ops.verify_draft(..., backend="triton")`` calls it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptfast_kernels.ops._dispatch import check_contiguous, check_tensor
from gptfast_kernels.ops.verify_draft import check_inputs, verify_draft_fake
from gptfast_kernels.triton import num_sms, on_device

# Vocabulary entries per tile: 4 KiB of float32 per load, a few wide loads per thread with
# NUM_WARPS warps, and few tiles (loop iterations) for V = 128k. Not yet tuned on a GPU.
BLOCK_V = 1024
NUM_WARPS = 4
# "no index yet" in the greedy argmax (above any vocabulary index: V fits in int32).
NO_INDEX = tl.constexpr(2**31 - 1)
# Greedy chunk-argmax programs wanted per SM, and the shortest chunk in tiles (shorter ones would
# spend more on the program's reduction than on loads). Not yet tuned on a GPU.
GREEDY_PROGRAMS_PER_SM = 2
GREEDY_MIN_CHUNK_TILES = 4


@triton.jit
def _argmax_of_lanes(best, best_idx):
    """(value, index) winning torch.argmax's order over lanes of (value, index) pairs: NaN above
    every number, the first index on ties; lanes with index NO_INDEX hold nothing."""
    lane_nan = best != best
    nan_idx = tl.min(tl.where(lane_nan, best_idx, NO_INDEX), axis=0)
    clean = tl.where(lane_nan, -float("inf"), best)
    top = tl.max(clean, axis=0)
    max_idx = tl.min(tl.where((clean == top) & (best_idx != NO_INDEX), best_idx, NO_INDEX), axis=0)
    has_nan = nan_idx != NO_INDEX
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_idx, max_idx)


@triton.jit
def _greedy_chunk_kernel(T_ptr, Max_ptr, Idx_ptr, V, chunk, splits, BLOCK_V: tl.constexpr):
    """Program p = row * splits + s: the (maximum, first index) of chunk s of row `row` of
    target [B * (k + 1), V] ([s * chunk, (s + 1) * chunk) cut at V; chunk a multiple of BLOCK_V)."""
    p = tl.program_id(0).to(tl.int64)
    row = T_ptr + (p // splits) * V
    begin = (p % splits) * chunk
    end = tl.minimum(begin + chunk, V)
    offs_v = tl.arange(0, BLOCK_V)
    # Per-lane running (value, index) over the tiles, reduced once: the argmax as torch.argmax,
    # NaN above every number (unchecked under capture) and first on ties.
    best = tl.full((BLOCK_V,), -float("inf"), dtype=tl.float32)
    best_idx = tl.full((BLOCK_V,), NO_INDEX, dtype=tl.int32)
    for start in range(0, chunk, BLOCK_V):
        offs = begin + start + offs_v
        inside = offs < end
        x = tl.load(row + offs, mask=inside, other=-float("inf"))
        best_nan = best != best
        take = ((x != x) & ~best_nan) | (~best_nan & (x > best))  # strict: earlier keeps ties
        take = take | ((best_idx == NO_INDEX) & inside)
        best = tl.where(take, x, best)
        best_idx = tl.where(take, offs.to(tl.int32), best_idx)
    value, idx = _argmax_of_lanes(best, best_idx)
    tl.store(Max_ptr + p, value)
    tl.store(Idx_ptr + p, idx)


# k is never specialised (see _sampling_kernel).
@triton.jit(do_not_specialize=["k"])
def _greedy_accept_kernel(Max_ptr, Idx_ptr, Tok_ptr, Out_ptr, N_ptr, k, splits, BLOCK_K: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    """Program b: merges the chunks of positions 0, 1, ... of batch row b and stops at the first
    draft that differs from the argmax (or after position k)."""
    b = tl.program_id(0).to(tl.int64)
    K1 = k + 1
    offs_k = tl.arange(0, BLOCK_K)
    toks = tl.load(Tok_ptr + b * k + offs_k, mask=offs_k < k, other=-1)
    offs_s = tl.arange(0, BLOCK_S)
    n = k
    final = tl.zeros((), dtype=tl.int32)
    going = k >= 0
    for i in range(0, K1):
        first = (b * K1 + i) * splits
        read = (offs_s < splits) & going  # nothing after the stop
        values = tl.load(Max_ptr + first + offs_s, mask=read, other=-float("inf"))
        indices = tl.load(Idx_ptr + first + offs_s, mask=read, other=NO_INDEX)
        _, idx = _argmax_of_lanes(values, indices)
        draft_i = tl.sum(tl.where(offs_k == i, toks, 0), axis=0)  # an id outside [0, V) never matches
        mismatch = (i == k) | (draft_i != idx)
        stop = going & mismatch
        n = tl.where(stop, i, n)
        final = tl.where(stop, idx, final)
        going = going & (~mismatch)
    out = tl.where(offs_k < n, toks, tl.where(offs_k == n, final.to(tl.int64), -1))
    tl.store(Out_ptr + b * K1 + offs_k, out, mask=offs_k < K1)
    tl.store(N_ptr + b, (n + 1).to(tl.int64))


# k is never specialised: Triton would turn a value of 1 into a constexpr, which breaks the
# loop-carried variables initialised from it (n = k, going = k >= 0). V is: its divisibility by 16
# lets every vocabulary tile load be vectorised (V64 below works for a constexpr V = 1 too).
@triton.jit(do_not_specialize=["k"])
def _sampling_kernel(T_ptr, D_ptr, Tok_ptr, U_ptr, Out_ptr, N_ptr, k, V, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    K1 = k + 1
    V64 = tl.full((), 1, tl.int64) * V
    t_rows = T_ptr + b * K1 * V64  # int64: B * (k + 1) * V passes 2^31 at B = 64, V = 256k
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < k
    toks = tl.load(Tok_ptr + b * k + offs_k, mask=mask_k, other=-1)
    # Ids outside [0, V) are never used as an index: they are rejected.
    valid = mask_k & (toks >= 0) & (toks < V)
    offs_v = tl.arange(0, BLOCK_V)
    p = tl.load(t_rows + offs_k * V64 + toks, mask=valid, other=0.0)
    q = tl.load(D_ptr + (b * k + offs_k) * V64 + toks, mask=valid, other=0.0)
    u = tl.load(U_ptr + b * K1 + offs_k, mask=mask_k, other=0.0)
    accept = valid & (q > 0) & (u * q < p)
    n = tl.min(tl.where(mask_k & (~accept), offs_k, k), axis=0)
    t_row = t_rows + n * V64
    d_row = D_ptr + (b * k + n) * V64  # read only when n < k
    has_draft = n < k
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, tl.where(has_draft, V, 0), BLOCK_V):
        offs = start + offs_v
        t = tl.load(t_row + offs, mask=offs < V, other=0.0)
        d = tl.load(d_row + offs, mask=offs < V, other=0.0)
        acc += tl.maximum(t - d, 0.0)
    residual_total = tl.sum(acc, axis=0)
    use_residual = has_draft & (residual_total > 0)  # else sample from the target row
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, tl.where(use_residual, 0, V), BLOCK_V):
        offs = start + offs_v
        acc += tl.load(t_row + offs, mask=offs < V, other=0.0)
    total = tl.where(use_residual, residual_total, tl.sum(acc, axis=0))
    threshold = tl.load(U_ptr + b * K1 + k) * total
    # Inverse CDF: the smallest j (with non-zero weight) whose running sum exceeds u * total.
    carry = tl.zeros((), dtype=tl.float32)
    found = tl.full((), -1, dtype=tl.int32)
    start = tl.zeros((), dtype=tl.int32)
    while (found < 0) & (start < V):
        offs = start + offs_v
        in_row = offs < V
        t = tl.load(t_row + offs, mask=in_row, other=0.0)
        d = tl.load(d_row + offs, mask=in_row & use_residual, other=0.0)
        w = tl.where(use_residual, tl.maximum(t - d, 0.0), t)
        running = carry + tl.cumsum(w, axis=0)
        hit = tl.min(tl.where(in_row & (w > 0) & (running > threshold), offs, V), axis=0)
        found = tl.where(hit < V, hit, -1)
        carry += tl.sum(w, axis=0)
        start += BLOCK_V
    last = tl.full((), -1, dtype=tl.int32)  # rounding fallback: the last non-zero weight
    for start2 in range(0, tl.where(found < 0, V, 0), BLOCK_V):
        offs = start2 + offs_v
        in_row = offs < V
        t = tl.load(t_row + offs, mask=in_row, other=0.0)
        d = tl.load(d_row + offs, mask=in_row & use_residual, other=0.0)
        w = tl.where(use_residual, tl.maximum(t - d, 0.0), t)
        last = tl.maximum(last, tl.max(tl.where(in_row & (w > 0), offs, -1), axis=0))
    final = tl.where(found >= 0, found, tl.where(last >= 0, last, V - 1))
    out = tl.where(offs_k < n, toks, tl.where(offs_k == n, final.to(tl.int64), -1))
    tl.store(Out_ptr + b * K1 + offs_k, out, mask=offs_k < K1)
    tl.store(N_ptr + b, (n + 1).to(tl.int64))


def _greedy_chunks(rows: int, V: int, sms: int) -> tuple[int, int]:
    """(chunk, splits): each of ``rows`` rows cut into ``splits`` chunks of ``chunk`` entries (a
    multiple of BLOCK_V, the last one cut at V), enough for GREEDY_PROGRAMS_PER_SM programs on every
    SM but none shorter than GREEDY_MIN_CHUNK_TILES tiles."""
    tiles = triton.cdiv(V, BLOCK_V)
    splits = max(1, min(triton.cdiv(GREEDY_PROGRAMS_PER_SM * sms, rows), tiles // GREEDY_MIN_CHUNK_TILES))
    chunk = triton.cdiv(tiles, splits) * BLOCK_V
    return chunk, triton.cdiv(V, chunk)


def verify_draft_unchecked(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                           draft_tokens: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_draft_triton`` on inputs already checked (the public op's eager path)."""
    B, k_plus_1, V = target_probs.shape
    tokens = torch.empty((B, k_plus_1), dtype=torch.int64, device=target_probs.device)
    num_emitted = torch.empty((B,), dtype=torch.int64, device=target_probs.device)
    if B == 0:
        return tokens, num_emitted
    k = k_plus_1 - 1
    block_k = triton.next_power_of_2(k_plus_1)
    with on_device(target_probs):
        if draft_probs is not None:
            _sampling_kernel[(B,)](target_probs, draft_probs, draft_tokens, uniforms, tokens, num_emitted, k, V,
                                   BLOCK_K=block_k, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
            return tokens, num_emitted
        rows = B * k_plus_1
        chunk, splits = _greedy_chunks(rows, V, num_sms(target_probs.device))
        chunk_max = torch.empty(rows * splits, dtype=torch.float32, device=target_probs.device)
        chunk_idx = torch.empty(rows * splits, dtype=torch.int32, device=target_probs.device)
        _greedy_chunk_kernel[(rows * splits,)](target_probs, chunk_max, chunk_idx, V, chunk, splits,
                                               BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
        _greedy_accept_kernel[(B,)](chunk_max, chunk_idx, draft_tokens, tokens, num_emitted, k, splits,
                                    BLOCK_K=block_k, BLOCK_S=triton.next_power_of_2(splits))
    return tokens, num_emitted


@torch.library.custom_op("gptfast_kernels::verify_draft_triton", mutates_args=())
def verify_draft_triton(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        draft_tokens: torch.Tensor,
                        uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, k+1, V], draft_probs [B, k, V] or None (greedy), draft_tokens [B, k] int64,
    uniforms [B, k+1] float32, all contiguous -> (tokens [B, k+1] int64, num_emitted [B] int64).
    Checks them (ValueError naming the argument; token ids outside [0, V) are rejected drafts)."""
    op = "verify_draft_triton"
    check_tensor(op, "uniforms", uniforms)
    check_inputs(target_probs, draft_probs, draft_tokens, uniforms, op)
    check_contiguous(op, target_probs=target_probs, draft_probs=draft_probs, draft_tokens=draft_tokens,
                     uniforms=uniforms)
    return verify_draft_unchecked(target_probs, draft_probs, draft_tokens, uniforms)


verify_draft_triton.register_fake(verify_draft_fake)
