// Batched speculative-decoding verification: the verify_draft schema and its CPU kernel.
//
// Per row b (API.md section 1): sampling reads only p = target[b, i, t_i] and q = draft[b, i, t_i]
// for i = 0, 1, ... until the first rejection, then makes one pass over the vocabulary row at the
// stopping point for the residual total and a blocked inverse-CDF scan that stops at the sampled
// index. Greedy needs argmax(target[b, i]) to test draft i, so it walks the rows one by one and
// stops at the first mismatch. Rows run in parallel (at::parallel_for).
//
// Sums are accumulated in float64 and compared after rounding to float32, which reproduces the
// reference (torch.cumsum of float32 accumulates in float64 on the CPU) except where rounding
// puts u * total exactly on a partial sum.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "common.h"

namespace gptfast_kernels {
namespace {

// Portable SIMD through the GCC/Clang vector extensions (SSE2 pairs on baseline x86-64, NEON on
// arm64): 8 floats per step, converted to two 4 x float64 vectors for the sums. (GCC warns that a
// 32-byte vector returned without AVX has another ABI than with it; these functions have internal
// linkage and are always inlined, so no such value crosses a call boundary.)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));
constexpr int64_t LANES = 8;
// Elements per block of the inverse-CDF scan: block sums are vectorised, and only the block holding
// the crossing is scanned element by element (the sequential part of the scan).
constexpr int64_t SCAN_BLOCK = 256;

__attribute__((always_inline)) inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The weights the final token is sampled from: max(0, target - draft), or target alone.
struct Weights {
  const float* target;
  const float* draft;  // nullptr: the target row itself
  float operator()(int64_t j) const {
    return draft ? std::max(0.f, target[j] - draft[j]) : target[j];
  }
  __attribute__((always_inline)) f32x8 load(int64_t j) const {
    f32x8 v = load8(target + j);
    if (draft) {
      v -= load8(draft + j);
      v = reinterpret_cast<f32x8>(reinterpret_cast<i32x8>(v) & (v > 0.f));  // max(0, .)
    }
    return v;
  }
};

// Sum of w[begin, end) in float64 (the order differs from a sequential sum only by float64 rounding).
double weight_sum(const Weights& w, int64_t begin, int64_t end) {
  f64x4 acc_lo = {0, 0, 0, 0}, acc_hi = {0, 0, 0, 0};
  int64_t j = begin;
  for (; j + LANES <= end; j += LANES) {
    const f32x8 v = w.load(j);
    acc_lo += __builtin_convertvector((f32x4){v[0], v[1], v[2], v[3]}, f64x4);
    acc_hi += __builtin_convertvector((f32x4){v[4], v[5], v[6], v[7]}, f64x4);
  }
  const f64x4 acc = acc_lo + acc_hi;
  double total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (; j < end; ++j) total += static_cast<double>(w(j));
  return total;
}

// The smallest j whose running sum exceeds u * total; when rounding leaves none, the last index
// with non-zero weight (V - 1 for an all-zero row), as reference.sample_inverse_cdf documents.
int64_t sample_inverse_cdf(const Weights& w, int64_t V, double total, float u) {
  const float threshold = u * static_cast<float>(total);
  double running = 0.0;
  for (int64_t begin = 0; begin < V; begin += SCAN_BLOCK) {
    const int64_t end = std::min(V, begin + SCAN_BLOCK);
    const double block = weight_sum(w, begin, end);
    if (static_cast<float>(running + block) <= threshold) {
      running += block;
      continue;
    }
    for (int64_t j = begin; j < end; ++j) {
      running += static_cast<double>(w(j));
      if (static_cast<float>(running) > threshold) return j;
    }
  }
  for (int64_t j = V - 1; j > 0; --j) {
    if (w(j) > 0.f) return j;
  }
  return w(0) > 0.f ? 0 : V - 1;
}

// First index of the maximum: a vectorised max pass, then a search for its first occurrence in
// blocks of FIND_BLOCK (branch-free inside a block, so it vectorises too).
constexpr int64_t FIND_BLOCK = 16;

// NaN counts as the maximum, as in torch.argmax (NaN reaches here only under capture or compile,
// where the wrapper's check is skipped; the CUDA kernel orders it the same way).
int64_t argmax_first(const float* row, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int nan_seen = 0;
#pragma omp simd reduction(max : best) reduction(| : nan_seen)
  for (int64_t j = 0; j < V; ++j) {
    best = row[j] > best ? row[j] : best;
    nan_seen |= row[j] != row[j];
  }
  int64_t j = 0;
  for (; j + FIND_BLOCK <= V; j += FIND_BLOCK) {
    int hit = 0;
    for (int64_t l = 0; l < FIND_BLOCK; ++l) hit |= nan_seen ? row[j + l] != row[j + l] : row[j + l] == best;
    if (hit) break;
  }
  for (; j < V; ++j) {
    if (nan_seen ? row[j] != row[j] : row[j] == best) return j;
  }
  return 0;  // V == 0 is rejected by the wrapper
}

}  // namespace

// target_probs [B, k+1, V], draft_probs [B, k, V] or none (greedy), draft_tokens [B, k] int64,
// uniforms [B, k+1] float32, all contiguous float32 on the CPU -> (tokens [B, k+1], num_emitted [B]).
std::tuple<at::Tensor, at::Tensor> verify_draft_cpu(const at::Tensor& target_probs,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& draft_tokens,
                                                    const at::Tensor& uniforms) {
  constexpr const char* op = "verify_draft";
  GPTFAST_CHECK_DIM(op, target_probs, 3);
  GPTFAST_CHECK_DTYPE(op, target_probs, at::kFloat);
  GPTFAST_CHECK_CONTIGUOUS(op, target_probs);
  const int64_t B = target_probs.size(0), K1 = target_probs.size(1), V = target_probs.size(2);
  TORCH_CHECK(K1 >= 1 && V >= 1, op, ": target_probs must be [B, k + 1, V] with k >= 0, V >= 1");
  const int64_t k = K1 - 1;
  GPTFAST_CHECK_DIM(op, draft_tokens, 2);
  GPTFAST_CHECK_DTYPE(op, draft_tokens, at::kLong);
  GPTFAST_CHECK_CONTIGUOUS(op, draft_tokens);
  GPTFAST_CHECK_SIZE(op, draft_tokens, 0, B);
  GPTFAST_CHECK_SIZE(op, draft_tokens, 1, k);
  GPTFAST_CHECK_DIM(op, uniforms, 2);
  GPTFAST_CHECK_DTYPE(op, uniforms, at::kFloat);
  GPTFAST_CHECK_CONTIGUOUS(op, uniforms);
  GPTFAST_CHECK_SIZE(op, uniforms, 0, B);
  GPTFAST_CHECK_SIZE(op, uniforms, 1, K1);
  GPTFAST_CHECK_DEVICE(op, draft_tokens, target_probs.device());
  GPTFAST_CHECK_DEVICE(op, uniforms, target_probs.device());
  // An empty draft_probs (k = 0) has a null data pointer, so greedy is told apart by has_value().
  const bool greedy = !draft_probs.has_value();
  const float* draft = nullptr;
  if (!greedy) {
    const at::Tensor& dp = *draft_probs;
    GPTFAST_CHECK_DEVICE(op, dp, target_probs.device());
    GPTFAST_CHECK_DIM(op, dp, 3);
    GPTFAST_CHECK_DTYPE(op, dp, at::kFloat);
    GPTFAST_CHECK_CONTIGUOUS(op, dp);
    GPTFAST_CHECK_SIZE(op, dp, 0, B);
    GPTFAST_CHECK_SIZE(op, dp, 1, k);
    GPTFAST_CHECK_SIZE(op, dp, 2, V);
    draft = dp.data_ptr<float>();
  }
  const int64_t* toks = draft_tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * k; ++i) {  // no out-of-bounds read even when called directly
    TORCH_CHECK(toks[i] >= 0 && toks[i] < V, op, ": draft_tokens must be in [0, V) = [0, ", V,
                "), got ", toks[i]);
  }

