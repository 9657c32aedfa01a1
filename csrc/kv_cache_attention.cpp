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
// With alibi_slopes [Hq] (ALiBi: BLOOM, MPT, Falcon-RW), head h's (capped) score of the slot holding
// position s gains alibi_slopes[h] * (s - positions[b, t]); the sink's logit gets none.
// With ring = true the caches are ring buffers (a sliding-window layer's, S >= window slots, or a
// chunked layer's, S >= chunk_size): position p lives in slot p % S, for the scatter and for every
// read; positions may exceed S. A query's first visible position always comes from absolute
// positions, so chunk starts stay p - p % C whatever slot p lands in.
// With value_dim = Dv > 0 the values are in the keys: slot s's value is k_cache[b, h, s, :Dv] (multi-
// head latent attention, whose keys are [latent, rope part] and whose values the latent alone); v and
// v_cache are then empty and unused, only k is written, and out is [B, Hq, T, Dv].
//
// Each query reads only slots first..position, never the whole preallocated cache. The scatter runs
// first (one parallel pass), then the attention, parallel over (batch, kv head, run of query
// tokens); each work item computes the whole head group of G = Hq / Hkv query heads for its tokens,
// so a key / value row is loaded once and reused by every query of the item (GQA / MQA, and the
// k + 1 tokens of a verification). Online softmax over blocks of SLOT_BLOCK positions, accumulated in
// float32 whatever the cache dtype. The attention itself is csrc/cpu/kv_cache_attention_kernel.h,
// built once per instruction set (baseline, AVX2, AVX-512), the one cpu_isa() names (common.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu/kv_cache_attention_cpu.h"

