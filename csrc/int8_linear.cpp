// int8 weight-only linear: schemas for quantize_int8 / int8_linear and their CPU kernels.
//
//   y[m, n] = (sum_k x[m, k] * qweight[n, k]) * scales[n] + bias[n], accumulated in float32.
//
// Three paths, by rows of x and the CPU's instruction set (cpu_isa(), common.h):
// - Few rows (decode): a GEMV that streams each int8 weight row once, widens it to float32 in
//   registers (AVX-512 or AVX2 + FMA, else the build's own vectors through omp simd) and reuses it
//   for up to GEMV_ROW_BLOCK rows of x; with 4+ rows, two weight rows at a time so each x load feeds
//   two FMAs; multithreaded over output features, each feature's arithmetic the same whatever range
//   of features a thread takes. The weight bytes dominate, so reading 1 byte instead of 4 per weight
//   is the speed-up over a float32 GEMV.
// - From GEMM_MIN_ROWS_AVX512 / _AVX2 rows (batched decode, verification, prefill): the packed GEMM
//   of csrc/cpu/int8_gemm_kernel.h, which widens each weight once per call instead of once per 4 rows
//   of x, and is multiply-add bound like a float32 BLAS GEMM.
// - Otherwise above GEMV_MAX_ROWS (the baseline build, and AVX2 prefill): dequantise PREFILL_TILE_N
//   weight rows at a time to float32 and hand each tile to the BLAS GEMM.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "common.h"
#include "cpu/int8_gemm_cpu.h"

