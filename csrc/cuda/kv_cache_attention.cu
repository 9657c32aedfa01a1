// kv_cache_attention CUDA kernels: static-KV-cache attention with the position scatter fused in.
//
//   for (b, t) with 0 <= positions[b, t] < S:  k_cache[b, :, positions[b, t]] = k[b, :, t]  (same for v)
//   out[b, h, t] = softmax(scale * q[b, h, t] . k_cache[b, h / G, 0..positions[b, t]]) @ v_cache[...]
//   out[b, h, t] = 0 where the position is outside [0, S) (padding, or a bad value under capture)
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
// by the last block of the (b, kv head) to finish (an atomic ticket that this block resets).
// Prefill (T > DECODE_MAX_T): every query tile reads the new K/V, so no single block can own them:
// a small scatter kernel (T x Hkv x D elements, negligible next to O(T^2) attention) runs first on
// the same stream, then a tiled kernel over query tiles x heads x batch reads the cache, with an
// online softmax over key tiles up to the tile's largest position: WMMA tensor cores (fp32
// accumulators) for fp16 / bf16, the SIMT engine of the decode kernel for fp32.
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
#include <utility>
#include <vector>

#include "../common.h"

namespace gptfast_kernels {
namespace {

// Launch and tuning constants: sized by reasoning for H100 (132 SMs, 228 KiB shared memory per SM)
// and A100; not yet measured (they were written without a GPU): tune them with bench/.
constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
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
// WMMA prefill: 4 warps, 64 x 64 (query x key) tiles for D <= 128, 32 x 32 above (shared memory:
// 111 KiB at D = 128, 90 KiB at D = 256, under the A100's 163 KiB).
constexpr int TC_WARPS = 4;
constexpr int TC_THREADS = TC_WARPS * WARP;
constexpr int TC_LARGE_HEAD_DIM = 128;
constexpr int TC_PAD = 8;      // 16-bit elements of row padding: breaks bank conflicts of fragments
constexpr int TC_ACC_PAD = 4;  // float padding of the score / output tiles
// Dynamic shared memory a block may use without opting in (cudaFuncSetAttribute).
constexpr int DEFAULT_SMEM_LIMIT = 48 * 1024;
// Split tickets allocated at least at once: enough for B * Hkv = 1024 without regrowing.
constexpr int64_t MIN_COUNTERS = 1024;
// Positions and slots are int inside the kernels.
constexpr int64_t MAX_SLOTS = int64_t{1} << 30;

template <typename T>
constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int align_up(int a, int b) { return ceil_div(a, b) * b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = WARP / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
  return v;
}

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
// publishes them), else element loads.
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

// Everything the kernels need; strides in elements, int64 (B * H * T * D can pass 2^31).
template <typename E>
struct Params {
  const E *q, *k, *v;
  E *k_cache, *v_cache, *out;
  const int64_t* positions;
  float* ws_o;    // decode partials [B * Hkv, splits, G * T, D] (splits > 1 only)
  float* ws_lse;  // [B * Hkv, splits, G * T], log2 domain
  int* counters;  // [B * Hkv] split tickets, zero between launches
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st;
  int Hq, Hkv, G, T, S, D;
  int dp;    // D padded to the vector (SIMT) or to 16 (WMMA) in shared memory
  int bn;    // slots per K/V tile
  int rows;  // query rows per pass (decode) or per query tile (prefill)
  int splits;
  float scale_log2;  // scale * log2(e): the softmax runs on exp2
};

__device__ __forceinline__ int sanitize(int64_t pos, int S) { return pos >= 0 && pos < S ? static_cast<int>(pos) : -1; }

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
  T *q, *k, *v;  // q [rows][dp], k / v [bn][dp], zero-padded past D
  float *acc, *p, *m, *l, *alpha;  // acc [rows][dp]; p [rows][bn] scores, then probabilities
  int *pos, *src;  // pos [rows]: a row sees slots 0..pos (-1: none); src [bn]: see DecodeKv
  int bytes;
  __host__ __device__ SimtSmem(uintptr_t base, int rows, int bn, int dp) {
    SmemCarver c{base};
    q = c.take<T>(rows * dp), k = c.take<T>(bn * dp), v = c.take<T>(bn * dp);
    acc = c.take<float>(rows * dp), p = c.take<float>(rows * bn);
    m = c.take<float>(rows), l = c.take<float>(rows), alpha = c.take<float>(rows);
    pos = c.take<int>(rows), src = c.take<int>(bn);
    bytes = c.bytes;
  }
};

// Online softmax of `rows` query rows over cache slots [lo, hi), one K/V tile at a time. On entry
// q, pos, acc (0), m (-inf), l (0) are set and the block synchronised; on exit acc / m / l hold
// the unnormalised result (log2 domain), synchronised. A (row, slot) pair that the row must not
// see is never computed, so stale or non-finite values there cannot leak in.
template <typename T, bool GVEC, typename KvSource>
__device__ void simt_attend(const SimtSmem<T>& sm, int rows, int bn, int dp, int D, int lo, int hi,
                            float scale_log2, const KvSource& kv) {
  constexpr int V = VEC<T>;
  const int nvec = dp / V;
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int group = tid / DOT_LANES, sub = tid % DOT_LANES;
  for (int tile = lo; tile < hi; tile += bn) {
    const int n = min(bn, hi - tile);
    kv.prepare(tile, n);
    __syncthreads();  // src ready; the previous tile's readers of k / v / p are done
    for (int i = tid; i < n * nvec; i += THREADS) {
      const int j = i / nvec, c = i % nvec;
      load_vec<T, GVEC>(sm.k + j * dp, kv.k_row(tile + j, j), c, D);
      load_vec<T, GVEC>(sm.v + j * dp, kv.v_row(tile + j, j), c, D);
    }
    async_wait();
    __syncthreads();
    // Scores (log2 domain). The trip count is uniform so that every lane reaches the shuffles.
    const int pairs = rows * bn;
    for (int base = 0; base < pairs; base += DOT_GROUPS) {
      const int i = base + group, r = i / bn, j = i % bn;
      const bool live = i < pairs && j < n && tile + j <= sm.pos[r];
      float dot = 0.f;
      if (live) {
        const T* qr = sm.q + r * dp;
        const T* kr = sm.k + j * dp;
#pragma unroll 2  // deeper unrolling spills the fp32 decode kernel at its 128-register budget
        for (int c = sub; c < nvec; c += DOT_LANES) {
          float qf[V], kf[V];
          unpack<T>(*reinterpret_cast<const uint4*>(qr + c * V), qf);
          unpack<T>(*reinterpret_cast<const uint4*>(kr + c * V), kf);
#pragma unroll
          for (int e = 0; e < V; ++e) dot = fmaf(qf[e], kf[e], dot);
        }
      }
#pragma unroll
      for (int offset = DOT_LANES / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, offset);
      if (i < pairs && sub == 0) sm.p[r * bn + j] = live ? dot * scale_log2 : -INFINITY;
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
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_use);
        sm.alpha[r] = alpha;
        sm.l[r] = fmaf(sm.l[r], alpha, sum);
        sm.m[r] = m_new;
      }
    }
    __syncthreads();
    // acc = acc * alpha + p @ v; a row that sees nothing of this tile keeps its state unchanged.
    for (int i = tid; i < rows * nvec; i += THREADS) {
      const int r = i / nvec, c = i % nvec;
      const int seen = min(n, sm.pos[r] - tile + 1);
      if (seen <= 0) continue;
      float o[V];
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = 0.f;
      for (int j = 0; j < seen; ++j) {
        const float pj = sm.p[r * bn + j];
        float vf[V];
        unpack<T>(*reinterpret_cast<const uint4*>(sm.v + j * dp + c * V), vf);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = fmaf(pj, vf[e], o[e]);
      }
      float4* a = reinterpret_cast<float4*>(sm.acc + r * dp + c * V);
      const float alpha = sm.alpha[r];
#pragma unroll
      for (int e = 0; e < V / 4; ++e) {
        const float4 x = a[e];
        a[e] = make_float4(fmaf(x.x, alpha, o[4 * e]), fmaf(x.y, alpha, o[4 * e + 1]), fmaf(x.z, alpha, o[4 * e + 2]),
                           fmaf(x.w, alpha, o[4 * e + 3]));
      }
    }
  }
  __syncthreads();
}