namespace gptfast_kernels {
namespace {

// Query rows (heads x tokens) per work item at most: every row of an item shares each block of key /
// value rows read from memory; past a few dozen rows the item's scratch (queries, accumulators,
// scores) outgrows the L2 it shares the blocks through, and prefill needs many items to spread.
constexpr int64_t MAX_ROWS_PER_ITEM = 64;
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

// The CPU attention kernel's builds (kv_cache_attention_cpu.h), by CpuIsa.
cpu::AttendRowsFn attention_build() {
  switch (cpu_isa()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case CpuIsa::avx512: return &cpu::attend_rows_avx512;
    case CpuIsa::avx2: return &cpu::attend_rows_avx2;
#endif
    default: return &cpu::attend_rows_baseline;
  }
}

// A work item: one batch row, one kv head, a range of its group's query heads and a run of tokens.
// By default all of a row's tokens (each key / value block is read once for all of them) and as many
// heads as fit in MAX_ROWS_PER_ITEM rows; when that leaves threads idle, shorter runs of tokens,
// then fewer heads (multi-query attention, e.g. latent attention's 128 heads on one kv head).
struct WorkSplit {
  int64_t heads, tokens;  // per item
  int64_t head_pieces, token_pieces;
};

WorkSplit split_work(int64_t B, int64_t Hkv, int64_t T, int64_t G) {
  const auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  WorkSplit w{};
  w.heads = std::min(G, MAX_ROWS_PER_ITEM);
  w.tokens = std::clamp<int64_t>(MAX_ROWS_PER_ITEM / w.heads, 1, std::max<int64_t>(T, 1));
  w.head_pieces = ceil_div(G, w.heads), w.token_pieces = ceil_div(T, w.tokens);
  const int64_t threads = at::get_num_threads(), rows_heads = B * Hkv;
  if (rows_heads * w.head_pieces * w.token_pieces < threads && T > w.token_pieces) {
    w.token_pieces = std::min(T, ceil_div(threads, rows_heads * w.head_pieces));
    w.tokens = ceil_div(T, w.token_pieces);
    w.token_pieces = ceil_div(T, w.tokens);
  }
  if (rows_heads * w.head_pieces * w.token_pieces < threads && G > w.head_pieces) {
    w.head_pieces = std::min(G, ceil_div(threads, rows_heads * w.token_pieces));
    w.heads = ceil_div(G, w.head_pieces);
    w.head_pieces = ceil_div(G, w.heads);
  }
  return w;
}

// values: v_cache, or k_cache itself with values in keys (its rows' first Dv numbers; Dv = out's
// head dim, D otherwise).
template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& values, const int64_t* positions,
            double scale, int64_t window, int64_t chunk, double softcap, const float* sinks,
            const float* alibi_slopes, bool ring, at::Tensor& out) {
  cpu::AttendArgs args{};
  args.q = q.data_ptr();
  args.q_stride_b = q.stride(0), args.q_stride_h = q.stride(1), args.q_stride_t = q.stride(2);
  args.q_stride_d = q.stride(3);
  args.keys = k_cache.data_ptr();
  args.values = values.data_ptr();  // rows of D numbers either way
  args.positions = positions;
  args.sinks = sinks;
  args.alibi_slopes = alibi_slopes;
  args.Hq = q.size(1), args.Hkv = k_cache.size(1), args.T = q.size(2), args.D = q.size(3);
  args.Dv = out.size(3), args.S = k_cache.size(2), args.G = args.Hq / args.Hkv;
  args.window = window, args.chunk = chunk;
  args.scale = static_cast<float>(scale), args.softcap = static_cast<float>(softcap);
  args.ring = ring;
  args.elem = std::is_same_v<scalar_t, float>      ? cpu::Elem::F32
              : std::is_same_v<scalar_t, at::Half> ? cpu::Elem::F16
                                                   : cpu::Elem::BF16;
  const cpu::AttendRowsFn attend_rows = attention_build();
  const int64_t B = q.size(0), Hkv = args.Hkv, T = args.T, G = args.G, Dv = args.Dv;
  const WorkSplit split = split_work(B, Hkv, T, G);
  const int64_t pieces = split.head_pieces * split.token_pieces;
  scalar_t* o_ptr = out.data_ptr<scalar_t>();  // contiguous [B, Hq, T, Dv]

  at::parallel_for(0, B * Hkv * pieces, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = split.heads * split.tokens;
    std::vector<float> scratch(cpu::scratch_floats(rows, args.D, Dv)), result(rows * Dv);
    std::vector<int64_t> int_scratch(cpu::scratch_ints(rows));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t piece = item % pieces, h = (item / pieces) % Hkv, b = item / (pieces * Hkv);
      const int64_t g0 = piece / split.token_pieces * split.heads, g1 = std::min(G, g0 + split.heads);
      const int64_t t0 = piece % split.token_pieces * split.tokens, t1 = std::min(T, t0 + split.tokens);
      attend_rows(args, b, h, g0, g1, t0, t1, result.data(), scratch.data(), int_scratch.data());
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t t = t0; t < t1; ++t) {
          const float* src = result.data() + ((g - g0) * (t1 - t0) + t - t0) * Dv;
          scalar_t* dst = o_ptr + ((b * args.Hq + h * G + g) * T + t) * Dv;
          for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(src[d]);
        }
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
                                        const at::Tensor& positions, double scale, int64_t window, double softcap,
                                        const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                        int64_t chunk_size, const std::optional<at::Tensor>& alibi_slopes) {
  constexpr const char* op = "kv_cache_attention";
  // The kernels hold scale and softcap as float32 times log2(e) (they use exp2): both must stay finite
  // there (float32's largest is just under 2^128), and the GPU kernels' inverse of the cap a normal
  // float32 (flushed to 0 below 2^-126). NaN fails every comparison.
  constexpr double MAX_SCALE = 0x1p126, MAX_SOFTCAP = 0x1p125;
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
  TORCH_CHECK(softcap == 0 || (softcap >= std::numeric_limits<float>::min() && softcap <= MAX_SOFTCAP), op,
              ": softcap must be 0 (none) or in [", std::numeric_limits<float>::min(), ", 2^125], got ", softcap);
  TORCH_CHECK(std::abs(scale) <= MAX_SCALE, op, ": scale must be a number with |scale| <= 2^126, got ", scale);
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
  for (const auto& [name, x] : {std::pair{"sinks", &sinks}, std::pair{"alibi_slopes", &alibi_slopes}}) {
    if (!x->has_value()) continue;
    const at::Tensor& t = **x;
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on q's device ", q.device(), ", got ", t.device());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == Hq && t.is_contiguous(), op, ": ", name, " must be contiguous [Hq] = [",
                Hq, "], got ", t.sizes());
  }
  return values_in_keys ? value_dim : D;
}

// q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D] contiguous (written in
// place); positions [B, T] int64 contiguous, -1 = padding -> out [B, Hq, T, D] contiguous. With
// value_dim > 0: v, v_cache empty, values in k_cache's first value_dim numbers, out [B, Hq, T, value_dim].
// chunk_size > 0: chunked attention (see first_position in cpu/kv_cache_attention_kernel.h).
at::Tensor kv_cache_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions,
                                  double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                  int64_t chunk_size, const std::optional<at::Tensor>& alibi_slopes) {
  constexpr const char* op = "kv_cache_attention";
  const int64_t Dv = check_kv_cache_attention_inputs(q, k, v, k_cache, v_cache, positions, scale, window, softcap,
                                                     sinks, ring, value_dim, chunk_size, alibi_slopes);
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
                     sinks.has_value() ? sinks->data_ptr<float>() : nullptr,
                     alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr, ring, out);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("kv_cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor positions, float scale, int window=0, float softcap=0.0, Tensor? sinks=None, bool ring=False, "
        "int value_dim=0, int chunk_size=0, Tensor? alibi_slopes=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("kv_cache_attention", &kv_cache_attention_cpu);
}

}  // namespace gptfast_kernels
