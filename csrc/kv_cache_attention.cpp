// Fused static-KV-cache attention with position scatter: the kv_cache_attention schema and its CPU
// kernel.
//
//   for (b, t) with positions[b, t] >= 0:  k_cache[b, :, positions[b, t]] = k[b, :, t]  (same for v)
//   out[b, h, t] = softmax(cap(scale * q[b, h, t] . k_cache[b, h / G, first..positions[b, t]])) @ v_cache[...]
//   out[b, h, t] = 0 where positions[b, t] < 0 (padding)
// first = 0, or positions[b, t] - window + 1 (at least 0) with a sliding window (window > 0), or
// with chunked attention (chunk_size = C > 0, Llama 4) the start of the query's chunk of C positions,
// positions[b, t] - positions[b, t] % C;
// cap(s) = s, or softcap * tanh(s / softcap) when softcap > 0 (Gemma 2's logit soft-capping).
// With sinks [Hq] (GPT-OSS), head h's softmax has one more logit, sinks[h], attending to nothing.
// With ring = true the caches are ring buffers (a sliding-window layer's, S >= window slots, or a
// chunked layer's, S >= chunk_size): position p lives in slot p % S, for the scatter and for every
// read; positions may exceed S. first_slot always takes absolute positions, so chunk starts stay
// p - p % C whatever slot p lands in.
// With value_dim = Dv > 0 the values are in the keys: slot s's value is k_cache[b, h, s, :Dv] (multi-
// head latent attention, whose keys are [latent, rope part] and whose values the latent alone); v and
// v_cache are then empty and unused, only k is written, and out is [B, Hq, T, Dv].
//
// Each query reads only slots first..position, never the whole preallocated cache. The scatter runs
// first (one parallel pass), then the attention, parallel over (batch, kv head, query token);
// each work item computes the whole head group of G = Hq / Hkv query heads, so a key / value row
// is loaded once per group and reused G times (GQA / MQA). Online softmax over blocks of
// SLOT_BLOCK slots, accumulated in float32 whatever the cache dtype.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace gptfast_kernels {
namespace {

// Slots scored per online-softmax step: scores for a block of slots are computed first, then the
// running max / sum are corrected once per block instead of once per slot.
constexpr int64_t SLOT_BLOCK = 64;
// Work items (query token x kv head) per parallel_for task; decode has few items, prefill many.
constexpr int64_t ATTENTION_GRAIN = 1;
// Largest head dim any backend supports: multi-head latent attention runs as multi-query attention
// over latents of kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (DeepSeek-V2 / V3, Kimi-K2,
// GLM-4.7-Flash). The CPU kernel's buffers are sized at run time; the CUDA kernels size shared
// memory by D (kv_cache_attention.cuh).
constexpr int64_t MAX_HEAD_DIM = 576;

struct Strides4 {
  int64_t b, h, t, d;
  explicit Strides4(const at::Tensor& x) : b(x.stride(0)), h(x.stride(1)), t(x.stride(2)), d(x.stride(3)) {}
  int64_t at(int64_t ib, int64_t ih, int64_t it) const { return ib * b + ih * h + it * t; }
};

template <typename scalar_t>
inline float dot_f32(const float* a, const scalar_t* b, int64_t D) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += a[d] * static_cast<float>(b[d]);
  return acc;
}

// The slot holding position pos (>= 0): pos itself, or pos % S in a ring buffer.
inline int64_t slot_of(int64_t pos, int64_t S, bool ring) { return ring ? pos % S : pos; }

// Writes k (and v, unless values_in_keys) at the tokens' slots.
template <typename scalar_t>
void scatter_new_tokens(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        const int64_t* positions, bool ring, bool values_in_keys) {
  const int64_t B = k.size(0), Hkv = k.size(1), T = k.size(2), D = k.size(3), S = k_cache.size(2);
  const Strides4 ks(k), vs(values_in_keys ? k : v);  // (v may be an empty tensor of any rank then)
  const scalar_t* k_ptr = k.data_ptr<scalar_t>();
  const scalar_t* v_ptr = values_in_keys ? nullptr : v.data_ptr<scalar_t>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = values_in_keys ? nullptr : v_cache.data_ptr<scalar_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t pos = positions[b * T + t];
        if (pos < 0) continue;
        const int64_t dst = ((b * Hkv + h) * S + slot_of(pos, S, ring)) * D;
        const scalar_t* k_src = k_ptr + ks.at(b, h, t);
        for (int64_t d = 0; d < D; ++d) kc[dst + d] = k_src[d * ks.d];
        if (values_in_keys) continue;
        const scalar_t* v_src = v_ptr + vs.at(b, h, t);
        for (int64_t d = 0; d < D; ++d) vc[dst + d] = v_src[d * vs.d];
      }
    }
  });
}