// True when no later token of the row writes the same slot: with repeated positions (possible
// only under capture, where they are not checked) the last token wins, as on the CPU, and a slot
// never gets two concurrent writers.
__device__ __forceinline__ bool last_writer(const int* row_pos, int T, int t) {
  for (int later = t + 1; later < T; ++later)
    if (row_pos[later] == row_pos[t]) return false;
  return true;
}

// K/V rows of a decode block: a slot written by this launch is read from k / v (src[j] = the
// token writing it), any other slot from the cache.
template <typename T>
struct DecodeKv {
  const T *k_new, *v_new;  // k / v of this (b, kv head); + t * stride
  int64_t k_st, v_st;
  const T *k_cache, *v_cache;  // caches of this (b, kv head)
  const int* new_pos;          // [T] sanitised positions (shared memory)
  int* src;                    // [bn] shared memory
  int T_, D;
  __device__ void prepare(int tile, int n) const {
    if (static_cast<int>(threadIdx.x) < n) {
      const int slot = tile + static_cast<int>(threadIdx.x);
      int found = -1;  // with repeated positions (only possible under capture) the last token wins
      for (int t = 0; t < T_; ++t)
        if (new_pos[t] == slot) found = t;
      src[threadIdx.x] = found;
    }
  }
  __device__ const T* k_row(int slot, int j) const {
    return src[j] >= 0 ? k_new + src[j] * k_st : k_cache + static_cast<int64_t>(slot) * D;
  }
  __device__ const T* v_row(int slot, int j) const {
    return src[j] >= 0 ? v_new + src[j] * v_st : v_cache + static_cast<int64_t>(slot) * D;
  }
};

