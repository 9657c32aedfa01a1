// verify_draft CUDA kernels.
//
// Sampling (one thread block per batch row): warp 0 tests up to 32 drafts at a time (reading
// only p = target[b, i, t_i] and q = draft[b, i, t_i]) and a ballot finds the first rejection n.
// The block then makes one pass over the row at n (max(0, target - draft), or target when all k
// were accepted or the residual is all zero): each warp sums one of WARPS contiguous segments,
// giving the total and the segment where the running sum passes u * total. The inverse-CDF scan
// (block prefix scan per chunk of SCAN_CHUNK elements) starts at that segment, so it reads about
// 1 / WARPS of the row again instead of everything before the sampled index.
// Greedy (two launches): the argmax of every position of every row at once, each row split into
// chunks across blocks so that even B = 1 spreads over the whole GPU (one block streaming a row,
// position after position, reads at one SM's rate: ~20 GB/s, 25 us a 128k-entry row on an H200);
// then one warp per batch row merges its chunks' (value, index) pairs position by position and
// stops at the first draft that differs. Rows past a row's first mismatch are read for nothing:
// bandwidth the single-block walk saved, traded for the parallelism it lacked.
// Rows whose length is a multiple of 4 (and 16-byte aligned) are read as float4: with UNROLL
// loads per thread in flight, a block keeps ~32 KiB of a row in flight from its SM.
// The vocabulary is streamed in strided / chunked tiles, never held whole in registers. All sums
// are float32. No host synchronisation; the accept counts are written on the device.
// A draft token outside [0, V) (the wrapper rejects them in eager mode) is never used as an index:
// sampling treats it as rejected, greedy as a mismatch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>

#include "cuda_common.cuh"

namespace gptfast_kernels {
namespace {

// Sampling: one block per row; 16 warps keep enough loads in flight to stream a 128k-entry row
// from one SM, and B = 64 rows fill about half of an H100's 132 SMs (the issue's target shape).
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
// Strided loads issued back to back per thread in the sum / argmax passes (memory-level parallelism).
constexpr int UNROLL = 4;
// Greedy: chunk-argmax blocks per SM wanted, and the shortest chunk (one unrolled float4 trip of a
// block: shorter ones would spend more on the block's reduction than on loads).
constexpr int64_t GREEDY_BLOCKS_PER_SM = 2;
constexpr int64_t GREEDY_MIN_CHUNK = static_cast<int64_t>(THREADS) * 4 * UNROLL;
// Consecutive elements per thread per scan chunk; a chunk (2048 entries) costs a few barriers.
constexpr int SCAN_ITEMS = 4;
constexpr int64_t SCAN_CHUNK = static_cast<int64_t>(THREADS) * SCAN_ITEMS;

// Sampling weights: max(0, target - draft), or the target row when draft is null.
__device__ __forceinline__ float weight(const float* __restrict__ t, const float* __restrict__ d,
                                        int64_t j) {
  return d != nullptr ? fmaxf(t[j] - d[j], 0.f) : t[j];
}

__device__ long long block_min(long long v, long long* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  long long result = LLONG_MAX;
  for (int w = 0; w < WARPS; ++w) result = min(result, scratch[w]);
  return result;
}

// (value, index) that wins an argmax, as torch.argmax: NaN above every number, then the larger
// value, the smaller index on ties. A total order, so every thread of a block merges to the same
// winner even with NaN inputs (reachable under capture, where inputs are not checked).
__device__ __forceinline__ void argmax_merge(float& best, long long& idx, float v, long long j) {
  const bool v_nan = isnan(v), best_nan = isnan(best);
  const bool wins = v_nan != best_nan ? v_nan : (v > best || (v == best && j < idx) || (v_nan && j < idx));
  if (idx == LLONG_MAX || wins) {
    best = v;
    idx = j;
  }
}

// Merges the (value, index) pairs of a warp's lanes; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(float& best, long long& idx) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    argmax_merge(best, idx, __shfl_xor_sync(FULL_MASK, best, offset), __shfl_xor_sync(FULL_MASK, idx, offset));
  }
}

