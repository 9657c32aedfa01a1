// kv_cache_attention CUDA kernels: static-KV-cache attention with the position scatter fused in.
//
//   for (b, t) with 0 <= positions[b, t] < S:  k_cache[b, :, positions[b, t]] = k[b, :, t]  (same for v)
//   out[b, h, t] = softmax(cap(scale * q[b, h, t] . k_cache[b, h / G, first..positions[b, t]])) @ v_cache[...]
//   out[b, h, t] = 0 where the position is outside [0, S) (padding, or a bad value under capture)
// first = 0, the start of a sliding window, or of the query's chunk (chunked attention, Llama 4); cap =
// soft-capping when asked for (see Scoring);
// with sinks [Hq] (GPT-OSS) each head's softmax has one more logit that attends to nothing; with
// alibi_slopes [Hq] (ALiBi: BLOOM, MPT, Falcon-RW) head h's score of position s gains
// alibi_slopes[h] * (s - the query's position) (Scoring::biased; rebasing a ring's span keeps it).
// Ring mode (ring = true, the ring buffer of a sliding-window layer, window <= S, or of a chunked
// layer, chunk <= S): position p lives in slot p % S for the scatter and every read; positions
// 0 .. 2^31 - 2 are valid. A block works in position space on the positions it reads, rebased to its
// span (rebase_span): at most S of them,
// so they map to distinct slots and no position arithmetic overflows; tiles of consecutive
// positions may wrap around the end of the ring, so each row's slot is computed on its own.
// Values in the keys (value_dim = Dv > 0, multi-head latent attention): a slot's value is the first
// Dv numbers of its key row, out is [B, Hq, T, Dv], and v / v_cache are empty. The entry point
// points the kernels' V sources at k / k_cache (same row strides), so every V read below, the
// decode blocks' reads of this launch's new tokens included, reads keys. The kernels' VIK = true
// instantiations size V tiles, accumulators and output rows by Dv and write k alone; VIK = false
// is the code of the ordinary op, unchanged (Dv = D there is known at compile time).
//
// Decode / verification (T <= DECODE_MAX_T): flash-decoding in ONE launch. Blocks = splits x kv
// heads x batch (flattened into blockIdx.x). A block owns one (b, kv head) and one range of cache
// slots, and computes every query of the head group (G heads x T tokens) against it, so each K/V
// row is read once per group. The split count comes from host-known sizes only; the slot ranges
// are cut on the device from the row's largest position (at least MIN_SPLIT_SLOTS each), so the
// blocks past it exit after reading T positions and nothing beyond it is ever read.
// Scatter: the block whose range holds slot positions[b, t] writes k/v[b, :, t] there, and every
// read of that slot inside the block comes from k/v instead of the cache: no block reads a slot
// another block writes, so there is no race and no second pass. Splits are merged by log-sum-exp
// by the last block of the (b, kv head) to finish (an atomic ticket, zeroed for each launch).
// Prefill (T > DECODE_MAX_T): every query tile reads the new K/V, so no single block can own them:
// a small scatter kernel (T x Hkv x D elements, negligible next to O(T^2) attention) runs first on
// the same stream, then a tiled kernel over query tiles x heads x batch reads the cache, with an
// online softmax over key tiles up to the tile's largest position: WMMA tensor cores (fp32
// accumulators) for fp16 / bf16, the SIMT engine of the decode kernel for fp32.
//
// This header holds what the three files share: constants, the launch parameters, the SIMT
// attention engine and the host-side helpers. kv_cache_attention_decode.cu has the decode kernel,
// kv_cache_attention_prefill.cu the scatter and prefill kernels, kv_cache_attention.cu the entry
// point and its registration.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.h"
#include "cuda_common.cuh"