// K/V rows of a prefill block: the cache, already scattered by scatter_kernel.
template <typename T>
struct CacheKv {
  const T *k_cache, *v_cache;
  int D;
  __device__ void prepare(int, int) const {}
  __device__ const T* k_row(int slot, int) const { return k_cache + static_cast<int64_t>(slot) * D; }
  __device__ const T* v_row(int slot, int) const { return v_cache + static_cast<int64_t>(slot) * D; }
};

// Output row of query (b, q head, t): out is contiguous [B, Hq, T, D].
template <typename T>
__device__ __forceinline__ T* out_row(const Params<T>& p, int64_t b, int qh, int t) {
  return p.out + ((b * p.Hq + qh) * p.T + t) * static_cast<int64_t>(p.D);
}

// Loads `rows` query rows (q_row(r): global row, row_pos(r): sanitised position) into the SIMT
// engine and resets their softmax state; returns synchronised.
template <typename T, bool GVEC, typename QRow, typename RowPos>
__device__ void simt_init_rows(const SimtSmem<T>& sm, int rows, int dp, int D, const QRow& q_row,
                               const RowPos& row_pos) {
  constexpr int V = VEC<T>;
  const int nvec = dp / V;
  for (int i = threadIdx.x; i < rows * nvec; i += THREADS) {
    const int r = i / nvec, c = i % nvec;
    load_vec<T, GVEC>(sm.q + r * dp, q_row(r), c, D);
#pragma unroll
    for (int e = 0; e < V / 4; ++e) reinterpret_cast<float4*>(sm.acc + r * dp + c * V)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int r = threadIdx.x; r < rows; r += THREADS) {
    sm.pos[r] = row_pos(r);
    sm.m[r] = -INFINITY;
    sm.l[r] = 0.f;
  }
  async_wait();
  __syncthreads();
}

