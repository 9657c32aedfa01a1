"""Triton kv_cache_attention: the new K/V scattered into a static cache at per-row positions, and
causal attention of the queries over cache slots 0..position (API.md section 1).

Two regimes, chosen on T (host-known, never on position values):

* decode / verification (T <= DECODE_MAX_T): flash-decoding. The grid is splits x kv heads x batch;
  one program owns one contiguous range of a row's slots and computes every query head of the group
  and every one of the T queries on it, so each K/V tile is loaded once per group. Ranges are cut
  on the device from the row's largest position, so a quarter-full cache still spreads its work
  over every split, and programs whose range starts past that position exit at once. The scatter is
  fused race-free: a program first stores the new K/V of the tokens whose positions fall in its own
  slot range (no other split reads those slots), waits at a block barrier, and only then streams its
  range from the cache, so its key / value tiles go from global memory to the tensor cores through
  the software pipeline's shared-memory buffers untouched. (Before, every tile also loaded the
  matching new rows and merged them in registers: twice the loads, a register round trip of each
  tile and twice the shared memory; see the H200 notes, stop 35.) With more than one split, a second small
  kernel combines the splits' partial results by log-sum-exp. ``Tuning.fused_combine`` instead has
  the last split program of each (row, kv head, query-row block) combine them: each program counts
  itself in a zeroed int32 workspace once its partials are stored (a block barrier, then one
  acquire-release atomic), and the one that completes the count reduces the block's partials from
  L2 and sets the count back to zero. One launch a layer instead of two, for a memset of the counts
  per call (or none, given a kept workspace: ``counts``) and a combine done by one program per group
  instead of one per query row. Off by default: not yet timed on a GPU (bench rows
  ``ours_triton_fused_combine*``).
* prefill (T > DECODE_MAX_T): every new K/V row is read by many query tiles and programs, so a small
  scatter kernel writes them into the cache first (same stream, so it completes before the next
  launch), then a tiled flash-attention kernel (tl.dot) reads only the cache: each query tile runs
  an online softmax over key tiles up to its own largest position.

A sliding ``window`` (> 0) limits query (b, t) to slots positions[b, t] - window + 1 .. positions[b, t]:
splits and key tiles then start at the earliest slot any query of the row / tile sees, so a long
cache costs a window's reads, not a position's. Chunked attention (``chunk_size`` C > 0, Llama 4)
does the same with the start of each query's chunk, p - p % C, as its first slot (the constexpr
CHUNK: chunk_size 0 compiles the kernels as without it, and a constant C makes p % C a multiply).
``softcap`` (> 0) caps the scaled scores at +-softcap by softcap * tanh(score / softcap), Gemma 2's
attention soft-capping. ``sinks`` [Hq] (GPT-OSS) gives each head's softmax one more logit that
attends to nothing: it seeds the online softmax (m = sink, l = 1) with one split, and is added
once by the combine with several. ``alibi_slopes`` [Hq] (ALiBi: BLOOM, MPT, Falcon-RW; the constexpr
HAS_ALIBI) adds slope * (key position - query position) to each capped score.

``ring=True`` (a constexpr) makes the caches ring buffers of a sliding-window or a chunked layer:
position p lives in slot p % S. Splits, key tiles and the scatter's ownership run on absolute positions,
from the window's or chunk's start; only cache addresses take the remainder. The caller's contract
(a row's positions span at most S - window, or S - chunk_size) makes a row's span at most S
positions, on distinct slots that the splits own disjointly. It is also cut to S positions when the
contract is broken (results unspecified, but every access stays in the caches and no loop runs long).

``value_dim`` Dv > 0 (the constexpr DV; 0 compiles the kernels as without it) keeps the values in
the keys, as multi-head latent attention's cache does (keys [latent (512), rope part (64)], values
the latent): a slot's value is its key's first Dv numbers, so only k is read and written, v and
v_cache are empty placeholders that no kernel addresses, and the output (and the splits' partial
outputs that the combine kernel reduces) is Dv wide. The key tiles serve as value tiles: the
probabilities multiply the key tile itself, the fused scatter's new keys included, and only the
accumulator's first Dv columns are stored. MLA's Dv = 512 is then exactly the 512-wide block of D = 576,
whose tail only adds to the scores (no tail accumulator); a Dv past 512 also accumulates the tail. A
smaller Dv keeps the key block's accumulator width, its extra columns computed and dropped: a
Triton tile cannot be sliced, and a narrower value tile would be a second read of the keys.

Positions outside [-1, S) (ring: [-1, 2^31 - 1)) are treated as padding (zero output, nothing
written): the wrapper raises for them in eager mode but cannot under torch.compile or CUDA-graph
capture. All sums are float32; no host synchronisation. Registered as
``gptfast_kernels::kv_cache_attention_triton`` (mutating k_cache and v_cache);
``ops.kv_cache_attention(..., backend="triton")`` calls it.

This file holds the launch constants, the launchers and the op; the kernels are in
kv_cache_attention_decode.py and kv_cache_attention_prefill.py, their shared building blocks in
kv_cache_attention_common.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from gptfast_kernels.ops._dispatch import check_contiguous, check_int, check_tensor
from gptfast_kernels.ops.kv_cache_attention import check_inputs, kv_cache_attention_fake, output_shape
from gptfast_kernels.triton import FP32_NUM_STAGES, dot_in_fp32, num_sms, on_device, programmatic_launch
from gptfast_kernels.triton.kv_cache_attention_common import LOG2_E
from gptfast_kernels.triton.kv_cache_attention_decode import (_kv_cache_attention_combine_kernel,
                                                              _kv_cache_attention_decode_kernel)
from gptfast_kernels.triton.kv_cache_attention_prefill import (_kv_cache_attention_prefill_kernel,
                                                               _kv_cache_attention_scatter_kernel)

# Largest T handled by the flash-decoding kernel. Speculative verification uses k + 1 <= 16; every
# (query head of the group, token) pair is one row of a single tile, and the [BLOCK_T, BLOCK_T]
# repeated-position test of the fused scatter stays small. Larger T is prefill.
DECODE_MAX_T = 16
# tl.dot needs at least 16 rows (and a reduction dim of at least 16) per tile: decode tiles with
# fewer query rows are padded with masked rows; memory-bound decode does not notice the idle MMA.
MIN_DOT_DIM = 16
# Positions a scatter program compares its tokens with per step, looking for a later writer of the
# same slot ([BLOCK_T, 128] int compares: noise next to the K/V copy).
SCATTER_BLOCK_LATER = 128


class Tuning(NamedTuple):
    """Launch constants of one target (GPU or Triton interpreter)."""
    decode_block_n: int       # slots per decode tile (halved for head dims above 128)
    decode_max_rows: int      # query rows (group heads x tokens) per decode program
    min_split_len: int        # fewest slots a split may own: below it, partials cost more than they save
    max_splits: int           # cap on splits per (row, kv head): bounds the combine's work
    programs_per_sm: int      # decode programs wanted per SM, so enough loads are in flight
    prefill_block_m: int      # queries per prefill tile
    prefill_block_n: int      # slots per prefill tile (halved for head dims above 128)
    scatter_block_t: int      # new tokens per scatter program
    combine_block_s: int      # splits reduced per step of the combine kernel
    num_warps: int
    fused_combine: bool = False  # the last split program of a group combines (no combine kernel): module doc


# Hopper defaults. The decode's 32-slot tiles come from a sweep on an H200 (bench_kv_tiles, CUDA-graph
# replays, Llama-3-8B heads at half fill, bench/results/nvidia-h200_2026-11-28_e9ab4ef_kv_tiles.json):
# against 64-slot tiles, B = 1 at 16k context 40 us against 51, B = 8 at 4k 94 against 103, B = 32
# at 4k 220 against 301, B = 1 at 4k 24.5 against 23.7, and verification (T = 5) 29.7 against 30.2;
# 4 / 1 programs per SM or 8 warps were no better overall. That sweep timed the decode kernel before
# its scatter moved ahead of the loop (stop 35): that kernel took 138 registers and 84 KiB of shared
# memory at these tiles (2 programs per SM), 128-slot tiles did not fit, and a tile's loop body was
# 525 instructions. Now (ptxas, sm_90a, bf16, T = 1 / 5): 80 / 127 registers, 37 / 42 KiB (5 programs
# per SM), 261 instructions; 64-slot tiles 70 KiB, 128-slot 136 KiB. The sweep is still to be
# rerun for it; the H200 timed these constants at a284fc8 (Llama-3-8B heads, half fill, a decode
# step's calls in a graph): B = 1 at 4k 13.5 us (29 % of copy bandwidth), at 16k 27.8 us (57 %), B = 8
# at 4k 42.2 us (75 %), B = 32 132.6 us (95 %), against 19 / 32 / 42 % at B = 1 / 8 / 32 before the
# rebuild. 2 x 132 SMs programs cover a B = 1, Hkv = 8 row with ~33 splits of at least 64 slots:
# with at least 256 (the value until stop 35, never swept) a 4k-context row got 16 splits, 128
# programs of 8 tiles each for 132 SMs, and every tile and program count of that sweep took the same
# 23.3-24.5 us; 64 gives it 32 programs per kv head of 4 tiles (the 13.5 us above; the partials are
# then 0.5 MiB of float32, written and read back through L2, beside 16.8 MB of K / V). The 64 x 64
# prefill tiles, the usual flash-attention starting point, are not tuned yet.
_GPU = Tuning(decode_block_n=32, decode_max_rows=64, min_split_len=64, max_splits=64,
               programs_per_sm=2, prefill_block_m=64, prefill_block_n=64, scatter_block_t=16,
               combine_block_s=16, num_warps=4)
# The interpreter runs every program in numpy: small tiles keep the tests quick and make their
# small shapes span several tiles and splits, so tile, split and combine boundaries are exercised.
_INTERPRETER = Tuning(decode_block_n=16, decode_max_rows=16, min_split_len=16, max_splits=8,
                       programs_per_sm=2, prefill_block_m=16, prefill_block_n=16, scatter_block_t=16,
                       combine_block_s=4, num_warps=4)
# Largest head dim _GPU's tiles serve; larger heads (Gemma 4's global layers: D = 512) get
# _GPU_LARGE_HEAD. With _GPU's tiles at BLOCK_D = 512, sm_90 compiles spill: the decode kernel
# (16 rows x 32 slots, 4 warps) 1.3 KiB per thread, and its three pipeline stages of 32 x 512 K / V
# tiles want 336 KiB of shared memory, past the 227 KiB an H100 block may use; the bf16 prefill
# kernel (64 x 32) spills 3.5 KiB.
LARGE_HEAD_DIM = 256
# H100, reasoned and checked by ptxas -v (sm_90a), not timed: 16-slot K / V tiles (decode_block_n and
# prefill_block_n are halved above D = 128), at most 16 query rows per decode program and 32 per
# prefill tile, and 8 warps, so the [rows, 512] float32 accumulator takes 32 (decode) / 64 (prefill)
# registers per thread. No spills in bf16 / fp16 decode and prefill or fp32 decode (fp32 prefill:
# 60 bytes); shared memory 81 KiB for 16-bit decode (80 / 126 registers at T = 1 / 5), 97 KiB for
# 16-bit prefill (fp32: 96 / 128 KiB).
_GPU_LARGE_HEAD = _GPU._replace(decode_block_n=32, decode_max_rows=16, prefill_block_m=32, prefill_block_n=32,
                                num_warps=8)
# Widest head-dim block (a power of two, as every Triton tile). Wider heads, multi-head latent
# attention's r + dr = 512 + 64 = 576 (DeepSeek-V2 / V3, Kimi-K2, GLM-4.7-Flash), are tiled as this
# block plus a power-of-two tail of at least MIN_TAIL_BLOCK_D (BLOCK_DT: 64 for D = 513..576): two
# dots summed into one score tile and two output accumulators, where BLOCK_D = next_power_of_2(576)
# = 1024 would leave 44% of every q / K / V tile and accumulator idle, doubling their registers and
# shared memory. Heads up to this width keep one block (BLOCK_DT = 0). The kernels' statements for
# the first block are those from before the tail existed, with the tail's in `if BLOCK_DT > 0:`
# blocks beside them: D <= 512 compiles to the same SASS as before (cuobjdump, sm_90a). Even
# moving a statement into an inlined helper changes ptxas's schedule (its debug-line labels).
MAX_BLOCK_D = 512
# Narrower tails compile badly on sm_90 (bf16, ptxas -v): with a 16-wide tail (D = 528) ptxas falls
# to 32 registers and 2.5 to 3.5 KiB of spills in decode and prefill, a 32-wide one (D = 544) spills
# 400 bytes in prefill; with the 64-wide tail both compile as D = 576 does. Columns past D are
# masked, so it costs no memory traffic: every D in 513..576 runs the tiles of D = 576. (A D that is
# not a multiple of 16, such as 520, gets no 16-element alignment hint, hence scalar, unpipelined
# loads and some spills, as D = 500 already does in the single-block tiles.)
MIN_TAIL_BLOCK_D = 64
# Past MAX_BLOCK_D, _GPU_LARGE_HEAD's tiles serve the 64-wide tail too (sm_90a, ptxas -v, bf16, not
# timed): decode 102 / 168 registers (T = 1 / 5) and 91 KiB of shared memory in Triton's three
# pipeline stages, prefill 186 registers and 109 KiB, no spills; with values in the keys (MLA:
# value_dim 512) the same tiles read K only: decode 95 / 128 registers and 55 KiB, prefill 168 and
# 73 KiB. (Until stop 35 the decode kernel, staging each tile's new rows beside it, needed two
# stages here to stay within 255 registers.)


def _pdl_options(device: torch.device) -> dict:
    """The decode kernels' launch options for a programmatic dependent launch (GPTFAST_CUDA_PDL=1 on
    sm_90+: programmatic_launch), else none."""
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(device) else {}


def _launch_options(dtype: torch.dtype, tune: Tuning) -> dict:
    options = {"num_warps": tune.num_warps}
    if dtype == torch.float32:
        options["num_stages"] = FP32_NUM_STAGES
    return options


def _gpu_tuning(head_dim: int) -> Tuning:
    return _GPU if head_dim <= LARGE_HEAD_DIM else _GPU_LARGE_HEAD


def _tuning(device: torch.device, head_dim: int) -> tuple[Tuning, int]:
    tune = _gpu_tuning(head_dim) if device.type == "cuda" else _INTERPRETER
    return tune, num_sms(device)


def _head_blocks(D: int, min_block: int = 1) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DT) of head dim D: one power-of-two block of at least min_block up to
    MAX_BLOCK_D (BLOCK_DT = 0), else MAX_BLOCK_D and a power-of-two tail covering the rest, at least
    MIN_TAIL_BLOCK_D wide."""
    if D <= MAX_BLOCK_D:
        return max(triton.next_power_of_2(D), min_block), 0
    return MAX_BLOCK_D, max(triton.next_power_of_2(D - MAX_BLOCK_D), MIN_TAIL_BLOCK_D)