namespace gptfast_kernels {
namespace kv_attention {
// Launch and tuning constants: sized by reasoning for H100 (132 SMs, 228 KiB shared memory per SM)
// and A100; not yet measured (they were written without a GPU): tune them with bench/.
// Largest T served by the split-KV decode kernel: T = 1 (decode) and k + 1 (verification, k <= 15).
// Its blocks hold the T positions of their row in shared memory and scan them per key tile.
constexpr int64_t DECODE_MAX_T = 16;
// SIMT engine (decode, fp32 prefill): 8 warps keep 16 KiB K + V tiles in flight per block.
constexpr int THREADS = 256;
constexpr int WARPS = THREADS / WARP;
// Two resident blocks per SM for the SIMT kernels: lets ptxas use up to 128 registers (its default
// for 256 threads caps at 64 and spills the fp32 variants) while a second block overlaps the loads.
constexpr int SIMT_MIN_BLOCKS = 2;
// Lanes per q.k dot product: 8 lanes x 16 B read one 128-byte row segment per shared-memory
// wavefront (no bank conflicts whatever the row stride), reduced with 3 shuffles.
constexpr int DOT_LANES = 8;
constexpr int DOT_GROUPS = THREADS / DOT_LANES;
// K (and V) tile size in shared memory: 64 slots of a 128-dim fp16 head, fewer for larger rows.
constexpr int KV_TILE_BYTES = 16 * 1024;
constexpr int MAX_KV_TILE = 2 * WARP;  // the softmax step gives each lane two slots of a row
// Lanes that may share one (row, 16-byte vector) item of p @ v, each summing a share of the tile's
// slots (a power of two dividing WARP): 4 at decode (4 rows x 16 vectors fill the 256 threads),
// so each lane sums 16 slots of a 64-slot tile instead of 64. Reasoned, not yet timed.
constexpr int MAX_PV_SLOT_LANES = 8;
constexpr int MIN_KV_TILE = 16;
// Query rows computed per pass over the slot range (G x T up to 64 shares one read of K/V);
// bounded further by SIMT_SMEM_BUDGET so that two or more blocks fit on an SM.
constexpr int MAX_ROWS_PER_PASS = 64;
constexpr int SIMT_SMEM_BUDGET = 96 * 1024;
// Split-KV sizing (H100, 132 SMs): enough (b, kv head, split) blocks for two per SM, each split at
// least 128 slots so a split's K/V read (>= 32 KiB at D = 128 fp16) dwarfs its partial result,
// and at most 128 splits (the combine holds one weight per split per warp).
constexpr int DECODE_BLOCKS_PER_SM = 2;
constexpr int MIN_SPLIT_SLOTS = 128;
constexpr int MAX_SPLITS = 128;
constexpr int64_t WORKSPACE_BUDGET_BYTES = int64_t{64} << 20;  // float partials of all splits
// Prefill scatter: one block per (b, t), 128 threads copy its Hkv x D elements.
constexpr int SCATTER_THREADS = 128;
// WMMA prefill: 4 warps; (query x key) tiles: the first of TC_TILES (64 x 64 only for D <= 128) whose
// shared memory fits the device's per-block limit (227 KiB on H100, 163 KiB on A100, 99 KiB on sm_86 /
// sm_89). 64 x 64 at D = 128: 111 KiB (sm_86 / sm_89 take 32 x 32); 32 x 32 at D = 256: 90 KiB; at
// D = 512 (Gemma 4's global layers) 32 x 32 needs 169 KiB (H100), 16 x 32 117 KiB (A100), 16 x 16
// 83 KiB (sm_86 / sm_89); at D = 576 (MLA's latents: 36 WMMA steps of 16, no padding) 189 / 131 /
// 93 KiB, the same choices. Smaller tiles read K / V more often; nothing else changes (no array in
// the kernel is sized by D). The SIMT kernels' K / V tiles are 16 slots from D = 512 on (kv_tile):
// 18 KiB at D = 576 in 16-bit (rows of 9 x 128 bytes), 36 KiB in fp32; a decode pass then holds up
// to 17 query rows in 16-bit (MLA's 16 heads per kv head at once: 91 KiB), 5 in fp32. MLA reads its
// values in the keys (Dv = 512): V tiles and accumulators are then 512 wide, so 19 rows (16: 85
// KiB) and 6 in fp32, and the WMMA tiles need 177 / 123 / 87 KiB, the same choices.
constexpr int TC_WARPS = 4;
constexpr int TC_THREADS = TC_WARPS * WARP;
constexpr int TC_LARGE_HEAD_DIM = 128;
struct TcTile {
  int rows, slots;  // query rows and key slots, multiples of 16 (WMMA fragments)
};
constexpr TcTile TC_TILES[] = {{64, 64}, {32, 32}, {16, 32}, {16, 16}};
constexpr int TC_PAD = 8;      // 16-bit elements of row padding: breaks bank conflicts of fragments
constexpr int TC_ACC_PAD = 4;  // float padding of the score / output tiles
// Dynamic shared memory a block may use without opting in (cudaFuncSetAttribute).
constexpr int DEFAULT_SMEM_LIMIT = 48 * 1024;
// Positions and slots are int inside the kernels.
constexpr int64_t MAX_SLOTS = int64_t{1} << 30;

template <typename T>
constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int align_up(int a, int b) { return ceil_div(a, b) * b; }

// 16 bytes of T -> VEC<T> floats.
__device__ __forceinline__ float2 to_float2(unsigned w, c10::Half) { return __half22float2(*reinterpret_cast<__half2*>(&w)); }
__device__ __forceinline__ float2 to_float2(unsigned w, c10::BFloat16) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
}
template <typename T>
__device__ __forceinline__ void unpack(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(w[i]);
    } else {
      const float2 x = to_float2(w[i], T());
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
}

__device__ __forceinline__ unsigned raw_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ unsigned raw_bits(c10::Half x) { return x.x; }
__device__ __forceinline__ unsigned raw_bits(c10::BFloat16 x) { return x.x; }

// Vector c (VEC elements) of a D-element global row -> shared memory, zeros past D. GVEC: rows are
// 16-byte aligned and D % VEC == 0 (checked by the launcher): an asynchronous copy (cp.async, so
// all of a thread's loads of a tile are in flight at once; async_wait() before the barrier that
// publishes them), else element loads. A V row's first Dv elements load as D = Dv: with GVEC the
// vector holding element Dv - 1 then comes whole (its row has D % VEC == 0 elements, so it stays
// inside), and what it holds past Dv only reaches accumulator columns that are never output.
template <typename T, bool GVEC>
__device__ __forceinline__ void load_vec(T* dst, const T* src, int c, int D) {
  constexpr int V = VEC<T>;
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (c * V < D) {
    if constexpr (GVEC) {
      const unsigned dst_smem = static_cast<unsigned>(__cvta_generic_to_shared(dst + c * V));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_smem), "l"(src + c * V) : "memory");
      return;
    } else {  // packed in registers (a local array would live on the stack)
      constexpr int PER_WORD = 4 / sizeof(T);
      unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (c * V + i < D) w[i / PER_WORD] |= raw_bits(src[c * V + i]) << (32 / PER_WORD * (i % PER_WORD));
      u = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  *reinterpret_cast<uint4*>(dst + c * V) = u;
}

__device__ __forceinline__ void async_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most PENDING committed groups of this thread's cp.async copies are in flight.
template <int PENDING>
__device__ __forceinline__ void async_wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Vector c of a D-element row, global -> global (the cache write).
template <typename T, bool GVEC>
__device__ __forceinline__ void copy_vec(T* dst, const T* src, int c, int D) {
  constexpr int V = VEC<T>;
  if constexpr (GVEC) {
    *reinterpret_cast<uint4*>(dst + c * V) = *reinterpret_cast<const uint4*>(src + c * V);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (c * V + i < D) dst[c * V + i] = src[c * V + i];
  }
}

// cap * tanh(s / cap) for a score s and a cap in the same (log2) units, inv_cap = 1 / cap, to float32
// rounding for any cap. Not tanhf: under --use_fast_math it may become the hardware approximation
// (2^-11 relative error), which a cap of 30 to 50 would turn into logit errors near 1e-2. Where
// |s / cap| < 0.1, s times tanh's series in (s / cap)^2: the exp2 form's 1 - e loses s / cap there,
// and s / cap itself may be subnormal (flushed) under a huge cap, when the square is 0 and the
// result s, as it should be. Elsewhere tanh from exp2 (the exponent is never positive).
__device__ __forceinline__ float soft_cap(float s, float cap, float inv_cap) {
  const float x = s * inv_cap, r = x * x;
  const float series = s * (1.f + r * (-1.f / 3.f + r * (2.f / 15.f + r * (-17.f / 315.f))));
  const float e = exp2f(-2.8853900817779268f * fabsf(x));  // exp(-2|x|), in (0, 1]
  return fabsf(x) < 0.1f ? series : copysignf(cap * ((1.f - e) / (1.f + e)), x);
}

// How a q . k dot product becomes a score, and which slots a query sees.
struct Scoring {
  float scale_log2;      // scale * log2(e): the softmax runs on exp2
  float cap_log2;        // softcap * log2(e); 0: no soft-capping
  float inv_cap_log2;    // 1 / cap_log2 (a normal float32: softcap <= 2^125)
  int window;            // a query at pos sees positions pos - window + 1 .. pos; 0: all of 0 .. pos
  int chunk;             // chunked attention (Llama 4): pos - pos % chunk .. pos; 0: none (never with a window;
                         // with ring, rebase_span keeps pos % chunk)
  bool alibi;            // ALiBi: rows carry a slope (log2 units), see biased
  // log2-domain score: scale * dot, or softcap * tanh(scale * dot / softcap) (Gemma 2).
  __device__ __forceinline__ float operator()(float dot) const {
    const float s = dot * scale_log2;
    return cap_log2 > 0.f ? soft_cap(s, cap_log2, inv_cap_log2) : s;
  }
  // The score of position x for a query at pos whose head's ALiBi slope (log2 units) is slope: the
  // capped score plus slope * (x - pos) with ALiBi, else the capped score. x and pos may both be
  // rebased (ring mode): only their difference counts.
  __device__ __forceinline__ float biased(float dot, float slope, int x, int pos) const {
    const float s = (*this)(dot);
    return alibi ? fmaf(slope, static_cast<float>(x - pos), s) : s;
  }
  // First position a query at pos (>= -1) sees; no overflow for any int pos >= -1 and window, chunk >= 0
  // (pos = -1: -1 % chunk = -1, so 0). At most pos and non-decreasing in pos: all that the spans and
  // splits cut from a row's or a tile's positions (slot_span) rely on.
  __device__ __forceinline__ int first_slot(int pos) const {
    if (window > 0) return max(0, pos - window + 1);
    return chunk > 0 ? pos - pos % chunk : 0;
  }
};

// Everything the kernels need; strides in elements, int64 (B * H * T * D can pass 2^31).
template <typename E>
struct Params {
  const E *q, *k, *v;
  E *k_cache, *v_cache, *out;
  const int64_t* positions;
  const float* sinks;  // [Hq] attention-sink logits (natural log units), or nullptr
  const float* alibi_slopes;  // [Hq] ALiBi slopes (natural log units per position), or nullptr
  float* ws_o;    // decode partials [B * Hkv, splits, G * T, Dv] (splits > 1 only)
  float* ws_lse;  // [B * Hkv, splits, G * T], log2 domain
  int* counters;  // [B * Hkv] split tickets, zeroed by the launcher
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st;
  int Hq, Hkv, G, T, S, D;
  int dp;    // D padded to the vector (SIMT) or to 16 (WMMA) in shared memory
  int bn;    // slots per K/V tile
  int rows;  // query rows per pass (decode) or per query tile (prefill)
  int splits;
  Scoring score;
  // Value (and output) head dim: D, or value_dim with values in the keys (v / v_cache then alias k /
  // k_cache); dvp is Dv padded as dp is. Read by the VIK instantiations only (the others use D, dp).
  int Dv, dvp;
};

// A position as the kernels hold it: an int, -1 for padding or any value out of range (without ring
// one with no slot; with ring one past int range, INT_MAX excluded so that pos + 1 fits).
template <bool RING>
__device__ __forceinline__ int sanitize(int64_t pos, int S) {
  if constexpr (RING) {
    return pos >= 0 && pos < INT_MAX ? static_cast<int>(pos) : -1;
  } else {
    return pos >= 0 && pos < S ? static_cast<int>(pos) : -1;
  }
}

// Cache slot of a block's position x (0 <= x < S): x itself without ring; with ring x is relative to
// the block's span (rebase_span) and base = (the span's first position) % S, so the slot is
// (base + x) % S, wrapped by one subtraction (base + x < 2 S <= 2^31 fits).
template <bool RING>
struct SlotOf {
  int base = 0, S = 0;
  __device__ __forceinline__ int operator()(int x) const {
    const int slot = base + x;
    return slot >= S ? slot - S : slot;
  }
};
template <>
struct SlotOf<false> {  // empty: the non-ring kernels' K/V sources keep their layout
  __device__ __forceinline__ int operator()(int x) const { return x; }
};

// ---------------------------------------------------------------- SIMT engine (decode, fp32 prefill)

// Carves a block's dynamic shared memory into arrays; on the host (base 0) it only sizes it.
struct SmemCarver {
  uintptr_t base;
  int bytes = 0;
  template <typename X>
  __host__ __device__ X* take(int count) {  // 32-byte aligned: WMMA tile pointers need it
    bytes = align_up(bytes, 32);
    X* at = reinterpret_cast<X*>(base + bytes);
    bytes += count * static_cast<int>(sizeof(X));
    return at;
  }
};

template <typename T>
struct SimtSmem {
  T *q, *k, *v;  // q [rows][dp], k [bn][dp], v [bn][dvp]; zero-padded past D (Dv: see load_vec)
  float *acc, *p, *m, *l, *alpha;  // acc [rows][dvp]; p [rows][bn] scores, then probabilities
  float* slope;  // [rows] ALiBi slopes, log2 units (set by simt_seed_alibi; unread without ALiBi)
  int *pos, *src;  // pos [rows]: a row sees positions 0..pos (-1: none); src [bn]: see DecodeKv
  int bytes;
  __host__ __device__ SimtSmem(uintptr_t base, int rows, int bn, int dp, int dvp) {
    SmemCarver c{base};
    q = c.take<T>(rows * dp), k = c.take<T>(bn * dp), v = c.take<T>(bn * dvp);
    acc = c.take<float>(rows * dvp), p = c.take<float>(rows * bn);
    m = c.take<float>(rows), l = c.take<float>(rows), alpha = c.take<float>(rows), slope = c.take<float>(rows);
    pos = c.take<int>(rows), src = c.take<int>(bn);
    bytes = c.bytes;
  }
};

// Lanes per (row, vector) item of the p @ v step: a power of two, at most MAX_PV_SLOT_LANES, as many
// as keep the items within one pass of the block (1 when they fill it already).
__device__ __forceinline__ int pv_slot_lanes(int items) {
  int lanes = 1;
  while (lanes < MAX_PV_SLOT_LANES && items * lanes * 2 <= THREADS) lanes *= 2;
  return lanes;
}

// Online softmax of `rows` query rows over positions [lo, hi) (kv maps them to cache rows), one K/V
// tile at a time. On entry q, pos, acc (0), m (-inf), l (0) are set and the block synchronised; on
// exit acc / m / l hold the unnormalised result (log2 domain), synchronised. A (row, slot) pair that the row must not
// see (past its position, or before its window or chunk) is never computed, so stale or non-finite values
// there cannot leak in. Keys are D wide (rows of dp in shared memory), values Dv (rows of dvp).
template <typename T, bool GVEC, typename KvSource>
__device__ void simt_attend(const SimtSmem<T>& sm, int rows, int bn, int dp, int D, int dvp, int Dv, int lo, int hi,
                            const Scoring& score, const KvSource& kv) {
  constexpr int V = VEC<T>;
  const int nvec = dp / V, nvec_v = dvp / V;
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int group = tid / DOT_LANES, sub = tid % DOT_LANES;
  // K and V of a tile load as separate cp.async groups, each as soon as its buffer is free: a
  // tile's V load overlaps its scores and softmax, the next tile's K load overlaps this tile's
  // p @ v, the next V load the next scores. Groups complete in order, so "at most one pending"
  // after issuing [K, V] means K has landed.
  auto issue = [&](T* dst, bool keys, int tile, int n) {
    const int width = keys ? D : Dv, row = keys ? dp : dvp, vecs = keys ? nvec : nvec_v;
    for (int i = tid; i < n * vecs; i += THREADS) {
      const int j = i / vecs, c = i % vecs;
      load_vec<T, GVEC>(dst + j * row, keys ? kv.k_row(tile + j, j) : kv.v_row(tile + j, j), c, width);
    }
    async_commit();
  };
  if (lo < hi) {
    kv.prepare(lo, min(bn, hi - lo));
    __syncthreads();  // src ready
    issue(sm.k, true, lo, min(bn, hi - lo));
    issue(sm.v, false, lo, min(bn, hi - lo));
  }
  for (int tile = lo; tile < hi; tile += bn) {
    const int n = min(bn, hi - tile), next = tile + bn, next_n = min(bn, hi - next);
    async_wait_pending<1>();  // this tile's K
    __syncthreads();
    // Scores (log2 domain). The trip count is uniform so that every lane reaches the shuffles.
    const int pairs = rows * bn;
    for (int base = 0; base < pairs; base += DOT_GROUPS) {
      const int i = base + group, r = i / bn, j = i % bn;
      const bool live = i < pairs && j < n && tile + j <= sm.pos[r] && tile + j >= score.first_slot(sm.pos[r]);
      float dot = 0.f;
      if (live) {
        const T* qr = sm.q + r * dp;
        const T* kr = sm.k + j * dp;
        float half_dot[2] = {0.f, 0.f};  // two FMA chains: half the dependent latency per lane
#pragma unroll 2  // deeper unrolling spills the fp32 decode kernel at its 128-register budget
        for (int c = sub; c < nvec; c += DOT_LANES) {
          float qf[V], kf[V];
          unpack<T>(*reinterpret_cast<const uint4*>(qr + c * V), qf);
          unpack<T>(*reinterpret_cast<const uint4*>(kr + c * V), kf);
#pragma unroll
          for (int e = 0; e < V; ++e) half_dot[e % 2] = fmaf(qf[e], kf[e], half_dot[e % 2]);
        }
        dot = half_dot[0] + half_dot[1];
      }
#pragma unroll
      for (int offset = DOT_LANES / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, offset);
      if (i < pairs && sub == 0) {
        const float slope = score.alibi ? sm.slope[r] : 0.f;  // (unwritten without ALiBi)
        sm.p[r * bn + j] = live ? score.biased(dot, slope, tile + j, sm.pos[r]) : -INFINITY;
      }
    }
    __syncthreads();
    // Online softmax, one warp per row. m_use keeps exp2's argument at -inf (never NaN) while a
    // row has seen no slot yet.
    for (int r = warp; r < rows; r += WARPS) {
      float* pr = sm.p + r * bn;
      const float s0 = lane < bn ? pr[lane] : -INFINITY;
      const float s1 = lane + WARP < bn ? pr[lane + WARP] : -INFINITY;
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float e0 = exp2f(s0 - m_use), e1 = exp2f(s1 - m_use);
      if (lane < bn) pr[lane] = e0;
      if (lane + WARP < bn) pr[lane + WARP] = e1;
      const float sum = warp_sum(e0 + e1);
      __syncwarp();  // every lane has read sm.m[r] (the shuffles order it; this says so to racecheck)
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_use);
        sm.alpha[r] = alpha;
        sm.l[r] = fmaf(sm.l[r], alpha, sum);
        sm.m[r] = m_new;
      }
    }
    if (next_n > 0) kv.prepare(next, next_n);  // every load of this tile is issued
    __syncthreads();  // p, alpha and src ready; nothing reads k any more
    if (next_n > 0) {
      issue(sm.k, true, next, next_n);
      async_wait_pending<1>();  // this tile's V (the next K may still be in flight)
    } else {
      async_wait_pending<0>();
    }
    __syncthreads();
    // acc = acc * alpha + p @ v; a row that sees nothing of this tile keeps its state unchanged.
    // Few rows (decode: G x T = 4 rows of 16 vectors at D = 128 in 16-bit) leave most threads idle,
    // so `slot_lanes` adjacent lanes share one (row, vector) item, each summing every slot_lanes-th
    // slot, and meet by shuffles (the lanes of an item agree on its trip counts and mask).
    const int slot_lanes = pv_slot_lanes(rows * nvec_v);
    for (int i = tid; i < rows * nvec_v * slot_lanes; i += THREADS) {
      const int item = i / slot_lanes, first = i % slot_lanes;
      const int r = item / nvec_v, c = item % nvec_v;
      const int seen = min(n, sm.pos[r] - tile + 1), skipped = max(0, score.first_slot(sm.pos[r]) - tile);
      if (seen <= skipped) continue;
      float o[V];
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = 0.f;
#pragma unroll 4
      for (int j = skipped + first; j < seen; j += slot_lanes) {
        const float pj = sm.p[r * bn + j];
        float vf[V];
        unpack<T>(*reinterpret_cast<const uint4*>(sm.v + j * dvp + c * V), vf);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = fmaf(pj, vf[e], o[e]);
      }
      const unsigned item_mask = ((1u << slot_lanes) - 1u) << (lane & ~(slot_lanes - 1));
      for (int offset = 1; offset < slot_lanes; offset <<= 1)
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] += __shfl_xor_sync(item_mask, o[e], offset);
      if (first != 0) continue;
      float4* a = reinterpret_cast<float4*>(sm.acc + r * dvp + c * V);
      const float alpha = sm.alpha[r];
#pragma unroll
      for (int e = 0; e < V / 4; ++e) {
        const float4 x = a[e];
        a[e] = make_float4(fmaf(x.x, alpha, o[4 * e]), fmaf(x.y, alpha, o[4 * e + 1]), fmaf(x.z, alpha, o[4 * e + 2]),
                           fmaf(x.w, alpha, o[4 * e + 3]));
      }
    }
    __syncthreads();  // nothing reads v or p any more
    if (next_n > 0) issue(sm.v, false, next, next_n);
  }
  __syncthreads();  // (also when there was no tile)
}