template <typename T, bool GVEC>
__global__ void __launch_bounds__(THREADS, SIMT_MIN_BLOCKS) decode_kernel(const Params<T> p) {
  constexpr int V = VEC<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int new_pos[DECODE_MAX_T];
  __shared__ float split_weight[WARPS][MAX_SPLITS];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int split = static_cast<int>(blockIdx.x % p.splits);
  const int64_t bh = blockIdx.x / p.splits, b = bh / p.Hkv;
  const int h = static_cast<int>(bh % p.Hkv), GT = p.G * p.T, D = p.D;
  // Query row rr = g * T + t of the group is (q head h * G + g, token t).
  auto group_out = [&](int rr) { return out_row(p, b, h * p.G + rr / p.T, rr % p.T); };
  if (tid < p.T) new_pos[tid] = sanitize(p.positions[b * p.T + tid], p.S);
  __syncthreads();
  int len = 0;  // slots any query of the row reads
  for (int t = 0; t < p.T; ++t) len = max(len, new_pos[t] + 1);
  // Every block of the row derives the same partition of [0, len), so exactly one owns each slot.
  const int chunk = max(MIN_SPLIT_SLOTS, align_up(ceil_div(len, p.splits), p.bn));
  const int active = ceil_div(len, chunk);
  if (split >= active) {
    if (split == 0) {  // len == 0: every query of the row is padding
      for (int i = tid; i < GT * D; i += THREADS) group_out(i / D)[i % D] = T(0.f);
    }
    return;
  }
  const int lo = split * chunk, hi = min(lo + chunk, len);
  const T* k_new = p.k + b * p.k_sb + h * p.k_sh;
  const T* v_new = p.v + b * p.v_sb + h * p.v_sh;
  T* k_cache = p.k_cache + bh * p.S * static_cast<int64_t>(D);
  T* v_cache = p.v_cache + bh * p.S * static_cast<int64_t>(D);

  // Fused scatter of the new rows whose slots this block owns (its reads of them use k / v).
  const int dvec = ceil_div(D, V);
  for (int i = tid; i < p.T * dvec; i += THREADS) {
    const int t = i / dvec, c = i % dvec, slot = new_pos[t];
    if (slot >= lo && slot < hi && last_writer(new_pos, p.T, t)) {
      copy_vec<T, GVEC>(k_cache + static_cast<int64_t>(slot) * D, k_new + t * p.k_st, c, D);
      copy_vec<T, GVEC>(v_cache + static_cast<int64_t>(slot) * D, v_new + t * p.v_st, c, D);
    }
  }

  const SimtSmem<T> sm(reinterpret_cast<uintptr_t>(smem), p.rows, p.bn, p.dp);
  const DecodeKv<T> kv{k_new, v_new, p.k_st, p.v_st, k_cache, v_cache, new_pos, sm.src, p.T, D};
  const int64_t ws_row0 = (bh * p.splits + split) * GT;  // this split's partials (active > 1 only)
  for (int r0 = 0; r0 < GT; r0 += p.rows) {  // passes of at most p.rows query rows
    const int rows = min(p.rows, GT - r0);
    simt_init_rows<T, GVEC>(
        sm, rows, p.dp, D,
        [&](int r) { return p.q + b * p.q_sb + (h * p.G + (r0 + r) / p.T) * p.q_sh + ((r0 + r) % p.T) * p.q_st; },
        [&](int r) { return new_pos[(r0 + r) % p.T]; });
    simt_attend<T, GVEC>(sm, rows, p.bn, p.dp, D, lo, hi, p.scale_log2, kv);
    for (int i = tid; i < rows * D; i += THREADS) {
      const int r = i / D, d = i % D;
      const float l = sm.l[r], o = l > 0.f ? sm.acc[r * p.dp + d] / l : 0.f;
      if (active == 1) {
        group_out(r0 + r)[d] = T(o);
      } else {
        p.ws_o[(ws_row0 + r0 + r) * D + d] = o;
      }
    }
    for (int r = tid; r < rows && active > 1; r += THREADS) {
      const float l = sm.l[r];
      p.ws_lse[ws_row0 + r0 + r] = l > 0.f ? sm.m[r] + log2f(l) : -INFINITY;
    }
    __syncthreads();  // the next pass overwrites q / acc / pos
  }
  if (active == 1) return;

  // The last block of this (b, kv head) to finish merges the splits: out = sum_s w_s o_s / sum_s w_s
  // with w_s = 2^(lse_s - max lse). The fence before the ticket publishes this block's partials.
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(p.counters + bh, 1) == active - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const float* lse = p.ws_lse + bh * p.splits * GT;                        // [splits][GT]
  const float* part = p.ws_o + bh * p.splits * GT * static_cast<int64_t>(D);  // [splits][GT][D]
  float* w = split_weight[warp];
  for (int rr = warp; rr < GT; rr += WARPS) {
    float mx = -INFINITY;
    for (int s = lane; s < active; s += WARP) mx = fmaxf(mx, __ldcg(lse + s * GT + rr));
    mx = warp_max(mx);
    float total = 0.f;
    for (int s = lane; s < active; s += WARP) {
      w[s] = mx == -INFINITY ? 0.f : exp2f(__ldcg(lse + s * GT + rr) - mx);
      total += w[s];
    }
    total = warp_sum(total);
    __syncwarp();
    const float inv = total > 0.f ? 1.f / total : 0.f;  // every split empty: padding, zero output
    for (int d = lane; d < D; d += WARP) {
      float acc = 0.f;
      for (int s = 0; s < active; ++s) acc = fmaf(w[s], __ldcg(part + (static_cast<int64_t>(s) * GT + rr) * D + d), acc);
      group_out(rr)[d] = T(acc * inv);
    }
    __syncwarp();  // w is rewritten for this warp's next row
  }
  if (tid == 0) p.counters[bh] = 0;  // every active block has taken its ticket: ready for the next launch
}

// ------------------------------------------------------------------------------------- prefill

// k / v [b, :, t] -> caches [b, :, positions[b, t]]; one block per (b, t).
template <typename T, bool GVEC>
__global__ void __launch_bounds__(SCATTER_THREADS) scatter_kernel(const Params<T> p) {
  const int64_t bt = blockIdx.x, b = bt / p.T, t = bt % p.T;
  const int slot = sanitize(p.positions[bt], p.S);
  // A later token of the row with the same slot wins (see last_writer); the block scans them together.
  bool overwritten = false;
  for (int64_t later = t + 1 + threadIdx.x; later < p.T && slot >= 0; later += SCATTER_THREADS)
    overwritten = overwritten || sanitize(p.positions[b * p.T + later], p.S) == slot;
  if (__syncthreads_or(overwritten) || slot < 0) return;
  const int dvec = ceil_div(p.D, VEC<T>);
  for (int i = threadIdx.x; i < p.Hkv * dvec; i += SCATTER_THREADS) {
    const int h = i / dvec, c = i % dvec;
    const int64_t dst = ((b * p.Hkv + h) * p.S + slot) * static_cast<int64_t>(p.D);
    copy_vec<T, GVEC>(p.k_cache + dst, p.k + b * p.k_sb + h * p.k_sh + t * p.k_st, c, p.D);
    copy_vec<T, GVEC>(p.v_cache + dst, p.v + b * p.v_sb + h * p.v_sh + t * p.v_st, c, p.D);
  }
}