namespace gptfast_kernels {
namespace {

// Rows of x that share one widened weight vector (4 accumulators x 8 lanes fit in 16 ymm registers).
constexpr int64_t GEMV_ROW_BLOCK = 4;
// Largest M served by the GEMV kernel or the AVX2 packed GEMM; above it the dequantise-and-GEMM path
// wins. Measured on the 2-core AVX2 EPYC, K = N = 4096, caches flushed, GEMV vs GEMM ms: M = 17 4.7
// vs 12.0, 40 10.6 vs 13.9, 64 15.8 vs 18.1, 96 24.4 vs 24.0, 128 33.0 vs 29.5 (the paired-row GEMV
// moved it from ~16).
constexpr int64_t GEMV_MAX_ROWS = 64;
// Fewest rows of x the packed GEMM takes. Measured on the 2-core Sapphire Rapids VM, caches flushed,
// GEMV vs GEMM ms at 4096 x 4096 / 4096 x 14336: AVX-512 M = 3 1.53 vs 1.45 / 4.61 vs 4.99, 4 1.32 vs
// 1.33 / 4.46 vs 4.45, 5 1.85 vs 1.45 / 6.25 vs 4.82, 8 2.24 vs 1.87 / 7.05 vs 5.98; AVX2 M = 8 3.04
// vs 3.94, 12 4.32 vs 4.30, 16 5.56 vs 5.17, 40 13.8 vs 10.2 (4096 x 4096).
constexpr int64_t GEMM_MIN_ROWS_AVX512 = 5;
constexpr int64_t GEMM_MIN_ROWS_AVX2 = 16;
// Weight rows the AVX-512 GEMV (1..3 rows of x) reads at once: each x vector feeds 4 FMA chains.
constexpr int64_t AVX512_WEIGHT_ROWS = 4;
// Output features per at::parallel_for work item in the GEMV kernel.
constexpr int64_t GEMV_GRAIN_N = 64;
// Weight rows dequantised per GEMM call in the prefill path (256 x 4096 fp32 = 4 MiB, L3-resident).
constexpr int64_t PREFILL_TILE_N = 256;

template <int ROWS>
float scalar_dot_tail(const float* x, const int8_t* w, int64_t k_begin, int64_t K) {
  float acc = 0.f;
  for (int64_t k = k_begin; k < K; ++k) acc += x[k] * static_cast<float>(w[k]);
  return acc;
}

// The baseline path's dot products, vectorised for the build's own registers (SSE2 on x86-64; 3-4x
// the plain loop). Not the vector paths' tails: SSE code called from AVX code with the upper halves
// of the registers in use runs several times slower on Intel CPUs.
template <int ROWS>
void gemv_block_scalar(const float* x, int64_t ldx, const int8_t* w, int64_t K, float* out) {
  for (int r = 0; r < ROWS; ++r) {
    const float* xr = x + r * ldx;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(w[k]);
    out[r] = acc;
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define GPTFAST_HAVE_AVX2_PATH 1

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// 8 int8 weights widened to 8 floats. Loading 8 bytes straight into vpmovsxbd (instead of 16 bytes
// and a byte shift for the upper half) saves a shuffle uop, and shuffles are what bound this loop.
__attribute__((target("avx2,fma"))) inline __m256 load8_int8_as_float(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// out[r] = dot(x[r, :], w[:]) for ROWS rows of x. Each FMA chain has a latency of ~4-5 cycles,
// so the loop keeps at least ACC_CHAINS independent accumulators in flight: one row alone gets
// four chains over 32 weights per step, several rows get two chains each over 16 weights.
template <int ROWS>
__attribute__((target("avx2,fma"))) void gemv_block_avx2(const float* x, int64_t ldx,
                                                          const int8_t* w, int64_t K, float* out) {
  constexpr int CHAINS = ROWS == 1 ? 4 : 2;
  constexpr int STEP = 8 * CHAINS;
  __m256 acc[ROWS][CHAINS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHAINS; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + STEP <= K; k += STEP) {
    __m256 wf[CHAINS];
    for (int c = 0; c < CHAINS; ++c) wf[c] = load8_int8_as_float(w + k + 8 * c);
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * ldx + k;
      for (int c = 0; c < CHAINS; ++c)
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * c), wf[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    __m256 total = acc[r][0];
    for (int c = 1; c < CHAINS; ++c) total = _mm256_add_ps(total, acc[r][c]);
    out[r] = hsum256(total) + scalar_dot_tail<ROWS>(x + r * ldx, w, k, K);
  }
}

// out0[r] = dot(x[r, :], w0[:]), out1[r] = dot(x[r, :], w1[:]) for ROWS rows of x: each x vector
// loaded serves two weight rows (2 x ROWS independent FMA chains), so loads no longer outnumber
// FMAs once there are several rows.
template <int ROWS>
__attribute__((target("avx2,fma"))) void gemv_pair_avx2(const float* x, int64_t ldx, const int8_t* w0,
                                                         const int8_t* w1, int64_t K, float* out0, float* out1) {
  __m256 acc0[ROWS], acc1[ROWS];
  for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wf0 = load8_int8_as_float(w0 + k), wf1 = load8_int8_as_float(w1 + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(xv, wf0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(xv, wf1, acc1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    out0[r] = hsum256(acc0[r]) + scalar_dot_tail<ROWS>(x + r * ldx, w0, k, K);
    out1[r] = hsum256(acc1[r]) + scalar_dot_tail<ROWS>(x + r * ldx, w1, k, K);
  }
}

// 16 int8 weights widened to 16 floats.
__attribute__((target("avx512f"))) inline __m512 load16_int8_as_float(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// out[i] = dot(x[:], w[i * K:][:K]) for W_ROWS consecutive weight rows and one row of x, 16 weights per
// AVX-512 step: at decode sizes the AVX2 loop is bound by widening int8 to float (one shuffle-port
// op per 8 weights), and here each x load feeds W_ROWS independent FMA chains.
template <int W_ROWS>
__attribute__((target("avx512f"))) void gemv_rows_avx512(const float* x, const int8_t* w, int64_t K, float* out) {
  __m512 acc[W_ROWS];
  for (int i = 0; i < W_ROWS; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int i = 0; i < W_ROWS; ++i) acc[i] = _mm512_fmadd_ps(xv, load16_int8_as_float(w + i * K + k), acc[i]);
  }
  for (int i = 0; i < W_ROWS; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + scalar_dot_tail<1>(x, w + i * K, k, K);
}

// gemv_pair_avx2 at 16 weights per step: 4+ rows of x are bound by FMAs and int8 widening, not bytes.
template <int ROWS>
__attribute__((target("avx512f"))) void gemv_pair_avx512(const float* x, int64_t ldx, const int8_t* w0,
                                                          const int8_t* w1, int64_t K, float* out0, float* out1) {
  __m512 acc0[ROWS], acc1[ROWS];
  for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 wf0 = load16_int8_as_float(w0 + k), wf1 = load16_int8_as_float(w1 + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      acc0[r] = _mm512_fmadd_ps(xv, wf0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(xv, wf1, acc1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    out0[r] = _mm512_reduce_add_ps(acc0[r]) + scalar_dot_tail<ROWS>(x + r * ldx, w0, k, K);
    out1[r] = _mm512_reduce_add_ps(acc1[r]) + scalar_dot_tail<ROWS>(x + r * ldx, w1, k, K);
  }
}
#endif

template <int ROWS>
void gemv_block(CpuIsa isa, const float* x, int64_t ldx, const int8_t* w, int64_t K, float* out) {
#ifdef GPTFAST_HAVE_AVX2_PATH
  if (isa >= CpuIsa::avx2) return gemv_block_avx2<ROWS>(x, ldx, w, K, out);
#endif
  gemv_block_scalar<ROWS>(x, ldx, w, K, out);
}

// The GEMV's epilogue: output feature n's scale and bias (none: bias == nullptr) applied to a dot product.
struct Epilogue {
  const float* scales;
  const float* bias;
  float operator()(float dot, int64_t n) const { return dot * scales[n] + (bias ? bias[n] : 0.f); }
};

// y[m, n] (rows ldy apart) for rows m_begin .. M of x [M, K] and one weight row w_row (output
// feature n), in blocks of up to GEMV_ROW_BLOCK rows, on instruction set isa's path.
void gemv_rows(CpuIsa isa, const float* x, int64_t M, int64_t K, int64_t m_begin, const int8_t* w_row,
               int64_t n, const Epilogue& epilogue, float* y, int64_t ldy) {
  float partial[GEMV_ROW_BLOCK];
  for (int64_t m = m_begin; m < M; m += GEMV_ROW_BLOCK) {
    const int64_t rows = std::min<int64_t>(GEMV_ROW_BLOCK, M - m);
    const float* x_rows = x + m * K;
    switch (rows) {
      case 4: gemv_block<4>(isa, x_rows, K, w_row, K, partial); break;
      case 3: gemv_block<3>(isa, x_rows, K, w_row, K, partial); break;
      case 2: gemv_block<2>(isa, x_rows, K, w_row, K, partial); break;
      default: gemv_block<1>(isa, x_rows, K, w_row, K, partial); break;
    }
    for (int64_t r = 0; r < rows; ++r) y[(m + r) * ldy + n] = epilogue(partial[r], n);
  }
}

// y[m, n] (rows ldy apart) = (x[m, :] . w[n, :]) * scale + bias for the M rows of x [M, K] and
// output features n_begin .. n_end - 1 (w: all N weight rows, K apart). Each output feature takes
// the same arithmetic wherever the range starts or ends (a last odd weight row runs through the
// paired or grouped kernel too), so results do not depend on how N is split among threads.
void gemv_range(CpuIsa isa, const float* x, int64_t M, int64_t K, const int8_t* w, const Epilogue& epilogue,
                float* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
#ifdef GPTFAST_HAVE_AVX2_PATH
  // Fewer rows than a block: AVX-512, four weight rows at a time for each row of x, then one.
  if (M < GEMV_ROW_BLOCK && isa == CpuIsa::avx512) {
    float partial[AVX512_WEIGHT_ROWS];
    for (; n < n_end; n += AVX512_WEIGHT_ROWS) {
      const int64_t group = std::min(AVX512_WEIGHT_ROWS, n_end - n);
      for (int64_t m = 0; m < M; ++m) {
        if (group == AVX512_WEIGHT_ROWS) {
          gemv_rows_avx512<AVX512_WEIGHT_ROWS>(x + m * K, w + n * K, K, partial);
        } else {
          for (int64_t i = 0; i < group; ++i) gemv_rows_avx512<1>(x + m * K, w + (n + i) * K, K, partial + i);
        }
        for (int64_t i = 0; i < group; ++i) y[m * ldy + n + i] = epilogue(partial[i], n + i);
      }
    }
  }
  // With a full block of rows, two weight rows at a time (see gemv_pair_avx2); an odd last one as
  // both rows of a pair.
  if (M >= GEMV_ROW_BLOCK && isa >= CpuIsa::avx2) {
    float partial0[GEMV_ROW_BLOCK], partial1[GEMV_ROW_BLOCK];
    for (; n < n_end; n += 2) {
      const bool pair = n + 1 < n_end;
      const int8_t* w0 = w + n * K;
      const int8_t* w1 = pair ? w0 + K : w0;
      int64_t m = 0;
      for (; m + GEMV_ROW_BLOCK <= M; m += GEMV_ROW_BLOCK) {
        if (isa == CpuIsa::avx512) {
          gemv_pair_avx512<GEMV_ROW_BLOCK>(x + m * K, K, w0, w1, K, partial0, partial1);
        } else {
          gemv_pair_avx2<GEMV_ROW_BLOCK>(x + m * K, K, w0, w1, K, partial0, partial1);
        }
        for (int64_t r = 0; r < GEMV_ROW_BLOCK; ++r) {
          y[(m + r) * ldy + n] = epilogue(partial0[r], n);
          if (pair) y[(m + r) * ldy + n + 1] = epilogue(partial1[r], n + 1);
        }
      }
      gemv_rows(isa, x, M, K, m, w0, n, epilogue, y, ldy);  // the last M % GEMV_ROW_BLOCK rows
      if (pair) gemv_rows(isa, x, M, K, m, w1, n + 1, epilogue, y, ldy);
    }
  }
#endif
  for (; n < n_end; ++n) gemv_rows(isa, x, M, K, 0, w + n * K, n, epilogue, y, ldy);
}

// y_f32 [M, N] = (x_f32 [M, K] @ qweight^T) * scales + bias, the scale and bias applied as each
// dot product is stored (no passes over y afterwards: at decode sizes those cost as much as the
// dot products).
void gemv(CpuIsa isa, const at::Tensor& x_f32, const at::Tensor& qweight, const Epilogue& epilogue,
          at::Tensor& y_f32) {
  const int64_t M = x_f32.size(0), K = x_f32.size(1), N = qweight.size(0);
  const float* x = x_f32.data_ptr<float>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  float* y = y_f32.data_ptr<float>();
  at::parallel_for(0, N, GEMV_GRAIN_N, [&](int64_t n_begin, int64_t n_end) {
    gemv_range(isa, x, M, K, w, epilogue, y, N, n_begin, n_end);
  });
}

// The packed GEMM's build for M rows of x on instruction set isa, if it should take them: the AVX-512
// build needs AVX-512BW too (its byte transposes), else the AVX2 one serves an AVX-512F CPU.
enum class GemmBuild { none, avx2, avx512 };
GemmBuild gemm_build(CpuIsa isa, int64_t M) {
  static const bool has_avx512bw = __builtin_cpu_supports("avx512bw");
  if (isa == CpuIsa::avx512 && has_avx512bw) return M >= GEMM_MIN_ROWS_AVX512 ? GemmBuild::avx512 : GemmBuild::none;
  if (isa >= CpuIsa::avx2) return M >= GEMM_MIN_ROWS_AVX2 && M <= GEMV_MAX_ROWS ? GemmBuild::avx2 : GemmBuild::none;
  return GemmBuild::none;
}

// One product y = (x_f32 [M, K] @ w [N, K]^T) * scales + bias for the packed GEMM
// (csrc/cpu/int8_gemm_kernel.h), K > 0: x copied into the tiles' blocks of rows, y [M, whole panels]
// float32 (bias converted and held here). w and scales must outlive run_packed.
struct PackedProduct {
  at::Tensor x_blocks, y, bias_f32;
  cpu::Int8GemmArgs args;
  int64_t panels, blocks;

  // [M, N] float32: y, or a view of it without the last panel's padding.
  at::Tensor result() const { return y.size(1) == args.N ? y : y.narrow(1, 0, args.N); }
};

PackedProduct packed_product(GemmBuild build, const at::Tensor& x_f32, const int8_t* w, const float* scales,
                             const std::optional<at::Tensor>& bias, int64_t N) {
  const bool avx512 = build == GemmBuild::avx512;
  const int64_t panel = avx512 ? cpu::INT8_GEMM_PANEL_AVX512 : cpu::INT8_GEMM_PANEL_AVX2;
  const int64_t rows = avx512 ? cpu::INT8_GEMM_ROWS_AVX512 : cpu::INT8_GEMM_ROWS_AVX2;
  const int64_t M = x_f32.size(0), K = x_f32.size(1);
  PackedProduct product;
  product.blocks = (M + rows - 1) / rows;
  product.panels = (N + panel - 1) / panel;
  // x in blocks of `rows` rows, each [K][rows]: a tile's numbers at one k are adjacent (one stream,
  // not `rows` rows K apart, which share L1 sets when K * 4 is a multiple of 4 KiB)
  product.x_blocks = at::constant_pad_nd(x_f32, {0, 0, 0, product.blocks * rows - M})
                         .view({product.blocks, rows, K}).transpose(1, 2).contiguous();
  product.y = at::empty({M, product.panels * panel}, x_f32.options());
  product.bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  product.args = cpu::Int8GemmArgs{product.x_blocks.data_ptr<float>(), w, scales,
                                   product.bias_f32.defined() ? product.bias_f32.data_ptr<float>() : nullptr,
                                   product.y.data_ptr<float>(), M, N, K, product.panels * panel};
  return product;
}

// Every product's panels of output features in one parallel loop; with fewer panels in all than
// threads, each product's blocks of rows of x are split among threads too (each part then widens its
// panels' weights again). The split changes no bits.
void run_packed(GemmBuild build, const std::vector<PackedProduct>& products) {
  const cpu::Int8GemmPanelsFn panels_fn =
      build == GemmBuild::avx512 ? &cpu::int8_gemm_panels_avx512 : &cpu::int8_gemm_panels_avx2;
  const int64_t threads = at::get_num_threads();
  int64_t all_panels = 0;
  for (const PackedProduct& product : products) all_panels += product.panels;
  std::vector<int64_t> parts, first_item{0};  // per product: row parts, and its first work item
  for (const PackedProduct& product : products) {
    parts.push_back(all_panels >= threads ? 1 : std::min(product.blocks, (threads + all_panels - 1) / all_panels));
    first_item.push_back(first_item.back() + product.panels * parts.back());
  }
  at::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    const auto scratch = std::make_unique<float[]>(cpu::int8_gemm_scratch_floats());
    size_t i = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {  // (product i, panel, part of its row blocks)
      while (item >= first_item[i + 1]) ++i;
      const int64_t local = item - first_item[i], p = local / parts[i], part = local % parts[i];
      const int64_t blocks = products[i].blocks;
      panels_fn(products[i].args, p, p + 1, part * blocks / parts[i], (part + 1) * blocks / parts[i], scratch.get());
    }
  });
}

void gemm_unscaled(const at::Tensor& x_f32, const at::Tensor& qweight, at::Tensor& y_f32) {
  const int64_t N = qweight.size(0);
  for (int64_t n0 = 0; n0 < N; n0 += PREFILL_TILE_N) {
    const int64_t n1 = std::min(N, n0 + PREFILL_TILE_N);
    const at::Tensor w_tile = qweight.slice(0, n0, n1).to(at::kFloat);
    y_f32.slice(1, n0, n1).copy_(at::mm(x_f32, w_tile.t()));
  }
}

// The GEMV and dequantise-and-GEMM paths (the packed GEMM's products go through run_packed):
// inputs already checked, y in x's dtype.
at::Tensor int8_linear_unpacked(CpuIsa isa, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = qweight.size(0);
  const at::Tensor x_f32 = x.to(at::kFloat).contiguous();
  at::Tensor y_f32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M <= GEMV_MAX_ROWS) {
    const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
    const Epilogue epilogue{scales.data_ptr<float>(), bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
    if (M > 0 && N > 0) gemv(isa, x_f32, qweight, epilogue, y_f32);
  } else {
    gemm_unscaled(x_f32, qweight, y_f32);
    y_f32.mul_(scales);
    if (bias.has_value()) y_f32.add_(bias->to(at::kFloat));
  }
  return y_f32.to(x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> int8_linear_cpu_many(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& qweights,
                                             const std::vector<at::Tensor>& scales,
                                             const std::vector<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(xs.size() == qweights.size() && xs.size() == scales.size() && xs.size() == biases.size(),
              "int8_linear_cpu_many: one qweight, scales and bias per x");
  const CpuIsa isa = cpu_isa();  // once per call: every product and output feature takes the same path
  std::vector<at::Tensor> results(xs.size());
  std::vector<PackedProduct> products;
  std::vector<size_t> product_of;  // which result each product is
  GemmBuild build = GemmBuild::none;
  for (size_t i = 0; i < xs.size(); ++i) {
    check_int8_linear_inputs(xs[i], qweights[i], scales[i], biases[i]);
    const int64_t M = xs[i].size(0), N = qweights[i].size(0), K = xs[i].size(1);
    const GemmBuild own = gemm_build(isa, M);
    if (own == GemmBuild::none || N == 0 || K == 0) {
      results[i] = int8_linear_unpacked(isa, xs[i], qweights[i], scales[i], biases[i]);
      continue;
    }
    build = own;  // the same for every M the GEMM takes on this isa
    products.push_back(packed_product(own, xs[i].to(at::kFloat), qweights[i].data_ptr<int8_t>(),
                                      scales[i].data_ptr<float>(), biases[i], N));
    product_of.push_back(i);
  }
  if (!products.empty()) run_packed(build, products);
  for (size_t j = 0; j < products.size(); ++j) {
    results[product_of[j]] = products[j].result().to(xs[product_of[j]].scalar_type()).contiguous();
  }
  return results;
}

int64_t int8_linear_cpu_gemv_rows(CpuIsa isa) {
  int64_t rows = 0;
  while (rows < GEMV_MAX_ROWS && gemm_build(isa, rows + 1) == GemmBuild::none) ++rows;
  return rows;
}

void int8_gemv_cpu(CpuIsa isa, const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales,
                   const float* bias, float* y, int64_t ldy, int64_t n_begin, int64_t n_end) {
  gemv_range(isa, x, M, K, w, Epilogue{scales, bias}, y, ldy, n_begin, n_end);
}

void check_int8_linear_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_linear";
  GPTFAST_CHECK_DIM(op, x, 2);
  GPTFAST_CHECK_DIM(op, qweight, 2);
  GPTFAST_CHECK_FLOATING(op, x);
  GPTFAST_CHECK_DTYPE(op, qweight, at::kChar);
  GPTFAST_CHECK_DTYPE(op, scales, at::kFloat);
  GPTFAST_CHECK_SIZE(op, x, 1, qweight.size(1));
  GPTFAST_CHECK_SIZE(op, scales, 0, qweight.size(0));
  GPTFAST_CHECK_CONTIGUOUS(op, qweight);
  GPTFAST_CHECK_CONTIGUOUS(op, scales);
  GPTFAST_CHECK_DEVICE(op, qweight, x.device());
  GPTFAST_CHECK_DEVICE(op, scales, x.device());
  if (bias.has_value()) {
    GPTFAST_CHECK_SIZE(op, (*bias), 0, qweight.size(0));
    GPTFAST_CHECK_DTYPE(op, (*bias), x.scalar_type());
    GPTFAST_CHECK_CONTIGUOUS(op, (*bias));
    GPTFAST_CHECK_DEVICE(op, (*bias), x.device());
  }
}

// x [M, K] (any float dtype), qweight [N, K] int8, scales [N] float32, bias [N] (x's dtype) or
// none, all contiguous and on the CPU -> [M, N] in x's dtype.
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias) {
  return int8_linear_cpu_many({x}, {qweight}, {scales}, {bias})[0];
}

// Symmetric per-output-channel quantisation, written with ATen ops so it serves every device.
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight) {
  constexpr const char* op = "quantize_int8";
  GPTFAST_CHECK_DIM(op, weight, 2);
  GPTFAST_CHECK_FLOATING(op, weight);
  const at::Tensor w = weight.to(at::kFloat);
  const at::Tensor amax = std::get<0>(w.abs().max(1));
  const at::Tensor scales = at::where(amax > 0, amax / 127.0, at::ones_like(amax));
  const at::Tensor qweight =
      at::clamp(at::round(w / scales.unsqueeze(1)), -127, 127).to(at::kChar);
  return {qweight, scales};
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("quantize_int8(Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CompositeExplicitAutograd, m) {
  m.impl("quantize_int8", &quantize_int8);
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("int8_linear", &int8_linear_cpu);
}

}  // namespace gptfast_kernels