def _num_splits(tune: Tuning, num_sms: int, programs: int, S: int) -> int:
    """Splits per (row, kv head, query-row block) from host-known sizes only: enough programs to
    fill the device, at least min_split_len slots each, at most max_splits."""
    wanted = triton.cdiv(tune.programs_per_sm * num_sms, programs)
    return max(1, min(wanted, triton.cdiv(S, tune.min_split_len), tune.max_splits))


# Float32 numbers per thread one step of the fused combine loads (query rows x splits x columns).
# Its registers add to the split kernel's (sm_90a, ptxas, bf16, Llama-3-8B heads, T = 1 / 5): 152 /
# 160 against 80 / 127 without it, Triton pipelining its steps three deep through shared memory
# (cp.async; without: 126 / 128, a round trip to L2 per step); 32 numbers unpipelined took 150 /
# 191. At 152, 3 programs fit an SM, where the decode wants 2 (programs_per_sm). At T = 1 a step is
# 4 rows x 4 splits x 128 columns: 9 steps for 33 splits; at T = 5 (20 rows) 45, where the combine
# kernel spreads them over 160 programs: there the fused combine likely loses.
COMBINE_NUMBERS_PER_THREAD = 16


def _fused_combine_blocks(rows: int, width: int, num_splits: int, num_warps: int) -> tuple[int, int]:
    """(query rows, splits) per step of the fused combine of ``rows`` query rows (a program's block)
    over ``num_splits`` splits whose partial rows are ``width`` columns wide (head-dim blocks): powers
    of two whose product times the width stays within COMBINE_NUMBERS_PER_THREAD per thread, with
    the fewest steps (ties: more splits a step)."""
    budget = COMBINE_NUMBERS_PER_THREAD * 32 * num_warps
    best = None
    combine_rows = 1
    while combine_rows <= triton.next_power_of_2(rows) and (combine_rows == 1 or combine_rows * width <= budget):
        splits = 1
        while splits * 2 <= triton.next_power_of_2(num_splits) and combine_rows * splits * 2 * width <= budget:
            splits *= 2
        steps = triton.cdiv(rows, combine_rows) * triton.cdiv(num_splits, splits)
        if best is None or steps < best[0]:
            best = (steps, combine_rows, splits)
        combine_rows *= 2
    return best[1], best[2]