// The maximum of row[begin, end) and its first index (begin < end), returned to every thread.
// vec4: begin and end are multiples of 4 and row is 16-byte aligned.
__device__ void block_argmax(const float* __restrict__ row, int64_t begin, int64_t end, bool vec4,
                             float* scratch_f, long long* scratch_i, float& best, long long& idx) {
  best = -INFINITY;
  idx = LLONG_MAX;
  if (vec4) {  // argmax_merge is order-free, so the unrolled loads may merge in any order
    constexpr int64_t STEP = static_cast<int64_t>(THREADS) * 4;
    int64_t j = begin + static_cast<int64_t>(threadIdx.x) * 4;
    for (; j + (UNROLL - 1) * STEP < end; j += UNROLL * STEP) {
      float4 v[UNROLL];
#pragma unroll
      for (int r = 0; r < UNROLL; ++r) v[r] = __ldg(reinterpret_cast<const float4*>(row + j + r * STEP));
#pragma unroll
      for (int r = 0; r < UNROLL; ++r) {
        const int64_t at = j + r * STEP;
        argmax_merge(best, idx, v[r].x, at), argmax_merge(best, idx, v[r].y, at + 1);
        argmax_merge(best, idx, v[r].z, at + 2), argmax_merge(best, idx, v[r].w, at + 3);
      }
    }
    for (; j < end; j += STEP) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + j));
      argmax_merge(best, idx, v.x, j), argmax_merge(best, idx, v.y, j + 1);
      argmax_merge(best, idx, v.z, j + 2), argmax_merge(best, idx, v.w, j + 3);
    }
  } else {
    for (int64_t j = begin + threadIdx.x; j < end; j += THREADS) argmax_merge(best, idx, __ldg(row + j), j);
  }
  warp_argmax(best, idx);
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    scratch_f[threadIdx.x / 32] = best;
    scratch_i[threadIdx.x / 32] = idx;
  }
  __syncthreads();
  for (int w = 0; w < WARPS; ++w) argmax_merge(best, idx, scratch_f[w], scratch_i[w]);
}

// Entries j .. j + 3 of the weights (vec4 rows: j % 4 == 0, 16-byte aligned).
__device__ __forceinline__ float4 weight4(const float* __restrict__ t, const float* __restrict__ d,
                                          int64_t j) {
  const float4 tv = __ldg(reinterpret_cast<const float4*>(t + j));
  if (d == nullptr) return tv;
  const float4 dv = __ldg(reinterpret_cast<const float4*>(d + j));
  return make_float4(fmaxf(tv.x - dv.x, 0.f), fmaxf(tv.y - dv.y, 0.f), fmaxf(tv.z - dv.z, 0.f),
                     fmaxf(tv.w - dv.w, 0.f));
}

// Entries per segment: a multiple of 32 lanes x 4, so vec4 segments start 16-byte aligned.
__host__ __device__ __forceinline__ int64_t segment_length(int64_t V) {
  constexpr int64_t GRAIN = 32 * 4;
  return ((V + WARPS - 1) / WARPS + GRAIN - 1) / GRAIN * GRAIN;
}

// Warp w sums the weights of segment w, [w * seg, (w + 1) * seg) (segment_length), into
// seg_sums[w]; returns the row total, the same value in every thread (same order everywhere).
__device__ float segment_sums(const float* __restrict__ t, const float* __restrict__ d, int64_t V,
                              bool vec4, float* seg_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t seg = segment_length(V), begin = warp * seg, end = begin + seg < V ? begin + seg : V;
  float acc[UNROLL] = {};
  if (vec4) {  // V % 4 == 0, so j < end implies j + 3 < end
    constexpr int64_t STEP = 32 * 4;
    int64_t j = begin + lane * 4;
    for (; j + (UNROLL - 1) * STEP < end; j += UNROLL * STEP) {
      float4 w[UNROLL];
#pragma unroll
      for (int r = 0; r < UNROLL; ++r) w[r] = weight4(t, d, j + r * STEP);  // all loads first
#pragma unroll
      for (int r = 0; r < UNROLL; ++r) acc[r] += (w[r].x + w[r].y) + (w[r].z + w[r].w);
    }
    for (; j < end; j += STEP) {
      const float4 w = weight4(t, d, j);
      acc[0] += (w.x + w.y) + (w.z + w.w);
    }
  } else {
    int64_t j = begin + lane;
    for (; j + (UNROLL - 1) * 32 < end; j += UNROLL * 32) {
#pragma unroll
      for (int r = 0; r < UNROLL; ++r) acc[r] += weight(t, d, j + r * 32);
    }
    for (; j < end; j += 32) acc[0] += weight(t, d, j);
  }
  float local = 0.f;
#pragma unroll
  for (int r = 0; r < UNROLL; ++r) local += acc[r];
  local = warp_sum(local);
  __syncthreads();  // seg_sums may still be read by a previous pass
  if (lane == 0) seg_sums[warp] = local;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < WARPS; ++w) total += seg_sums[w];
  return total;
}