// The positions [first, last + 1) that any of `rows` sanitised positions sees; (0, 0) when all are
// padding. No overflow: a sanitised position is below INT_MAX.
template <typename PosOf>
__device__ __forceinline__ int2 slot_span(int rows, const PosOf& pos_of, const Scoring& score) {
  int first = INT_MAX, end = 0;
  for (int r = 0; r < rows; ++r) {
    const int pos = pos_of(r);
    if (pos < 0) continue;
    first = min(first, score.first_slot(pos));
    end = max(end, pos + 1);
  }
  return end == 0 ? make_int2(0, 0) : make_int2(first, end);
}

// Ring mode: rebases a block's span (slot_span of pos[0 .. rows), shared memory) and the positions
// in pos to the span's first position, and returns the slot map of the rebased positions. Only the
// numbering changes: the span starts at the smallest first visible position of the rows, so a
// row's first visible position, rebased, is still Scoring::first_slot of its rebased pos: with a
// window max(0, pos - window + 1); with chunks that start is itself a chunk start, a multiple of
// the chunk, so rebasing keeps every pos % chunk and with it every row's chunk start. A span
// longer than S (the caller's span contract violated) is cut to its last S positions: those
// before the cut become padding, windows reaching below it start at it and chunk starts move
// (garbage, as allowed then, but every access stays inside the cache, on distinct slots). Without
// ring: a no-op.
// Every thread of the block calls it, after reading pos for its span.
template <bool RING>
__device__ __forceinline__ SlotOf<RING> rebase_span(int* pos, int rows, int2& span, int S) {
  SlotOf<RING> slot_of;
  if constexpr (RING) {
    const int first = max(span.x, span.y - S);
    __syncthreads();  // every thread has its span from pos
    for (int r = threadIdx.x; r < rows; r += blockDim.x) pos[r] = pos[r] >= first ? pos[r] - first : -1;
    __syncthreads();
    slot_of.base = first % S;
    slot_of.S = S;
    span = make_int2(0, span.y - first);
  }
  return slot_of;
}