// Query tile of a prefill block: blockIdx.x = (b, q head, tile), the longest (last) tiles first.
struct PrefillTile {
  int64_t b;
  int qh, t0, rows;
};
template <typename T>
__device__ __forceinline__ PrefillTile prefill_tile(const Params<T>& p) {
  const int tiles = ceil_div(p.T, p.rows);
  int64_t x = blockIdx.x;
  const int tile = tiles - 1 - static_cast<int>(x % tiles);
  x /= tiles;
  const int t0 = tile * p.rows;
  return {x / p.Hq, static_cast<int>(x % p.Hq), t0, min(p.rows, p.T - t0)};
}

template <typename T, bool GVEC>
__global__ void __launch_bounds__(THREADS, SIMT_MIN_BLOCKS) prefill_simt_kernel(const Params<T> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const PrefillTile tl = prefill_tile(p);
  const SimtSmem<T> sm(reinterpret_cast<uintptr_t>(smem), p.rows, p.bn, p.dp);
  simt_init_rows<T, GVEC>(
      sm, tl.rows, p.dp, p.D, [&](int r) { return p.q + tl.b * p.q_sb + tl.qh * p.q_sh + (tl.t0 + r) * p.q_st; },
      [&](int r) { return sanitize(p.positions[tl.b * p.T + tl.t0 + r], p.S); });
  int len = 0;  // keys up to the tile's largest position
  for (int r = 0; r < tl.rows; ++r) len = max(len, sm.pos[r] + 1);
  const int64_t kv_off = (tl.b * p.Hkv + tl.qh / p.G) * p.S * static_cast<int64_t>(p.D);
  const CacheKv<T> kv{p.k_cache + kv_off, p.v_cache + kv_off, p.D};
  simt_attend<T, GVEC>(sm, tl.rows, p.bn, p.dp, p.D, 0, len, p.scale_log2, kv);
  for (int i = threadIdx.x; i < tl.rows * p.D; i += THREADS) {
    const int r = i / p.D, d = i % p.D;
    const float l = sm.l[r];
    out_row(p, tl.b, tl.qh, tl.t0 + r)[d] = T(l > 0.f ? sm.acc[r * p.dp + d] / l : 0.f);
  }
}

template <typename T>
struct MmaType;
template <>
struct MmaType<c10::Half> { using type = __half; };
template <>
struct MmaType<c10::BFloat16> { using type = __nv_bfloat16; };

template <typename T>
struct TcSmem {
  int ldq, lds, ldp, ldo;  // leading dims (elements); every 16-row / 16-column tile stays 32-byte aligned
  T *q, *k, *v;            // q [bm][ldq], k / v [bn][ldq]; zero past D, past the tile's rows, past the slots
  float* s;                // scores [bm][lds]
  T* p;                    // probabilities [bm][ldp]
  float *o, *m, *l;        // output accumulator [bm][ldo], softmax state [bm]
  int* pos;                // [bm]
  int bytes;
  __host__ __device__ TcSmem(uintptr_t base, int bm, int bn, int dp)
      : ldq(dp + TC_PAD), lds(bn + TC_ACC_PAD), ldp(bn + TC_PAD), ldo(dp + TC_ACC_PAD) {
    SmemCarver c{base};
    q = c.take<T>(bm * ldq), k = c.take<T>(bn * ldq), v = c.take<T>(bn * ldq);
    s = c.take<float>(bm * lds), p = c.take<T>(bm * ldp), o = c.take<float>(bm * ldo);
    m = c.take<float>(bm), l = c.take<float>(bm), pos = c.take<int>(bm);
    bytes = c.bytes;
  }
};

