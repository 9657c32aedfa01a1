// kv_cache_attention CUDA, decode / verification (T <= DECODE_MAX_T): one split-KV launch with
// the scatter fused and the splits merged by the last block (see kv_cache_attention.cuh).
#include "kv_cache_attention.cuh"

namespace gptfast_kernels {
namespace kv_attention {
namespace {

// True when no later token of the row writes the same slot: with repeated positions (possible
// only under capture, where they are not checked) the last token wins, as on the CPU, and a slot
// never gets two concurrent writers.
__device__ __forceinline__ bool last_writer(const int* row_pos, int T, int t) {
  for (int later = t + 1; later < T; ++later)
    if (row_pos[later] == row_pos[t]) return false;
  return true;
}

// K/V rows of a decode block: a position written by this launch is read from k / v (src[j] = the
// token writing it), any other from the cache (its slot: slot_of). With values in the keys v_new /
// v_cache are k_new / k_cache, so a new token's value is its k row too.
template <typename T, bool RING>
struct DecodeKv {
  const T *k_new, *v_new;  // k / v of this (b, kv head); + t * stride
  int64_t k_st, v_st;
  const T *k_cache, *v_cache;  // caches of this (b, kv head)
  const int* new_pos;          // [T] sanitised positions (shared memory; rebased with ring)
  int* src;                    // [bn] shared memory
  int T_, D;
  [[no_unique_address]] SlotOf<RING> slot_of;  // empty without ring
  __device__ void prepare(int tile, int n) const {
    if (static_cast<int>(threadIdx.x) < n) {
      const int slot = tile + static_cast<int>(threadIdx.x);
      int found = -1;  // with repeated positions (only possible under capture) the last token wins
      for (int t = 0; t < T_; ++t)
        if (new_pos[t] == slot) found = t;
      src[threadIdx.x] = found;
    }
  }
  __device__ const T* k_row(int x, int j) const {
    return src[j] >= 0 ? k_new + src[j] * k_st : k_cache + static_cast<int64_t>(slot_of(x)) * D;
  }
  __device__ const T* v_row(int x, int j) const {
    return src[j] >= 0 ? v_new + src[j] * v_st : v_cache + static_cast<int64_t>(slot_of(x)) * D;
  }
};

// VIK: values in the keys (v / v_cache alias k / k_cache; V rows, partials and outputs Dv wide).
template <typename T, bool GVEC, bool RING, bool VIK>
__global__ void __launch_bounds__(THREADS, SIMT_MIN_BLOCKS) decode_kernel(const Params<T> p) {
  constexpr int V = VEC<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int new_pos[DECODE_MAX_T];
  __shared__ float split_weight[WARPS][MAX_SPLITS];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  const int split = static_cast<int>(blockIdx.x % p.splits);
  const int64_t bh = blockIdx.x / p.splits, b = bh / p.Hkv;
  const int h = static_cast<int>(bh % p.Hkv), GT = p.G * p.T, D = p.D, Dv = VIK ? p.Dv : D;
  // Query row rr = g * T + t of the group is (q head h * G + g, token t).
  auto group_out = [&](int rr) { return out_row<VIK>(p, b, h * p.G + rr / p.T, rr % p.T); };
  if (tid < p.T) new_pos[tid] = sanitize<RING>(p.positions[b * p.T + tid], p.S);
  __syncthreads();
  // The positions [first, len) any query of the row reads (with a sliding window or chunks, not from 0;
  // with ring rebased to start at 0, at most S of them, on distinct slots). Every block of the row
  // derives the same partition of them, so exactly one owns each slot; the new tokens' own
  // positions lie inside.
  int2 span = slot_span(p.T, [&](int t) { return new_pos[t]; }, p.score);
  const SlotOf<RING> slot_of = rebase_span<RING>(new_pos, p.T, span, p.S);
  const int first = span.x, len = span.y;
  const int split_len = max(MIN_SPLIT_SLOTS, align_up(ceil_div(len - first, p.splits), p.bn));
  const int active = ceil_div(len - first, split_len);
  if (split >= active) {
    if (split == 0) {  // len == 0: every query of the row is padding
      for (int i = tid; i < GT * Dv; i += THREADS) group_out(i / Dv)[i % Dv] = T(0.f);
    }
    return;
  }
  const int lo = first + split * split_len, hi = min(lo + split_len, len);
  const T* k_new = p.k + b * p.k_sb + h * p.k_sh;
  const T* v_new = p.v + b * p.v_sb + h * p.v_sh;
  T* k_cache = p.k_cache + bh * p.S * static_cast<int64_t>(D);
  T* v_cache = p.v_cache + bh * p.S * static_cast<int64_t>(D);

  // Fused scatter of the new rows whose positions this block owns (its reads of them use k / v).
  const int dvec = ceil_div(D, V);
  for (int i = tid; i < p.T * dvec; i += THREADS) {
    const int t = i / dvec, c = i % dvec, x = new_pos[t];
    if (x >= lo && x < hi && last_writer(new_pos, p.T, t)) {
      const int64_t slot = slot_of(x);
      copy_vec<T, GVEC>(k_cache + slot * D, k_new + t * p.k_st, c, D);
      if constexpr (!VIK) copy_vec<T, GVEC>(v_cache + slot * D, v_new + t * p.v_st, c, D);
    }
  }

  const SimtSmem<T> sm(reinterpret_cast<uintptr_t>(smem), p.rows, p.bn, p.dp, value_row<VIK>(p));
  const DecodeKv<T, RING> kv{k_new, v_new, p.k_st, p.v_st, k_cache, v_cache, new_pos, sm.src, p.T, D, slot_of};
  const int64_t ws_row0 = (bh * p.splits + split) * GT;  // this split's partials (active > 1 only)
  for (int r0 = 0; r0 < GT; r0 += p.rows) {  // passes of at most p.rows query rows
    const int rows = min(p.rows, GT - r0);
    simt_init_rows<T, GVEC>(
        sm, rows, p.dp, D, value_row<VIK>(p),
        [&](int r) { return p.q + b * p.q_sb + (h * p.G + (r0 + r) / p.T) * p.q_sh + ((r0 + r) % p.T) * p.q_st; },
        [&](int r) { return new_pos[(r0 + r) % p.T]; });
    if (p.sinks != nullptr && active == 1) {  // with several splits the merge adds the sink, once
      simt_seed_sinks(sm, rows, [&](int r) { return p.sinks[h * p.G + (r0 + r) / p.T] * LOG2E; });
    }
    if (p.alibi_slopes != nullptr) {
      simt_seed_alibi(sm, rows, [&](int r) { return p.alibi_slopes[h * p.G + (r0 + r) / p.T] * LOG2E; });
    }
    simt_attend<T, GVEC>(sm, rows, p.bn, p.dp, D, value_row<VIK>(p), Dv, lo, hi, p.score, kv);
    for (int i = tid; i < rows * Dv; i += THREADS) {
      const int r = i / Dv, d = i % Dv;
      const float l = sm.l[r], o = l > 0.f ? sm.acc[r * value_row<VIK>(p) + d] / l : 0.f;
      if (active == 1) {
        group_out(r0 + r)[d] = T(o);
      } else {
        p.ws_o[(ws_row0 + r0 + r) * Dv + d] = o;
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
  const float* part = p.ws_o + bh * p.splits * GT * static_cast<int64_t>(Dv);  // [splits][GT][Dv]
  float* w = split_weight[warp];
  for (int rr = warp; rr < GT; rr += WARPS) {
    float mx = -INFINITY;
    for (int s = lane; s < active; s += WARP) mx = fmaxf(mx, __ldcg(lse + s * GT + rr));
    // the attention sink: one more term of the denominator, with no value
    const float sink = p.sinks != nullptr ? p.sinks[h * p.G + rr / p.T] * LOG2E : -INFINITY;
    mx = fmaxf(warp_max(mx), sink);
    float total = 0.f;
    for (int s = lane; s < active; s += WARP) {
      w[s] = mx == -INFINITY ? 0.f : exp2f(__ldcg(lse + s * GT + rr) - mx);
      total += w[s];
    }
    total = warp_sum(total) + (sink == -INFINITY ? 0.f : exp2f(sink - mx));
    __syncwarp();
    const float inv = total > 0.f ? 1.f / total : 0.f;  // every split empty: padding, zero output
    for (int d = lane; d < Dv; d += WARP) {
      float acc = 0.f;
      for (int s = 0; s < active; ++s)
        acc = fmaf(w[s], __ldcg(part + (static_cast<int64_t>(s) * GT + rr) * Dv + d), acc);
      group_out(rr)[d] = T(acc * inv);
    }
    __syncwarp();  // w is rewritten for this warp's next row
  }
}

// ------------------------------------------------------------------------------------- launch

// Split tickets, zeroed for each launch (a memset, a node of its own in a CUDA graph). A buffer
// kept across launches would save the memset, but an allocation that outlives the call breaks
// torch.compile's CUDA graph trees: their warm-up runs allocate from the graph's private pool and
// refuse any allocation still alive that is not an output.
at::Tensor split_counters(const at::Tensor& like, int64_t n) {
  return at::zeros({n}, like.options().dtype(at::kInt));
}

}  // namespace

template <typename T>
void launch_decode(Params<T> p, int64_t B, const at::Tensor& q, bool gvec, bool ring, bool values_in_keys,
                   cudaStream_t stream) {
  p.dp = align_up(p.D, VEC<T>);
  p.dvp = align_up(p.Dv, VEC<T>);
  p.bn = kv_tile(p.dp * static_cast<int>(sizeof(T)));  // K rows are the wider (Dv <= D)
  const int64_t GT = static_cast<int64_t>(p.G) * p.T, bh = B * p.Hkv;
  const auto kernel = pick_kernel(gvec, ring, values_in_keys, [](auto g, auto r, auto v) {
    return decode_kernel<T, decltype(g)::value, decltype(r)::value, decltype(v)::value>;
  });
  p.rows = simt_rows<T>(kernel, static_cast<int>(std::min<int64_t>(GT, MAX_ROWS_PER_PASS)), p.bn, p.dp, p.dvp);
  // Splits from host-known sizes only (a CUDA graph replays them for any positions). With ring a
  // row's span is at most S positions too (window or chunk + T - 1 <= S; cut to S on the device).
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  int64_t splits = ceil_div64(static_cast<int64_t>(DECODE_BLOCKS_PER_SM) * sms, bh);
  splits = std::min({splits, ceil_div64(p.S, MIN_SPLIT_SLOTS), static_cast<int64_t>(MAX_SPLITS),
                     WORKSPACE_BUDGET_BYTES / (bh * GT * p.Dv * static_cast<int64_t>(sizeof(float)))});
  splits = std::max<int64_t>(splits, 1);
  TORCH_CHECK(bh * splits <= INT_MAX, "kv_cache_attention: B * Hkv = ", bh, " exceeds the CUDA grid");
  p.splits = static_cast<int>(splits);
  at::Tensor ws_o, ws_lse, counters;
  if (splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    ws_o = at::empty({bh * splits * GT * p.Dv}, f32);
    ws_lse = at::empty({bh * splits * GT}, f32);
    counters = split_counters(q, bh);
    p.ws_o = ws_o.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.counters = counters.data_ptr<int>();
  }
  const int bytes = SimtSmem<T>(0, p.rows, p.bn, p.dp, p.dvp).bytes;
  set_dynamic_smem(kernel, bytes);
  kernel<<<static_cast<unsigned>(bh * splits), THREADS, bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_decode<float>(Params<float>, int64_t, const at::Tensor&, bool, bool, bool, cudaStream_t);
template void launch_decode<c10::Half>(Params<c10::Half>, int64_t, const at::Tensor&, bool, bool, bool, cudaStream_t);
template void launch_decode<c10::BFloat16>(Params<c10::BFloat16>, int64_t, const at::Tensor&, bool, bool, bool,
                                           cudaStream_t);

}  // namespace kv_attention
}  // namespace gptfast_kernels