// The smallest j whose running sum exceeds u * total (and whose weight is non-zero, so float32
// rounding between chunks can never pick a zero-weight entry); if none, the last non-zero entry.
// The scan starts at the segment (segment_sums) where the running sum passes u * total; the sums
// before it are its carry. If float32 rounding puts no crossing there or after it, the fallback.
__device__ long long block_inverse_cdf(const float* __restrict__ t, const float* __restrict__ d,
                                       int64_t V, bool vec4, float total, float u,
                                       const float* seg_sums, float* scratch_f, long long* scratch_i) {
  static_assert(SCAN_ITEMS == 4, "vec4 scan chunks load one float4 per thread");
  const float threshold = u * total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float carry = 0.f;
  int64_t start = V;  // no segment passes the threshold: straight to the fallback
  for (int w = 0; w < WARPS; ++w) {  // the same in every thread
    if (carry + seg_sums[w] > threshold) {
      start = w * segment_length(V);
      break;
    }
    carry += seg_sums[w];
  }
  for (int64_t base = start; base < V; base += SCAN_CHUNK) {
    const int64_t j0 = base + static_cast<int64_t>(threadIdx.x) * SCAN_ITEMS;
    float vals[SCAN_ITEMS];
    float local = 0.f;
    if (vec4 && j0 < V) {  // start % 4 == 0 and V % 4 == 0: j0 .. j0 + 3 lie in the row
      const float4 w = weight4(t, d, j0);
      vals[0] = w.x, vals[1] = w.y, vals[2] = w.z, vals[3] = w.w;
    } else {
#pragma unroll
      for (int it = 0; it < SCAN_ITEMS; ++it) vals[it] = j0 + it < V ? weight(t, d, j0 + it) : 0.f;
    }
#pragma unroll
    for (int it = 0; it < SCAN_ITEMS; ++it) local += vals[it];
    float inclusive = local;  // warp inclusive scan
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float up = __shfl_up_sync(FULL_MASK, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    __syncthreads();
    if (lane == 31) scratch_f[warp] = inclusive;
    __syncthreads();
    float before = 0.f, chunk_total = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      if (w < warp) before += scratch_f[w];
      chunk_total += scratch_f[w];
    }
    float running = carry + before + (inclusive - local);
    long long candidate = LLONG_MAX;
#pragma unroll
    for (int it = 0; it < SCAN_ITEMS; ++it) {
      running += vals[it];
      if (candidate == LLONG_MAX && vals[it] > 0.f && running > threshold) candidate = j0 + it;
    }
    const long long found = block_min(candidate, scratch_i);
    if (found != LLONG_MAX) return found;
    carry += chunk_total;
  }
  long long last = -1;  // rounding fallback
  for (int64_t j = threadIdx.x; j < V; j += THREADS) {
    if (weight(t, d, j) > 0.f) last = j;
  }
  last = -block_min(-last, scratch_i);
  return last >= 0 ? last : V - 1;
}

