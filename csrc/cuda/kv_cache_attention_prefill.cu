// kv_cache_attention CUDA, prefill (T > DECODE_MAX_T): a scatter kernel, then a tiled kernel over
// query tiles reading the cache: WMMA tensor cores for fp16 / bf16, the SIMT engine for fp32.
#include "kv_cache_attention.cuh"

namespace gptfast_kernels {
namespace kv_attention {
namespace {

// K/V rows of a prefill block: the cache, already scattered by scatter_kernel (v_cache is k_cache
// with values in the keys).
template <typename T, bool RING>
struct CacheKv {
  const T *k_cache, *v_cache;
  int D;
  [[no_unique_address]] SlotOf<RING> slot_of;  // empty without ring
  __device__ void prepare(int, int) const {}
  __device__ const T* k_row(int x, int) const {
    if constexpr (RING) x = slot_of(x);
    return k_cache + static_cast<int64_t>(x) * D;
  }
  __device__ const T* v_row(int x, int) const {
    if constexpr (RING) x = slot_of(x);
    return v_cache + static_cast<int64_t>(x) * D;
  }
};

// Cache slot of token i of positions (flattened [B, T]), -1 for padding: its position, or with
// ring its position % S.
template <typename T, bool RING>
__device__ __forceinline__ int scatter_slot(const Params<T>& p, int64_t i) {
  const int pos = sanitize<RING>(p.positions[i], p.S);
  if constexpr (RING) {
    return pos >= 0 ? pos % p.S : -1;
  } else {
    return pos;
  }
}

// k / v [b, :, t] -> caches [b, :, slot of positions[b, t]]; one block per (b, t). VIK (values in
// the keys): k alone.
template <typename T, bool GVEC, bool RING, bool VIK>
__global__ void __launch_bounds__(SCATTER_THREADS) scatter_kernel(const Params<T> p) {
  const int64_t bt = blockIdx.x, b = bt / p.T, t = bt % p.T;
  const int slot = scatter_slot<T, RING>(p, bt);
  // A later token of the row with the same slot wins (see last_writer); the block scans them together.
  // With ring, distinct positions share a slot only when the caller's span contract is violated:
  // comparing slots still leaves every slot one writer.
  bool overwritten = false;
  for (int64_t later = t + 1 + threadIdx.x; later < p.T && slot >= 0; later += SCATTER_THREADS)
    overwritten = overwritten || scatter_slot<T, RING>(p, b * p.T + later) == slot;
  if (__syncthreads_or(overwritten) || slot < 0) return;
  const int dvec = ceil_div(p.D, VEC<T>);
  for (int i = threadIdx.x; i < p.Hkv * dvec; i += SCATTER_THREADS) {
    const int h = i / dvec, c = i % dvec;
    const int64_t dst = ((b * p.Hkv + h) * p.S + slot) * static_cast<int64_t>(p.D);
    copy_vec<T, GVEC>(p.k_cache + dst, p.k + b * p.k_sb + h * p.k_sh + t * p.k_st, c, p.D);
    if constexpr (!VIK) copy_vec<T, GVEC>(p.v_cache + dst, p.v + b * p.v_sb + h * p.v_sh + t * p.v_st, c, p.D);
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

// VIK (values in the keys, here and in prefill_tc_kernel): V rows and outputs Dv wide.
template <typename T, bool GVEC, bool RING, bool VIK>
__global__ void __launch_bounds__(THREADS, SIMT_MIN_BLOCKS) prefill_simt_kernel(const Params<T> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const PrefillTile tl = prefill_tile(p);
  const SimtSmem<T> sm(reinterpret_cast<uintptr_t>(smem), p.rows, p.bn, p.dp, value_row<VIK>(p));
  simt_init_rows<T, GVEC>(
      sm, tl.rows, p.dp, p.D, value_row<VIK>(p),
      [&](int r) { return p.q + tl.b * p.q_sb + tl.qh * p.q_sh + (tl.t0 + r) * p.q_st; },
      [&](int r) { return sanitize<RING>(p.positions[tl.b * p.T + tl.t0 + r], p.S); });
  if (p.sinks != nullptr) simt_seed_sinks(sm, tl.rows, [&](int) { return p.sinks[tl.qh] * LOG2E; });
  if (p.alibi_slopes != nullptr) simt_seed_alibi(sm, tl.rows, [&](int) { return p.alibi_slopes[tl.qh] * LOG2E; });
  int2 span = slot_span(tl.rows, [&](int r) { return sm.pos[r]; }, p.score);  // the keys the tile sees
  const SlotOf<RING> slot_of = rebase_span<RING>(sm.pos, tl.rows, span, p.S);
  const int64_t kv_off = (tl.b * p.Hkv + tl.qh / p.G) * p.S * static_cast<int64_t>(p.D);
  const CacheKv<T, RING> kv{p.k_cache + kv_off, p.v_cache + kv_off, p.D, slot_of};
  simt_attend<T, GVEC>(sm, tl.rows, p.bn, p.dp, p.D, value_row<VIK>(p), value_width<VIK>(p), span.x, span.y, p.score,
                       kv);
  for (int i = threadIdx.x; i < tl.rows * value_width<VIK>(p); i += THREADS) {
    const int r = i / value_width<VIK>(p), d = i % value_width<VIK>(p);
    const float l = sm.l[r];
    out_row<VIK>(p, tl.b, tl.qh, tl.t0 + r)[d] = T(l > 0.f ? sm.acc[r * value_row<VIK>(p) + d] / l : 0.f);
  }
}

template <typename T>
struct TcSmem {
  int ldq, ldv, lds, ldp, ldo;  // leading dims (elements); every 16-row / 16-column tile stays 32-byte aligned
  T *q, *k, *v;  // q [bm][ldq], k [bn][ldq], v [bn][ldv]; zero past D (Dv: see load_vec), the tile's rows, the slots
  float* s;      // scores [bm][lds]
  T* p;          // probabilities [bm][ldp]
  float *o, *m, *l;  // output accumulator [bm][ldo], softmax state [bm]
  int* pos;          // [bm]
  int bytes;
  __host__ __device__ TcSmem(uintptr_t base, int bm, int bn, int dp, int dvp)
      : ldq(dp + TC_PAD), ldv(dvp + TC_PAD), lds(bn + TC_ACC_PAD), ldp(bn + TC_PAD), ldo(dvp + TC_ACC_PAD) {
    SmemCarver c{base};
    q = c.take<T>(bm * ldq), k = c.take<T>(bn * ldq), v = c.take<T>(bn * ldv);
    s = c.take<float>(bm * lds), p = c.take<T>(bm * ldp), o = c.take<float>(bm * ldo);
    m = c.take<float>(bm), l = c.take<float>(bm), pos = c.take<int>(bm);
    bytes = c.bytes;
  }
};

// fp16 / bf16 prefill on tensor cores: S = Q K^T and O += P V with 16x16x16 WMMA, fp32 accumulators;
// the online softmax runs on the fp32 score tile in shared memory, P is rounded to q's dtype.
template <typename T, bool GVEC, bool RING, bool VIK>
__global__ void __launch_bounds__(TC_THREADS) prefill_tc_kernel(const Params<T> p) {
  using namespace nvcuda;
  using mma_t = typename MmaType<T>::type;
  constexpr int V = VEC<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const PrefillTile tl = prefill_tile(p);
  const int bm = p.rows, bn = p.bn, dp = p.dp, D = p.D, dvp = VIK ? p.dvp : dp, Dv = VIK ? p.Dv : D;
  const TcSmem<T> sm(reinterpret_cast<uintptr_t>(smem), bm, bn, dp, dvp);
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, nvec = dp / V, nvec_v = dvp / V;
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
  for (int i = tid; i < bm * dvp; i += TC_THREADS) sm.o[(i / dvp) * sm.ldo + i % dvp] = 0.f;
  for (int r = tid; r < bm; r += TC_THREADS) {
    sm.pos[r] = r < tl.rows ? sanitize<RING>(p.positions[tl.b * p.T + tl.t0 + r], p.S) : -1;
    const bool sink = p.sinks != nullptr && r < tl.rows;  // a first slot of score sink and value 0
    sm.m[r] = sink ? p.sinks[tl.qh] * LOG2E : -INFINITY;
    sm.l[r] = sink ? 1.f : 0.f;
  }
  async_wait();
  __syncthreads();
  int2 span = slot_span(tl.rows, [&](int r) { return sm.pos[r]; }, p.score);  // the keys the tile sees
  // With ring the tile's positions may wrap around the end of the ring: each row's slot on its own.
  const SlotOf<RING> slot_of = rebase_span<RING>(sm.pos, tl.rows, span, p.S);
  const int64_t kv_off = (tl.b * p.Hkv + tl.qh / p.G) * p.S * static_cast<int64_t>(D);
  const T* k_cache = p.k_cache + kv_off;
  const T* v_cache = p.v_cache + kv_off;
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[tl.qh] * LOG2E : 0.f;  // ALiBi (every row's head)

  for (int tile = span.x; tile < span.y; tile += bn) {
    const int n = min(bn, span.y - tile);
    // Vector c of K row j, and of its V row while c < nvec_v (always without VIK: V rows are K's width).
    for (int i = tid; i < bn * nvec; i += TC_THREADS) {
      const int j = i / nvec, c = i % nvec;
      const bool has_v = !VIK || c < nvec_v;
      if (j < n) {  // rows past n are zeros: P is 0 there, and 0 * garbage could be NaN
        load_vec<T, GVEC>(sm.k + j * sm.ldq, k_cache + static_cast<int64_t>(slot_of(tile + j)) * D, c, D);
        if (has_v) load_vec<T, GVEC>(sm.v + j * sm.ldv, v_cache + static_cast<int64_t>(slot_of(tile + j)) * D, c, Dv);
      } else {
        *reinterpret_cast<uint4*>(sm.k + j * sm.ldq + c * V) = zero;
        if (has_v) *reinterpret_cast<uint4*>(sm.v + j * sm.ldv + c * V) = zero;
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
      // slots [skipped, seen) of the tile are the row's (none for padding rows)
      const int seen = min(n, sm.pos[r] - tile + 1), skipped = max(0, p.score.first_slot(sm.pos[r]) - tile);
      const int pos = sm.pos[r];
      const float s0 = lane >= skipped && lane < seen ? p.score.biased(sr[lane], slope, tile + lane, pos) : -INFINITY;
      const float s1 = lane + WARP >= skipped && lane + WARP < seen
                           ? p.score.biased(sr[lane + WARP], slope, tile + lane + WARP, pos)
                           : -INFINITY;
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      // P is rounded to T for the tensor cores, and l sums the rounded values: the output is then a
      // weighted mean of V whose weights' rounding largely cancels in the ratio (as in the Triton kernel)
      const T e0 = T(exp2f(s0 - m_use)), e1 = T(exp2f(s1 - m_use));
      T* pr = sm.p + r * sm.ldp;
      if (lane < bn) pr[lane] = e0;
      if (lane + WARP < bn) pr[lane + WARP] = e1;
      const float sum = warp_sum(static_cast<float>(e0) + static_cast<float>(e1));
      const float alpha = exp2f(m_old - m_use);
      for (int d = lane; d < dvp; d += WARP) sm.o[r * sm.ldo + d] *= alpha;
      __syncwarp();  // every lane has read sm.m[r] (as in simt_attend)
      if (lane == 0) {
        sm.l[r] = fmaf(sm.l[r], alpha, sum);
        sm.m[r] = m_new;
      }
    }
    __syncthreads();
    for (int f = warp; f < (bm / 16) * (dvp / 16); f += TC_WARPS) {
      const int i = f / (dvp / 16), dt = f % (dvp / 16);
      float* o_tile = sm.o + 16 * i * sm.ldo + 16 * dt;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_tile, sm.ldo, wmma::mem_row_major);
      for (int kk = 0; kk < n16; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::row_major> bv;
        wmma::load_matrix_sync(a, reinterpret_cast<const mma_t*>(sm.p + 16 * i * sm.ldp + kk), sm.ldp);
        wmma::load_matrix_sync(bv, reinterpret_cast<const mma_t*>(sm.v + kk * sm.ldv + 16 * dt), sm.ldv);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(o_tile, acc, sm.ldo, wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int i = tid; i < tl.rows * Dv; i += TC_THREADS) {
    const int r = i / Dv, d = i % Dv;
    const float l = sm.l[r];
    out_row<VIK>(p, tl.b, tl.qh, tl.t0 + r)[d] = T(l > 0.f ? sm.o[r * sm.ldo + d] / l : 0.f);
  }
}

// The WMMA prefill's tile for head dim D, rows of dp elements (V rows of dvp): the first of TC_TILES
// that fits the device's shared memory per block, 64 x 64 only up to TC_LARGE_HEAD_DIM.
template <typename T>
TcTile tc_tile(int D, int dp, int dvp) {
  const int limit =
      device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin) - static_smem(prefill_tc_kernel<T, true, false, false>);
  for (const TcTile& tile : TC_TILES) {
    const bool allowed = tile.rows < 64 || dp <= TC_LARGE_HEAD_DIM;
    if (allowed && TcSmem<T>(0, tile.rows, tile.slots, dp, dvp).bytes <= limit) return tile;
  }
  const TcTile& smallest = TC_TILES[std::size(TC_TILES) - 1];
  TORCH_CHECK(false, "kv_cache_attention: no prefill tile for head dim D = ", D, " fits the device's ", limit,
              " bytes of shared memory per block (the smallest, ", smallest.rows, " x ", smallest.slots, ", needs ",
              TcSmem<T>(0, smallest.rows, smallest.slots, dp, dvp).bytes, ")");
}

}  // namespace

template <typename T>
void launch_prefill(Params<T> p, int64_t B, bool gvec, bool ring, bool values_in_keys, cudaStream_t stream) {
  TORCH_CHECK(B * p.T <= INT_MAX, "kv_cache_attention: B * T = ", B * p.T, " exceeds the CUDA grid");
  const auto scatter = pick_kernel(gvec, ring, values_in_keys, [](auto g, auto r, auto v) {
    return scatter_kernel<T, decltype(g)::value, decltype(r)::value, decltype(v)::value>;
  });
  scatter<<<static_cast<unsigned>(B * p.T), SCATTER_THREADS, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  int threads = THREADS, bytes = 0;
  void (*kernel)(const Params<T>);
  if constexpr (std::is_same_v<T, float>) {
    p.dp = align_up(p.D, VEC<T>);
    p.dvp = align_up(p.Dv, VEC<T>);
    p.bn = kv_tile(p.dp * static_cast<int>(sizeof(T)));
    kernel = pick_kernel(gvec, ring, values_in_keys, [](auto g, auto r, auto v) {
      return prefill_simt_kernel<T, decltype(g)::value, decltype(r)::value, decltype(v)::value>;
    });
    p.rows = simt_rows<T>(kernel, std::min(p.T, MAX_ROWS_PER_PASS), p.bn, p.dp, p.dvp);
    bytes = SimtSmem<T>(0, p.rows, p.bn, p.dp, p.dvp).bytes;
  } else {
    p.dp = align_up(p.D, 16);
    p.dvp = align_up(p.Dv, 16);
    const TcTile tile = tc_tile<T>(p.D, p.dp, p.dvp);
    p.rows = tile.rows;
    p.bn = tile.slots;
    threads = TC_THREADS;
    bytes = TcSmem<T>(0, p.rows, p.bn, p.dp, p.dvp).bytes;
    kernel = pick_kernel(gvec, ring, values_in_keys, [](auto g, auto r, auto v) {
      return prefill_tc_kernel<T, decltype(g)::value, decltype(r)::value, decltype(v)::value>;
    });
  }
  const int64_t blocks = ceil_div64(p.T, p.rows) * p.Hq * B;
  TORCH_CHECK(blocks <= INT_MAX, "kv_cache_attention: ", blocks, " query tiles exceed the CUDA grid");
  set_dynamic_smem(kernel, bytes);
  kernel<<<static_cast<unsigned>(blocks), threads, bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_prefill<float>(Params<float>, int64_t, bool, bool, bool, cudaStream_t);
template void launch_prefill<c10::Half>(Params<c10::Half>, int64_t, bool, bool, bool, cudaStream_t);
template void launch_prefill<c10::BFloat16>(Params<c10::BFloat16>, int64_t, bool, bool, bool, cudaStream_t);

}  // namespace kv_attention
}  // namespace gptfast_kernels