// First position a query at `pos` (>= 0) sees: the window's start, its chunk's start, or 0 with
// neither (window == chunk == 0; the two never come together). Without ring also its first slot.
inline int64_t first_slot(int64_t pos, int64_t window, int64_t chunk) {
  if (window > 0) return std::max<int64_t>(0, pos - window + 1);
  return chunk > 0 ? pos - pos % chunk : 0;
}

// values: v_cache, or k_cache itself with values in keys (its rows' first Dv numbers; Dv = out's
// head dim, D otherwise).
template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& values, const int64_t* positions,
            double scale, int64_t window, int64_t chunk, double softcap, const float* sinks, bool ring,
            at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Dv = out.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2), G = Hq / Hkv;
  const Strides4 qs(q);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = values.data_ptr<scalar_t>();  // rows of D numbers either way
  scalar_t* o_ptr = out.data_ptr<scalar_t>();  // contiguous [B, Hq, T, Dv]
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Hkv * T, ATTENTION_GRAIN, [&](int64_t begin, int64_t end) {
    // Per-task scratch: the group's scaled queries, accumulators, running max / sum, block scores.
    std::vector<float> qf(G * D), acc(G * Dv), row_max(G), row_sum(G), scores(G * SLOT_BLOCK);
    std::vector<int64_t> row_offset(SLOT_BLOCK);  // a block's K / V rows in the head's buffers
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item % T, h = (item / T) % Hkv, b = item / (T * Hkv);
      const int64_t pos = positions[b * T + t];
      if (pos < 0) {  // padding query: zero output
        for (int64_t g = 0; g < G; ++g) {
          scalar_t* o = o_ptr + ((b * Hq + h * G + g) * T + t) * Dv;
          std::fill(o, o + Dv, static_cast<scalar_t>(0.f));
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* qrow = q_ptr + qs.at(b, h * G + g, t);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d * qs.d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {  // a sink is a first slot of weight e^sink and value 0
        row_max[g] = sinks ? sinks[h * G + g] : -std::numeric_limits<float>::infinity();
        row_sum[g] = sinks ? 1.f : 0.f;
      }
      const scalar_t* k_head = kc + (b * Hkv + h) * S * D;
      const scalar_t* v_head = vc + (b * Hkv + h) * S * D;
      const int64_t length = pos + 1;  // positions first..pos inclusive
      for (int64_t s0 = first_slot(pos, window, chunk); s0 < length; s0 += SLOT_BLOCK) {
        const int64_t n = std::min(SLOT_BLOCK, length - s0);
        // slots of positions s0 .. s0 + n - 1: one remainder per block in a ring, wrapping after
        for (int64_t j = 0, slot = slot_of(s0, S, ring); j < n; ++j, slot = slot + 1 == S ? 0 : slot + 1) {
          row_offset[j] = slot * D;
        }
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* krow = k_head + row_offset[j];
          for (int64_t g = 0; g < G; ++g) scores[g * SLOT_BLOCK + j] = dot_f32(qf.data() + g * D, krow, D);
        }
        if (cap > 0.f) {
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < n; ++j) {
              float& score = scores[g * SLOT_BLOCK + j];
              score = cap * std::tanh(score / cap);
            }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sc = scores.data() + g * SLOT_BLOCK;
          float block_max = sc[0];
          for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, sc[j]);
          const float new_max = std::max(row_max[g], block_max);
          const float correction = std::exp(row_max[g] - new_max);  // exp(-inf) = 0 on the first block
          row_max[g] = new_max;
          float block_sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = std::exp(sc[j] - new_max);
            block_sum += sc[j];
          }
          row_sum[g] = row_sum[g] * correction + block_sum;
          float* a = acc.data() + g * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) a[d] *= correction;
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* vrow = v_head + row_offset[j];
            const float p = sc[j];
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) a[d] += p * static_cast<float>(vrow[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = o_ptr + ((b * Hq + h * G + g) * T + t) * Dv;
        const float inv = 1.f / row_sum[g];
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(acc[g * Dv + d] * inv);
      }
    }
  });
}