def _v_strides(v: torch.Tensor, value_dim: int) -> tuple[int, int, int]:
    """v's batch, head and token strides; with values in the keys, v is an empty placeholder that
    no kernel addresses (any strides do)."""
    return (0, 0, 0) if value_dim else (v.stride(0), v.stride(1), v.stride(2))


def _decode(q, k, v, k_cache, v_cache, positions, sinks, alibi_slopes, out, scoring, ring, fp32_dot, tune, value_dim,
            num_sms, counts=None):
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    Dv = out.shape[-1]
    G = Hq // Hkv
    block_d, block_dt = _head_blocks(D, MIN_DOT_DIM)
    block_n = tune.decode_block_n if block_d <= 128 else tune.decode_block_n // 2
    block_m = min(max(triton.next_power_of_2(G * T), MIN_DOT_DIM), tune.decode_max_rows)
    num_m_blocks = triton.cdiv(G * T, block_m)
    num_splits = _num_splits(tune, num_sms, B * Hkv * num_m_blocks, S)
    block_t = triton.next_power_of_2(T)
    if num_splits > 1:  # per-split normalised outputs and log2-sum-exps, float32
        o_part = torch.empty((B, Hq, T, num_splits, Dv), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, T, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # never touched with a single split
    pdl = _pdl_options(q.device)
    fused = {}
    if num_splits > 1 and tune.fused_combine:  # one count per (row, kv head, query-row block), from zero
        groups = B * Hkv * num_m_blocks
        if counts is None:
            counts = torch.zeros(groups, dtype=torch.int32, device=q.device)
        elif (counts.dtype != torch.int32 or counts.device != q.device or counts.numel() < groups
              or not counts.is_contiguous()):
            raise ValueError(f"kv_cache_attention: counts must be contiguous int32 on {q.device} with at least "
                             f"{groups} entries, got {counts.dtype} on {counts.device} with {counts.numel()}, "
                             f"strides {counts.stride()}")
        tail_values = block_dt > 0 and (value_dim == 0 or value_dim > block_d)
        combine_rows, combine_splits = _fused_combine_blocks(min(block_m, G * T), block_d + tail_values * block_dt,
                                                             num_splits, tune.num_warps)
        fused = {"FUSED_COMBINE": True, "COMBINE_ROWS": combine_rows, "COMBINE_SPLITS": combine_splits}
    _kv_cache_attention_decode_kernel[(num_splits, Hkv * num_m_blocks, B)](
        q, k, v, k_cache, v_cache, positions, q if sinks is None else sinks,
        q if alibi_slopes is None else alibi_slopes, out, o_part, lse_part, positions if counts is None else counts,
        *scoring.args, T, S, D, G, Hq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        *_v_strides(v, value_dim), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_SPLITS=num_splits, MIN_SPLIT_LEN=tune.min_split_len, NUM_M_BLOCKS=num_m_blocks,
        FP32_DOT=fp32_dot, SOFTCAP=scoring.softcap, HAS_SINKS=sinks is not None, RING=ring, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DT=block_dt, DV=value_dim, CHUNK=scoring.chunk,
        HAS_ALIBI=alibi_slopes is not None, **_launch_options(q.dtype, tune), **pdl, **fused)
    if num_splits > 1 and not fused:  # combines rows of the output's width, Dv
        combine_block_d, combine_block_dt = _head_blocks(Dv)
        _kv_cache_attention_combine_kernel[(B * Hq * T,)](
            positions, q if sinks is None else sinks, o_part, lse_part, out, scoring.window, T, S, Dv, Hq,
            HAS_SINKS=sinks is not None, NUM_SPLITS=num_splits,
            MIN_SPLIT_LEN=tune.min_split_len, BLOCK_N=block_n, BLOCK_T=block_t,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_S=min(tune.combine_block_s, triton.next_power_of_2(num_splits)),
            BLOCK_D=combine_block_d, BLOCK_DT=combine_block_dt, RING=ring, CHUNK=scoring.chunk,
            num_warps=tune.num_warps, **pdl)


def _prefill(q, k, v, k_cache, v_cache, positions, sinks, alibi_slopes, out, scoring, ring, fp32_dot, tune,
             value_dim):
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    block_d, block_dt = _head_blocks(D, MIN_DOT_DIM)
    scatter_block_d, scatter_block_dt = _head_blocks(D)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    _kv_cache_attention_scatter_kernel[(triton.cdiv(T, tune.scatter_block_t), Hkv, B)](
        k, v, k_cache, v_cache, positions, T, S, D, k.stride(0), k.stride(1), k.stride(2),
        *_v_strides(v, value_dim), *cache_strides, BLOCK_T=tune.scatter_block_t,
        BLOCK_D=scatter_block_d, BLOCK_DT=scatter_block_dt, BLOCK_LATER=SCATTER_BLOCK_LATER, RING=ring,
        DV=value_dim, num_warps=tune.num_warps)
    block_n = tune.prefill_block_n if block_d <= 128 else tune.prefill_block_n // 2
    _kv_cache_attention_prefill_kernel[(triton.cdiv(T, tune.prefill_block_m), Hq, B)](
        q, k_cache, v_cache, positions, q if sinks is None else sinks, q if alibi_slopes is None else alibi_slopes,
        out, *scoring.args, T, S, D, Hq // Hkv, Hq,
        q.stride(0), q.stride(1), q.stride(2), *cache_strides, FP32_DOT=fp32_dot, SOFTCAP=scoring.softcap,
        HAS_SINKS=sinks is not None, RING=ring,
        BLOCK_M=tune.prefill_block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DT=block_dt, DV=value_dim,
        CHUNK=scoring.chunk, HAS_ALIBI=alibi_slopes is not None, **_launch_options(q.dtype, tune))


class _Scoring(NamedTuple):
    """Score arguments of the attention kernels: (qk_scale, cap_log2, inv_cap_log2, window) in
    ``args``, whether soft-capping is on (a constexpr: no tanh in kernels that do not cap) and the
    chunk size of chunked attention (the constexpr CHUNK, 0: none)."""
    args: tuple[float, float, float, int]
    window: int
    softcap: bool
    chunk: int

    @classmethod
    def of(cls, scale: float, window: int, softcap: float, chunk: int = 0) -> "_Scoring":
        capped = softcap > 0
        args = (scale * LOG2_E, softcap * LOG2_E, 1.0 / (softcap * LOG2_E) if capped else 0.0, window)
        return cls(args, window, capped, chunk)


def kv_cache_attention_tuned(q, k, v, k_cache, v_cache, positions, scale: float, tune: Tuning,
                             num_sms: int, window: int = 0, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None, ring: bool = False,
                             value_dim: int = 0, chunk_size: int = 0,
                             alibi_slopes: torch.Tensor | None = None,
                             counts: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op's computation with the launch constants ``tune`` and an assumed SM count (for
    tuning: bench/bench_kv_tiles.py); inputs as ``kv_cache_attention_triton``'s. ``counts``: with
    ``tune.fused_combine``, a zeroed int32 workspace of at least batch x kv heads x query-row blocks
    counts that the decode kernel leaves zeroed (so it can be kept across calls of one stream); None:
    a zeroed one per call."""
    out = torch.empty(output_shape(q, value_dim), dtype=q.dtype, device=q.device)
    scoring = _Scoring.of(float(scale), int(window), float(softcap), int(chunk_size))
    args = (q, k, v, k_cache, v_cache, positions, sinks, alibi_slopes, out, scoring, bool(ring), dot_in_fp32(q.dtype),
            tune, int(value_dim))
    with on_device(q):
        if q.shape[2] <= DECODE_MAX_T:
            _decode(*args, num_sms, counts)
        else:
            _prefill(*args)
    return out


def kv_cache_attention_unchecked(q, k, v, k_cache, v_cache, positions, scale: float, window: int = 0,
                                 softcap: float = 0.0, sinks: torch.Tensor | None = None, ring: bool = False,
                                 value_dim: int = 0, chunk_size: int = 0,
                                 alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_cache_attention_triton`` on inputs already checked (the public op's eager path)."""
    if q.numel() == 0:
        return torch.empty(output_shape(q, value_dim), dtype=q.dtype, device=q.device)
    return kv_cache_attention_tuned(q, k, v, k_cache, v_cache, positions, scale, *_tuning(q.device, q.shape[-1]),
                                    window, softcap, sinks, ring, value_dim, chunk_size, alibi_slopes)


@torch.library.custom_op("gptfast_kernels::kv_cache_attention_triton", mutates_args=("k_cache", "v_cache"))
def kv_cache_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0,
                              softcap: float = 0.0, sinks: torch.Tensor | None = None,
                              ring: bool = False, value_dim: int = 0, chunk_size: int = 0,
                              alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], k, v [B, Hkv, T, D] (any strides, stride(-1) == 1); k_cache, v_cache
    [B, Hkv, S, D] contiguous, written in place; positions [B, T] int64 contiguous, -1 = padding
    -> out [B, Hq, T, D] contiguous in q's dtype. window 0 / softcap 0: none;
    sinks [Hq] float32 contiguous or None. ring: ring buffers, position p in slot p % S (a window or a
    chunk_size in 1..S). value_dim Dv in 1..D: values in the keys (the value of a slot is its key's
    first Dv numbers; v and v_cache are never touched; out [B, Hq, T, Dv]); 0: values in v / v_cache.
    chunk_size C > 0: chunked attention, a query at p sees slots p - p % C .. p (a constexpr: one
    compilation per chunk size; never with a window); 0: none. alibi_slopes [Hq] float32 contiguous
    or None: ALiBi, scores gain alibi_slopes[h] * (position - query position). Checks shapes, dtypes,
    devices and layouts (ValueError naming the argument); position values outside the cache are
    padding in the kernels (the public op checks them, and a ring's span, with one host sync)."""
    op = "kv_cache_attention_triton"
    for name, value, minimum in (("window", window, 0), ("value_dim", value_dim, 0), ("chunk_size", chunk_size, 0)):
        check_int(op, name, value, minimum)
    values_in_keys = value_dim > 0
    check_inputs(q, k, None if values_in_keys else v, k_cache, None if values_in_keys else v_cache, positions,
                 scale, window or None, softcap or None, sinks, ring, value_dim or None, chunk_size or None,
                 alibi_slopes, op)
    check_tensor(op, "positions", positions, dtypes=(torch.int64,), ndim=2)
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is not None:
            check_tensor(op, name, t, dtypes=(torch.float32,))
    check_contiguous(op, positions=positions, sinks=sinks, alibi_slopes=alibi_slopes)
    for name, t in (("q", q), ("k", k), ("v", None if values_in_keys else v)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have stride 1 in its last (head) dimension, got strides {t.stride()}")
    return kv_cache_attention_unchecked(q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, ring,
                                        value_dim, chunk_size, alibi_slopes)


kv_cache_attention_triton.register_fake(kv_cache_attention_fake)