constexpr float LOG2E = 1.4426950408889634f;

// Seeds each row's softmax with its head's attention sink: a first slot of score sink_of(r) (log2
// units) and value 0, so m = sink and l = 1; returns synchronised. Rows are set up (and
// synchronised) by simt_init_rows before.
template <typename T, typename SinkOf>
__device__ void simt_seed_sinks(const SimtSmem<T>& sm, int rows, const SinkOf& sink_of) {
  for (int r = threadIdx.x; r < rows; r += THREADS) {
    sm.m[r] = sink_of(r);
    sm.l[r] = 1.f;
  }
  __syncthreads();
}

// Gives each row its head's ALiBi slope, slope_of(r) (log2 units); returns synchronised. Rows are set
// up (and synchronised) by simt_init_rows before.
template <typename T, typename SlopeOf>
__device__ void simt_seed_alibi(const SimtSmem<T>& sm, int rows, const SlopeOf& slope_of) {
  for (int r = threadIdx.x; r < rows; r += THREADS) sm.slope[r] = slope_of(r);
  __syncthreads();
}

// Value (and output) head dim of a kernel instantiation, and its rows in shared memory: Dv / dvp with
// values in the keys (VIK), else D / dp, read where the ordinary kernels always read them.
template <bool VIK, typename T>
__device__ __forceinline__ int value_width(const Params<T>& p) { return VIK ? p.Dv : p.D; }
template <bool VIK, typename T>
__device__ __forceinline__ int value_row(const Params<T>& p) { return VIK ? p.dvp : p.dp; }