// The most positions a query sees with a window or chunks (ring mode has one of them): a window's
// W, or a chunk's C (a query at p reads p - p % C .. p, at most C positions).
inline int64_t query_reach(int64_t window, int64_t chunk) { return window > 0 ? window : chunk; }

// A ring-buffer call's positions [B, T]: each in [-1, 2^31 - 1), and per row the valid ones within
// S - reach of each other (reach: query_reach), so that no token this call writes lands on a slot
// one of its queries reads (the reach positions up to it, in a ring of S slots).
void check_ring_positions(const int64_t* pos, int64_t B, int64_t T, int64_t S, int64_t window, int64_t chunk) {
  const int64_t reach = query_reach(window, chunk);
  const char* bound = window > 0 ? "window" : "chunk_size";
  constexpr const char* op = "kv_cache_attention";
  for (int64_t b = 0; b < B; ++b) {
    int64_t low = INT64_MAX, high = -1;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * T + t];
      TORCH_CHECK(p >= -1 && p < INT32_MAX, op, ": positions must lie in [-1, 2^31 - 1) with ring=True, got ", p);
      if (p >= 0) low = std::min(low, p), high = std::max(high, p);
    }
    TORCH_CHECK(high < 0 || high - low + reach <= S, op, ": with ring=True a row's positions may span at most S - ",
                bound, " = ", S - reach, " (its new tokens would overwrite slots its queries read); row ", b,
                " spans ", low, "..", high);
  }
}

}  // namespace

// Checks shared by the CPU and CUDA entry points (declared in common.h): shapes, dtypes,
// contiguity of the caches and of positions. Position values are checked by each backend.
int64_t check_kv_cache_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& positions, int64_t window, double softcap,
                                        const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                        int64_t chunk_size) {
  constexpr const char* op = "kv_cache_attention";
  const bool values_in_keys = value_dim != 0;
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, op, ": window must be in 0..2^31 - 1 (0: no window), got ", window);
  TORCH_CHECK(chunk_size >= 0 && chunk_size <= INT32_MAX, op,
              ": chunk_size must be in 0..2^31 - 1 (0: no chunking), got ", chunk_size);
  TORCH_CHECK(chunk_size == 0 || window == 0, op, ": chunk_size (chunked attention) cannot be combined with a "
              "window; got chunk_size ", chunk_size, ", window ", window);
  // a ring must hold every position a query sees: its window, or its chunk
  TORCH_CHECK(!ring || (query_reach(window, chunk_size) > 0 && k_cache.dim() == 4 &&
                        query_reach(window, chunk_size) <= k_cache.size(2)),
              op, ": ring=True (a ring-buffer cache) needs a window or a chunk_size in 1..S, the cache's slots; got "
              "window ", window, ", chunk_size ", chunk_size, " for k_cache ", k_cache.sizes());
  // a cap below float32's smallest normal would reach the CUDA kernels as 0, i.e. as "no cap"
  TORCH_CHECK(std::isfinite(softcap) && (softcap == 0 || softcap >= std::numeric_limits<float>::min()), op,
              ": softcap must be 0 (none) or finite and >= ", std::numeric_limits<float>::min(), ", got ", softcap);
  GPTFAST_CHECK_DIM(op, q, 4);
  GPTFAST_CHECK_FLOATING(op, q);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  for (const auto* x : {&k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), op, ": k, v, k_cache and v_cache must have q's dtype ",
                q.scalar_type(), ", got ", x->scalar_type());
    TORCH_CHECK(x->device() == q.device(), op, ": all tensors must be on q's device ", q.device(), ", got ",
                x->device());
  }
  for (const auto* x : {&k, &k_cache}) {
    TORCH_CHECK(x->dim() == 4, op, ": k and k_cache must have 4 dimensions, got ", x->sizes());
  }
  const int64_t Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == c10::IntArrayRef({B, Hkv, T, D}), op, ": k must be [B, Hkv, T, D] matching q ",
              q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, op, ": Hq (", Hq, ") must be a positive multiple of Hkv (", Hkv, ")");
  TORCH_CHECK(D > 0 && D <= MAX_HEAD_DIM, op, ": head dim D must be in 1..", MAX_HEAD_DIM, ", got ", D);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(1) == Hkv && k_cache.size(3) == D, op,
              ": k_cache must be [B, Hkv, S, D] = [", B, ", ", Hkv, ", S, ", D, "], got ", k_cache.sizes());
  GPTFAST_CHECK_CONTIGUOUS(op, k_cache);
  TORCH_CHECK(value_dim >= 0 && value_dim <= D, op, ": value_dim must be 0 (values in v_cache) or in 1..D = 1..", D,
              " (values in the keys' first value_dim numbers), got ", value_dim);
  if (values_in_keys) {
    TORCH_CHECK(v.numel() == 0 && v_cache.numel() == 0, op, ": with value_dim > 0 the values are in k_cache, so v "
                "and v_cache must be empty tensors (they are not used), got v ", v.sizes(), " and v_cache ",
                v_cache.sizes());
  } else {
    TORCH_CHECK(v.dim() == 4 && v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ",
                v.sizes());
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have k_cache's shape ", k_cache.sizes(),
                ", got ", v_cache.sizes());
    GPTFAST_CHECK_CONTIGUOUS(op, v_cache);
  }
  for (const auto* x : {&q, &k, &v}) {
    TORCH_CHECK(x->numel() == 0 || x->stride(3) == 1, op, ": q, k and v must be contiguous in the head dim");
  }
  GPTFAST_CHECK_DTYPE(op, positions, at::kLong);
  GPTFAST_CHECK_DEVICE(op, positions, q.device());
  TORCH_CHECK(positions.sizes() == c10::IntArrayRef({B, T}), op, ": positions must be [B, T] = [", B, ", ", T,
              "], got ", positions.sizes());
  GPTFAST_CHECK_CONTIGUOUS(op, positions);
  if (sinks.has_value()) {
    GPTFAST_CHECK_DTYPE(op, *sinks, at::kFloat);
    GPTFAST_CHECK_DEVICE(op, *sinks, q.device());
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1) && sinks->is_contiguous(), op,
                ": sinks must be contiguous [Hq] = [", q.size(1), "], got ", sinks->sizes());
  }
  return values_in_keys ? value_dim : D;
}