__global__ void __launch_bounds__(THREADS)
    sampling_kernel(const float* __restrict__ target, const float* __restrict__ draft,
                    const int64_t* __restrict__ draft_tokens, const float* __restrict__ uniforms,
                    int64_t* __restrict__ out_tokens, int64_t* __restrict__ num_emitted, int64_t k,
                    int64_t V, bool vec4) {
  __shared__ float scratch_f[WARPS];
  __shared__ float seg_sums[WARPS];
  __shared__ long long scratch_i[WARPS];
  __shared__ long long first_rejection;
  const int64_t b = blockIdx.x;
  const int64_t K1 = k + 1;
  const float* t_rows = target + b * K1 * V;  // int64: B * (k + 1) * V passes 2^31 at B = 64, V = 256k
  const int64_t* ids = draft_tokens + b * k;
  const float* u = uniforms + b * K1;
  const float* d_rows = draft + b * k * V;
  if (threadIdx.x < 32) {
    long long rejected_at = k;
    for (int64_t i0 = 0; i0 < k; i0 += 32) {
      const int64_t i = i0 + threadIdx.x;
      bool reject = false;
      if (i < k) {
        const int64_t tok = ids[i];
        if (tok < 0 || tok >= V) {
          reject = true;
        } else {
          const float p = t_rows[i * V + tok], q = d_rows[i * V + tok];
          reject = !(q > 0.f && __fmul_rn(u[i], q) < p);
        }
      }
      const unsigned mask = __ballot_sync(FULL_MASK, reject);
      if (mask != 0u) {
        rejected_at = i0 + __ffs(mask) - 1;
        break;
      }
    }
    if (threadIdx.x == 0) first_rejection = rejected_at;
  }
  __syncthreads();
  const int64_t n = first_rejection;
  const float* t_row = t_rows + n * V;
  const float* d_row = n < k ? d_rows + n * V : nullptr;
  float total = segment_sums(t_row, d_row, V, vec4, seg_sums);
  if (d_row != nullptr && !(total > 0.f)) {  // all-zero residual: sample from the target row
    d_row = nullptr;
    total = segment_sums(t_row, nullptr, V, vec4, seg_sums);
  }
  const long long final_token =
      block_inverse_cdf(t_row, d_row, V, vec4, total, u[k], seg_sums, scratch_f, scratch_i);
  for (int64_t i = threadIdx.x; i < K1; i += THREADS) {
    out_tokens[b * K1 + i] = i < n ? ids[i] : (i == n ? final_token : -1);
  }
  if (threadIdx.x == 0) num_emitted[b] = n + 1;
}

// Greedy, first launch: block p = row * splits + s reduces chunk s ([s * chunk, (s + 1) * chunk)
// cut at V) of row `row` of target [B * (k + 1), V] to its (maximum, first index).
__global__ void __launch_bounds__(THREADS)
    greedy_chunk_argmax_kernel(const float* __restrict__ target, int64_t V, int64_t chunk, int64_t splits,
                               bool vec4, float* __restrict__ chunk_max, long long* __restrict__ chunk_idx) {
  __shared__ float scratch_f[WARPS];
  __shared__ long long scratch_i[WARPS];
  const int64_t p = blockIdx.x;
  const int64_t row = p / splits, begin = p % splits * chunk;
  const int64_t end = begin + chunk < V ? begin + chunk : V;
  float best;
  long long idx;
  block_argmax(target + row * V, begin, end, vec4, scratch_f, scratch_i, best, idx);
  if (threadIdx.x == 0) {
    chunk_max[p] = best;
    chunk_idx[p] = idx;
  }
}

// Greedy, second launch: one warp per batch row merges the chunks of positions 0, 1, ... and stops
// at the first draft that differs from the argmax (or after position k).
constexpr int ACCEPT_THREADS = 128;
__global__ void __launch_bounds__(ACCEPT_THREADS)
    greedy_accept_kernel(const float* __restrict__ chunk_max, const long long* __restrict__ chunk_idx,
                         const int64_t* __restrict__ draft_tokens, int64_t* __restrict__ out_tokens,
                         int64_t* __restrict__ num_emitted, int64_t B, int64_t k, int64_t splits) {
  const int lane = threadIdx.x % 32;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (ACCEPT_THREADS / 32) + threadIdx.x / 32;
  if (b >= B) return;  // the whole warp
  const int64_t K1 = k + 1;
  const int64_t* ids = draft_tokens + b * k;
  int64_t n = 0;
  long long final_token = 0;
  for (;; ++n) {  // uniform across the warp: every lane gets the same argmax
    float best = -INFINITY;
    long long idx = LLONG_MAX;
    const int64_t first = (b * K1 + n) * splits;
    for (int64_t s = lane; s < splits; s += 32) argmax_merge(best, idx, chunk_max[first + s], chunk_idx[first + s]);
    warp_argmax(best, idx);
    final_token = idx;
    if (n == k || ids[n] != final_token) break;
  }
  for (int64_t i = lane; i < K1; i += 32) out_tokens[b * K1 + i] = i < n ? ids[i] : (i == n ? final_token : -1);
  if (lane == 0) num_emitted[b] = n + 1;
}