// fp16 / bf16 prefill on tensor cores: S = Q K^T and O += P V with 16x16x16 WMMA, fp32 accumulators;
// the online softmax runs on the fp32 score tile in shared memory, P is rounded to q's dtype.
template <typename T, bool GVEC>
__global__ void __launch_bounds__(TC_THREADS) prefill_tc_kernel(const Params<T> p) {
  using namespace nvcuda;
  using mma_t = typename MmaType<T>::type;
  constexpr int V = VEC<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const PrefillTile tl = prefill_tile(p);
  const int bm = p.rows, bn = p.bn, dp = p.dp, D = p.D;
  const TcSmem<T> sm(reinterpret_cast<uintptr_t>(smem), bm, bn, dp);
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nvec = dp / V;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  const T* q_base = p.q + tl.b * p.q_sb + tl.qh * p.q_sh;
  for (int i = tid; i < bm * nvec; i += TC_THREADS) {
    const int r = i / nvec, c = i % nvec;
    if (r < tl.rows) {
      load_vec<T, GVEC>(sm.q + r * sm.ldq, q_base + (tl.t0 + r) * p.q_st, c, D);
    } else {
      *reinterpret_cast<uint4*>(sm.q + r * sm.ldq + c * V) = zero;
    }
  }
  for (int i = tid; i < bm * dp; i += TC_THREADS) sm.o[(i / dp) * sm.ldo + i % dp] = 0.f;
  for (int r = tid; r < bm; r += TC_THREADS) {
    sm.pos[r] = r < tl.rows ? sanitize(p.positions[tl.b * p.T + tl.t0 + r], p.S) : -1;
    sm.m[r] = -INFINITY;
    sm.l[r] = 0.f;
  }
  async_wait();
  __syncthreads();
  int len = 0;  // keys up to the tile's largest position
  for (int r = 0; r < tl.rows; ++r) len = max(len, sm.pos[r] + 1);
  const int64_t kv_off = (tl.b * p.Hkv + tl.qh / p.G) * p.S * static_cast<int64_t>(D);
  const T* k_cache = p.k_cache + kv_off;
  const T* v_cache = p.v_cache + kv_off;

  for (int tile = 0; tile < len; tile += bn) {
    const int n = min(bn, len - tile);
    for (int i = tid; i < bn * nvec; i += TC_THREADS) {
      const int j = i / nvec, c = i % nvec;
      if (j < n) {  // rows past n are zeros: P is 0 there, and 0 * garbage could be NaN
        load_vec<T, GVEC>(sm.k + j * sm.ldq, k_cache + static_cast<int64_t>(tile + j) * D, c, D);
        load_vec<T, GVEC>(sm.v + j * sm.ldq, v_cache + static_cast<int64_t>(tile + j) * D, c, D);
      } else {
        *reinterpret_cast<uint4*>(sm.k + j * sm.ldq + c * V) = zero;
        *reinterpret_cast<uint4*>(sm.v + j * sm.ldq + c * V) = zero;
      }
    }
    async_wait();
    __syncthreads();
    const int n16 = align_up(n, 16);
    for (int f = warp; f < (bm / 16) * (n16 / 16); f += TC_WARPS) {
      const int i = f / (n16 / 16), jt = f % (n16 / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int kk = 0; kk < dp; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::col_major> bt;  // K row-major = K^T col-major
        wmma::load_matrix_sync(a, reinterpret_cast<const mma_t*>(sm.q + 16 * i * sm.ldq + kk), sm.ldq);
        wmma::load_matrix_sync(bt, reinterpret_cast<const mma_t*>(sm.k + 16 * jt * sm.ldq + kk), sm.ldq);
        wmma::mma_sync(acc, a, bt, acc);
      }
      wmma::store_matrix_sync(sm.s + 16 * i * sm.lds + 16 * jt, acc, sm.lds, wmma::mem_row_major);
    }
    __syncthreads();
    // Online softmax, one warp per row (as in simt_attend), then the row of O is rescaled.
    for (int r = warp; r < bm; r += TC_WARPS) {
      const float* sr = sm.s + r * sm.lds;
      const int seen = min(n, sm.pos[r] - tile + 1);
      const float s0 = lane < seen ? sr[lane] * p.scale_log2 : -INFINITY;
      const float s1 = lane + WARP < seen ? sr[lane + WARP] * p.scale_log2 : -INFINITY;
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float e0 = exp2f(s0 - m_use), e1 = exp2f(s1 - m_use);
      T* pr = sm.p + r * sm.ldp;
      if (lane < bn) pr[lane] = T(e0);
      if (lane + WARP < bn) pr[lane + WARP] = T(e1);
      const float sum = warp_sum(e0 + e1);
      const float alpha = exp2f(m_old - m_use);
      for (int d = lane; d < dp; d += WARP) sm.o[r * sm.ldo + d] *= alpha;
      if (lane == 0) {
        sm.l[r] = fmaf(sm.l[r], alpha, sum);
        sm.m[r] = m_new;
      }
    }
    __syncthreads();
    for (int f = warp; f < (bm / 16) * (dp / 16); f += TC_WARPS) {
      const int i = f / (dp / 16), dt = f % (dp / 16);
      float* o_tile = sm.o + 16 * i * sm.ldo + 16 * dt;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_tile, sm.ldo, wmma::mem_row_major);
      for (int kk = 0; kk < n16; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::row_major> bv;
        wmma::load_matrix_sync(a, reinterpret_cast<const mma_t*>(sm.p + 16 * i * sm.ldp + kk), sm.ldp);
        wmma::load_matrix_sync(bv, reinterpret_cast<const mma_t*>(sm.v + kk * sm.ldq + 16 * dt), sm.ldq);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(o_tile, acc, sm.ldo, wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int i = tid; i < tl.rows * D; i += TC_THREADS) {
    const int r = i / D, d = i % D;
    const float l = sm.l[r];
    out_row(p, tl.b, tl.qh, tl.t0 + r)[d] = T(l > 0.f ? sm.o[r * sm.ldo + d] / l : 0.f);
  }
}

// ------------------------------------------------------------------------------------- launchers

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Slots per K/V tile: the largest power of two <= MAX_KV_TILE whose tile fits KV_TILE_BYTES.
int kv_tile(int row_bytes) {
  int bn = MAX_KV_TILE;
  while (bn > MIN_KV_TILE && bn * row_bytes > KV_TILE_BYTES) bn /= 2;
  return bn;
}

// Query rows per pass / tile of the SIMT engine that fit SIMT_SMEM_BUDGET.
// Passes are balanced: 64 rows that fit 62 at a time run as 2 x 32, not 62 + 2.
template <typename T>
int simt_rows(int wanted, int bn, int dp) {
  wanted = std::max(1, wanted);
  int rows = std::min(wanted, MAX_ROWS_PER_PASS);
  while (rows > 1 && SimtSmem<T>(0, rows, bn, dp).bytes > SIMT_SMEM_BUDGET) --rows;
  const int passes = ceil_div(std::min(wanted, MAX_ROWS_PER_PASS), rows);
  return ceil_div(std::min(wanted, MAX_ROWS_PER_PASS), passes);
}

int device_attribute(cudaDeviceAttr attr) {  // a host-side lookup: no synchronisation
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// Static shared memory of a kernel (its __shared__ arrays), which counts against the same limits.
template <typename Kernel>
int static_smem(Kernel kernel) {
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
  return static_cast<int>(attributes.sharedSizeBytes);
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

// Split tickets, zero between launches (each merging block resets its own), so a launch needs no
// memset. One buffer per (device, stream): launches on one stream are ordered, so they never share
// a ticket concurrently. A buffer that is outgrown stays allocated, since a captured CUDA graph may
// still use it. Under capture a fresh zeroed buffer is used instead (a memset node in the graph):
// a persistent one created now would not be zero until the graph first ran.
at::Tensor split_counters(const at::Tensor& like, int64_t n, cudaStream_t stream) {
  const auto options = like.options().dtype(at::kInt);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return at::zeros({n}, options);
  }
  static std::mutex mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  static auto* outgrown = new std::vector<at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[{like.get_device(), stream}];
  if (!buffer.defined() || buffer.numel() < n) {
    if (buffer.defined()) outgrown->push_back(buffer);
    buffer = at::zeros({std::max(n, MIN_COUNTERS)}, options);
  }
  return buffer;
}

template <typename T>
void launch_decode(Params<T> p, int64_t B, const at::Tensor& q, bool gvec, cudaStream_t stream) {
  p.dp = align_up(p.D, VEC<T>);
  p.bn = kv_tile(p.dp * static_cast<int>(sizeof(T)));
  const int64_t GT = static_cast<int64_t>(p.G) * p.T, bh = B * p.Hkv;
  p.rows = simt_rows<T>(static_cast<int>(std::min<int64_t>(GT, MAX_ROWS_PER_PASS)), p.bn, p.dp);
  // Splits from host-known sizes only (a CUDA graph replays them for any positions).
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  int64_t splits = ceil_div64(static_cast<int64_t>(DECODE_BLOCKS_PER_SM) * sms, bh);
  splits = std::min({splits, ceil_div64(p.S, MIN_SPLIT_SLOTS), static_cast<int64_t>(MAX_SPLITS),
                     WORKSPACE_BUDGET_BYTES / (bh * GT * p.D * static_cast<int64_t>(sizeof(float)))});
  splits = std::max<int64_t>(splits, 1);
  TORCH_CHECK(bh * splits <= INT_MAX, "kv_cache_attention: B * Hkv = ", bh, " exceeds the CUDA grid");
  p.splits = static_cast<int>(splits);
  at::Tensor ws_o, ws_lse, counters;
  if (splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    ws_o = at::empty({bh * splits * GT * p.D}, f32);
    ws_lse = at::empty({bh * splits * GT}, f32);
    counters = split_counters(q, bh, stream);
    p.ws_o = ws_o.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.counters = counters.data_ptr<int>();
  }
  const int bytes = SimtSmem<T>(0, p.rows, p.bn, p.dp).bytes;
  auto kernel = gvec ? decode_kernel<T, true> : decode_kernel<T, false>;
  set_dynamic_smem(kernel, bytes);
  kernel<<<static_cast<unsigned>(bh * splits), THREADS, bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_prefill(Params<T> p, int64_t B, bool gvec, cudaStream_t stream) {
  TORCH_CHECK(B * p.T <= INT_MAX, "kv_cache_attention: B * T = ", B * p.T, " exceeds the CUDA grid");
  auto scatter = gvec ? scatter_kernel<T, true> : scatter_kernel<T, false>;
  scatter<<<static_cast<unsigned>(B * p.T), SCATTER_THREADS, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  int threads = THREADS, bytes = 0;
  void (*kernel)(const Params<T>);
  if constexpr (std::is_same_v<T, float>) {
    p.dp = align_up(p.D, VEC<T>);
    p.bn = kv_tile(p.dp * static_cast<int>(sizeof(T)));
    p.rows = simt_rows<T>(std::min(p.T, MAX_ROWS_PER_PASS), p.bn, p.dp);
    bytes = SimtSmem<T>(0, p.rows, p.bn, p.dp).bytes;
    kernel = gvec ? prefill_simt_kernel<T, true> : prefill_simt_kernel<T, false>;
  } else {
    p.dp = align_up(p.D, 16);
    // 32 x 32 tiles for large heads, and on GPUs with less shared memory per block (sm_86 / sm_89:
    // 99 KiB, under the 111 KiB of 64 x 64 tiles at D = 128).
    const bool large = p.dp > TC_LARGE_HEAD_DIM ||
                       TcSmem<T>(0, 64, 64, p.dp).bytes + static_smem(prefill_tc_kernel<T, true>) >
                           device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
    p.rows = large ? 32 : 64;
    p.bn = large ? 32 : 64;
    threads = TC_THREADS;
    bytes = TcSmem<T>(0, p.rows, p.bn, p.dp).bytes;
    kernel = gvec ? prefill_tc_kernel<T, true> : prefill_tc_kernel<T, false>;
  }
  const int64_t blocks = ceil_div64(p.T, p.rows) * p.Hq * B;
  TORCH_CHECK(blocks <= INT_MAX, "kv_cache_attention: ", blocks, " query tiles exceed the CUDA grid");
  set_dynamic_smem(kernel, bytes);
  kernel<<<static_cast<unsigned>(blocks), threads, bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// q [B, Hq, T, D], k / v [B, Hkv, T, D] (head dim contiguous); k_cache / v_cache [B, Hkv, S, D]
// contiguous, written in place; positions [B, T] int64 -> out [B, Hq, T, D] contiguous.
// No host synchronisation: position values are never read on the host, so the op is capturable;
// out-of-range positions are treated as padding by the kernels.
at::Tensor kv_cache_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions,
                                   double scale) {
  constexpr const char* op = "kv_cache_attention";
  check_kv_cache_attention_inputs(q, k, v, k_cache, v_cache, positions);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k_cache.size(2);
  TORCH_CHECK(S <= MAX_SLOTS, op, ": cache length S = ", S, " exceeds ", MAX_SLOTS);
  TORCH_CHECK(Hq <= INT_MAX && T <= INT_MAX, op, ": Hq and T must fit in int32");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(q.scalar_type(), "kv_cache_attention_cuda", [&] {
    Params<scalar_t> p{};
    p.q = q.data_ptr<scalar_t>();
    p.k = k.data_ptr<scalar_t>();
    p.v = v.data_ptr<scalar_t>();
    p.k_cache = k_cache.data_ptr<scalar_t>();
    p.v_cache = v_cache.data_ptr<scalar_t>();
    p.positions = positions.data_ptr<int64_t>();
    p.out = out.data_ptr<scalar_t>();
    p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_st = q.stride(2);
    p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_st = k.stride(2);
    p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_st = v.stride(2);
    p.Hq = static_cast<int>(Hq), p.Hkv = static_cast<int>(Hkv), p.G = static_cast<int>(Hq / Hkv);
    p.T = static_cast<int>(T), p.S = static_cast<int>(S), p.D = static_cast<int>(D);
    p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
    // 16-byte global vectors need aligned rows: every base pointer and row stride a multiple of them.
    const int64_t vec = VEC<scalar_t>;
    bool gvec = D % vec == 0;
    for (const at::Tensor* x : {&q, &k, &v}) {
      gvec = gvec && aligned16(x->data_ptr()) && x->stride(0) % vec == 0 && x->stride(1) % vec == 0 &&
             x->stride(2) % vec == 0;
    }
    gvec = gvec && aligned16(k_cache.data_ptr()) && aligned16(v_cache.data_ptr());
    if (T <= DECODE_MAX_T) {
      launch_decode<scalar_t>(p, B, q, gvec, stream);
    } else {
      launch_prefill<scalar_t>(p, B, gvec, stream);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("kv_cache_attention", &kv_cache_attention_cuda);
}

}  // namespace gptfast_kernels