// q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D] contiguous (written in
// place); positions [B, T] int64 contiguous, -1 = padding -> out [B, Hq, T, D] contiguous. With
// value_dim > 0: v, v_cache empty, values in k_cache's first value_dim numbers, out [B, Hq, T, value_dim].
// chunk_size > 0: chunked attention (see first_slot).
at::Tensor kv_cache_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions,
                                  double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                  int64_t chunk_size) {
  constexpr const char* op = "kv_cache_attention";
  const int64_t Dv = check_kv_cache_attention_inputs(q, k, v, k_cache, v_cache, positions, window, softcap, sinks,
                                                     ring, value_dim, chunk_size);
  const bool values_in_keys = value_dim > 0;
  const int64_t S = k_cache.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  // before anything is written
  if (!ring) {
    for (int64_t i = 0; i < positions.numel(); ++i) {
      TORCH_CHECK(pos[i] >= -1 && pos[i] < S, op, ": positions must lie in [-1, S) = [-1, ", S, "), got ", pos[i]);
    }
  } else {
    check_ring_positions(pos, positions.size(0), positions.size(1), S, window, chunk_size);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), Dv}, q.options());
  if (q.numel() == 0) return out;
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(q.scalar_type(), "kv_cache_attention_cpu", [&] {
    scatter_new_tokens<scalar_t>(k, v, k_cache, v_cache, pos, ring, values_in_keys);
    attend<scalar_t>(q, k_cache, values_in_keys ? k_cache : v_cache, pos, scale, window, chunk_size, softcap,
                     sinks.has_value() ? sinks->data_ptr<float>() : nullptr, ring, out);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("kv_cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor positions, float scale, int window=0, float softcap=0.0, Tensor? sinks=None, bool ring=False, "
        "int value_dim=0, int chunk_size=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("kv_cache_attention", &kv_cache_attention_cpu);
}

}  // namespace gptfast_kernels