  at::Tensor tokens = at::empty({B, K1}, draft_tokens.options());
  at::Tensor num_emitted = at::empty({B}, draft_tokens.options());
  const float* target = target_probs.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  int64_t* emitted = num_emitted.data_ptr<int64_t>();

  at::parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const float* t_rows = target + b * K1 * V;
      const int64_t* t_ids = toks + b * k;
      const float* u_row = u + b * K1;
      int64_t n = 0, final_token;
      if (greedy) {
        for (;; ++n) {
          final_token = argmax_first(t_rows + n * V, V);
          if (n == k || t_ids[n] != final_token) break;
        }
      } else {
        const float* d_rows = draft + b * k * V;
        for (; n < k; ++n) {
          const float p = t_rows[n * V + t_ids[n]], q = d_rows[n * V + t_ids[n]];
          if (!(q > 0.f && u_row[n] * q < p)) break;
        }
        Weights w{t_rows + n * V, n < k ? d_rows + n * V : nullptr};
        double total = weight_sum(w, 0, V);
        if (w.draft != nullptr && !(total > 0.0)) {  // all-zero residual: sample from the target
          w.draft = nullptr;
          total = weight_sum(w, 0, V);
        }
        final_token = sample_inverse_cdf(w, V, total, u_row[k]);
      }
      int64_t* out_row = out + b * K1;
      for (int64_t i = 0; i < K1; ++i) out_row[i] = i < n ? t_ids[i] : (i == n ? final_token : -1);
      emitted[b] = n + 1;
    }
  });
  return {tokens, num_emitted};
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("verify_draft(Tensor target_probs, Tensor? draft_probs, Tensor draft_tokens, "
        "Tensor uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("verify_draft", &verify_draft_cpu);
}

}  // namespace gptfast_kernels