// Output row of query (b, q head, t): out is contiguous [B, Hq, T, Dv].
template <bool VIK, typename T>
__device__ __forceinline__ T* out_row(const Params<T>& p, int64_t b, int qh, int t) {
  return p.out + ((b * p.Hq + qh) * p.T + t) * static_cast<int64_t>(value_width<VIK>(p));
}

// Loads `rows` query rows (q_row(r): global row, row_pos(r): sanitised position) into the SIMT
// engine and resets their softmax state; returns synchronised.
template <typename T, bool GVEC, typename QRow, typename RowPos>
__device__ void simt_init_rows(const SimtSmem<T>& sm, int rows, int dp, int D, int dvp, const QRow& q_row,
                               const RowPos& row_pos) {
  constexpr int V = VEC<T>;
  const int nvec = dp / V, nvec_v = dvp / V;
  for (int i = threadIdx.x; i < rows * nvec; i += THREADS) {
    const int r = i / nvec, c = i % nvec;
    load_vec<T, GVEC>(sm.q + r * dp, q_row(r), c, D);
    if (dvp == dp || c < nvec_v) {  // acc [rows][dvp]: c < nvec_v, written to fold away where dvp is dp
      float4* a = reinterpret_cast<float4*>(sm.acc + r * dvp + c * V);
#pragma unroll
      for (int e = 0; e < V / 4; ++e) a[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  for (int r = threadIdx.x; r < rows; r += THREADS) {
    sm.pos[r] = row_pos(r);
    sm.m[r] = -INFINITY;
    sm.l[r] = 0.f;
  }
  async_wait();
  __syncthreads();
}

// ------------------------------------------------------------------------------- host helpers

// Slots per K/V tile: the largest power of two <= MAX_KV_TILE whose tile fits KV_TILE_BYTES.
inline int kv_tile(int row_bytes) {
  int bn = MAX_KV_TILE;
  while (bn > MIN_KV_TILE && bn * row_bytes > KV_TILE_BYTES) bn /= 2;
  return bn;
}

// Static shared memory of a kernel (its __shared__ arrays), which counts against the same limits.
template <typename Kernel>
int static_smem(Kernel kernel) {
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
  return static_cast<int>(attributes.sharedSizeBytes);
}

// Query rows per pass / tile of `kernel`'s SIMT engine whose dynamic shared memory fits
// SIMT_SMEM_BUDGET and, with the kernel's static shared memory, the device's per-block limit
// (99 KiB on sm_86 / sm_89, which run the sm_80 build). Passes are balanced: 64 rows that fit 62
// at a time run as 2 x 32, not 62 + 2.
template <typename T, typename Kernel>
int simt_rows(Kernel kernel, int wanted, int bn, int dp, int dvp) {
  const int budget = std::min(SIMT_SMEM_BUDGET,
                              device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin) - static_smem(kernel));
  wanted = std::max(1, wanted);
  int rows = std::min(wanted, MAX_ROWS_PER_PASS);
  while (rows > 1 && SimtSmem<T>(0, rows, bn, dp, dvp).bytes > budget) --rows;
  const int passes = ceil_div(std::min(wanted, MAX_ROWS_PER_PASS), rows);
  return ceil_div(std::min(wanted, MAX_ROWS_PER_PASS), passes);
}

// The instantiation kernel<T, GVEC, RING, VIK> for the runtime flags: pick(g, r, v) returns it for
// std::bool_constant arguments (kernels are function templates, not types).
template <typename Pick>
auto pick_kernel(bool gvec, bool ring, bool values_in_keys, const Pick& pick) {
  const auto with_vik = [&](auto g, auto r) {
    return values_in_keys ? pick(g, r, std::true_type{}) : pick(g, r, std::false_type{});
  };
  const auto with_ring = [&](auto g) { return ring ? with_vik(g, std::true_type{}) : with_vik(g, std::false_type{}); };
  return gvec ? with_ring(std::true_type{}) : with_ring(std::false_type{});
}

// Opts a kernel in to `bytes` of dynamic shared memory on the current device (once per size):
// needed whenever static + dynamic shared memory passes the 48 KiB default.
template <typename Kernel>
void set_dynamic_smem(Kernel kernel, int bytes) {
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int total = bytes + static_smem(kernel);
  TORCH_CHECK(total <= limit, "kv_cache_attention: needs ", total, " bytes of shared memory per block, the device has ",
              limit);
  if (total <= DEFAULT_SMEM_LIMIT) return;
  static std::mutex mutex;
  static auto* done = new std::map<std::pair<const void*, int>, int>();  // (kernel, device) -> bytes
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  int& granted = (*done)[{reinterpret_cast<const void*>(kernel), device}];
  if (granted < bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    granted = bytes;
  }
}

// One launch each, defined (and instantiated for float, Half, BFloat16) in the decode / prefill files.
template <typename T>
void launch_decode(Params<T> p, int64_t B, const at::Tensor& q, bool gvec, bool ring, bool values_in_keys,
                   cudaStream_t stream);
template <typename T>
void launch_prefill(Params<T> p, int64_t B, bool gvec, bool ring, bool values_in_keys, cudaStream_t stream);

}  // namespace kv_attention
}  // namespace gptfast_kernels