void check_inputs(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                  const at::Tensor& draft_tokens, const at::Tensor& uniforms) {
  constexpr const char* op = "verify_draft";
  const auto device = target_probs.device();
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.size(1) >= 1 && target_probs.size(2) >= 1,
              op, ": target_probs must be [B, k + 1, V] with V >= 1, got ", target_probs.sizes());
  const int64_t B = target_probs.size(0), K1 = target_probs.size(1), V = target_probs.size(2);
  auto check = [&](const at::Tensor& x, const char* name, at::ScalarType dtype,
                   c10::IntArrayRef shape) {
    TORCH_CHECK(x.device() == device, op, ": ", name, " must be on ", device, ", got ", x.device());
    TORCH_CHECK(x.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
                x.scalar_type());
    TORCH_CHECK(x.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ",
                x.sizes());
    TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous");
  };
  check(target_probs, "target_probs", at::kFloat, {B, K1, V});
  check(draft_tokens, "draft_tokens", at::kLong, {B, K1 - 1});
  check(uniforms, "uniforms", at::kFloat, {B, K1});
  if (draft_probs.has_value()) check(*draft_probs, "draft_probs", at::kFloat, {B, K1 - 1, V});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> verify_draft_cuda(const at::Tensor& target_probs,
                                                     const std::optional<at::Tensor>& draft_probs,
                                                     const at::Tensor& draft_tokens,
                                                     const at::Tensor& uniforms) {
  check_inputs(target_probs, draft_probs, draft_tokens, uniforms);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t B = target_probs.size(0), K1 = target_probs.size(1), V = target_probs.size(2);
  at::Tensor tokens = at::empty({B, K1}, draft_tokens.options());
  at::Tensor num_emitted = at::empty({B}, draft_tokens.options());
  if (B == 0) return {tokens, num_emitted};
  TORCH_CHECK(B <= INT_MAX, "verify_draft: batch size ", B, " exceeds the CUDA grid");
  const bool greedy = !draft_probs.has_value();
  // float4 rows: every row starts at a multiple of V floats from 16-byte aligned bases (chunks too)
  const bool vec4 = V % 4 == 0 && aligned16(target_probs.data_ptr()) && (greedy || aligned16(draft_probs->data_ptr()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (greedy) {
    // Enough chunks per row for GREEDY_BLOCKS_PER_SM blocks on every SM, none shorter than one
    // unrolled trip of the block.
    const int64_t rows = B * K1;
    const int64_t wanted = ceil_div64(GREEDY_BLOCKS_PER_SM * device_attribute(cudaDevAttrMultiProcessorCount), rows);
    int64_t splits = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, V / GREEDY_MIN_CHUNK));
    const int64_t chunk = ceil_div64(ceil_div64(V, splits), 4) * 4;
    splits = ceil_div64(V, chunk);
    TORCH_CHECK(rows * splits <= INT_MAX, "verify_draft: ", B, " x ", K1, " rows exceed the CUDA grid");
    at::Tensor chunk_max = at::empty({rows * splits}, target_probs.options());
    at::Tensor chunk_idx = at::empty({rows * splits}, draft_tokens.options());
    greedy_chunk_argmax_kernel<<<static_cast<unsigned>(rows * splits), THREADS, 0, stream>>>(
        target_probs.data_ptr<float>(), V, chunk, splits, vec4, chunk_max.data_ptr<float>(),
        reinterpret_cast<long long*>(chunk_idx.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    constexpr int ROWS_PER_BLOCK = ACCEPT_THREADS / 32;
    greedy_accept_kernel<<<static_cast<unsigned>(ceil_div64(B, ROWS_PER_BLOCK)), ACCEPT_THREADS, 0, stream>>>(
        chunk_max.data_ptr<float>(), reinterpret_cast<const long long*>(chunk_idx.data_ptr<int64_t>()),
        draft_tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), num_emitted.data_ptr<int64_t>(), B,
        K1 - 1, splits);
  } else {
    sampling_kernel<<<static_cast<unsigned>(B), THREADS, 0, stream>>>(
        target_probs.data_ptr<float>(), draft_probs->data_ptr<float>(), draft_tokens.data_ptr<int64_t>(),
        uniforms.data_ptr<float>(), tokens.data_ptr<int64_t>(), num_emitted.data_ptr<int64_t>(), K1 - 1, V,
        vec4);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, num_emitted};
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("verify_draft", &verify_draft_cuda);
}

}  // namespace gptfast_kernels
