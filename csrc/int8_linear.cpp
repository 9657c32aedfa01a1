// int8 weight-only linear: schemas for quantize_int8 / int8_linear and their CPU kernels.
//
//   y[m, n] = (sum_k x[m, k] * qweight[n, k]) * scales[n] + bias[n], accumulated in float32.
//
// Three paths, by rows of x and the CPU's instruction set (cpu_isa(), common.h), each kernel compiled
// once per instruction set (csrc/cpu/int8_linear_{avx512,avx2,baseline}.cpp):
// - Few rows (decode): the GEMV of csrc/cpu/int8_gemv_kernel.h, which streams each int8 weight row once
//   and widens it in registers for a block of rows of x; multithreaded over output features.
// - From GEMM_MIN_ROWS_AVX512 / _AVX2 rows (batched decode, verification, short prefills): the packed
//   GEMM of csrc/cpu/int8_gemm_kernel.h, which widens each weight once per call instead of once per
//   block of rows, and is multiply-add bound like a float32 BLAS GEMM.
// - Otherwise above GEMV_MAX_ROWS (the baseline build, AVX2 prefill, and AVX-512 prefill above
//   GEMM_MAX_ROWS_AVX512): dequantise PREFILL_TILE_N weight rows at a time to float32 and hand each
//   tile to the BLAS GEMM.
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "common.h"
#include "cpu/int8_linear_cpu.h"

namespace gptfast_kernels {
namespace {

// Largest M served by the GEMV kernel or the AVX2 packed GEMM; above it the dequantise-and-GEMM path
// wins. Measured on the 2-core AVX2 EPYC, K = N = 4096, caches flushed, GEMV vs GEMM ms: M = 17 4.7
// vs 12.0, 40 10.6 vs 13.9, 64 15.8 vs 18.1, 96 24.4 vs 24.0, 128 33.0 vs 29.5 (the paired-row GEMV
// moved it from ~16).
constexpr int64_t GEMV_MAX_ROWS = 64;
// Fewest rows of x the packed GEMM takes. Measured on the 2-core Sapphire Rapids VM, caches flushed,
// GEMV (blocks of 4 x 4 weights on AVX-512, 4 x 2 on AVX2) vs GEMM ms, two runs 10 % apart:
// - AVX-512 at 4096 x 4096: M = 5 1.16-1.18 vs 1.36-1.75, 8 1.49-1.57 vs 1.72-2.07, 12 2.15-2.16 vs
//   2.18-2.67, 16 2.78-2.87 vs 2.65-3.13, 24 4.13 vs 3.88; at 14336 x 4096: 12 7.12 vs 8.72, 16 10.1
//   vs 10.3, 20 12.3 vs 11.5; at 2048 x 512 (an expert): 5 0.14 vs 0.17, 8 0.17 vs 0.17, 12 0.24 vs
//   0.20, 16 0.30 vs 0.24.
// - AVX2 at 4096 x 4096: M = 12 4.04 vs 4.08, 16 5.36 vs 5.17, 24 7.97 vs 6.73.
constexpr int64_t GEMM_MIN_ROWS_AVX512 = 12;
constexpr int64_t GEMM_MIN_ROWS_AVX2 = 16;
// Most rows of x the AVX-512 packed GEMM takes: the packed GEMM blocks x by rows only, so every
// panel of output features streams all of x again, and a long prompt's x outgrows the caches; the
// BLAS GEMM over dequantised tiles (whose dequantisation costs about a tenth) then wins. Measured on
// the 2-core Sapphire Rapids VM, packed vs dequantised tiles, ms (best of 3): 4096 x 4096 at M = 256
// 31.9 vs 35.0, 384 53.5 vs 50.5, 512 68.2 vs 64.5, 1024 143 vs 125; 14336 x 4096: 256 107 vs 124,
// 384 168 vs 173, 512 235 vs 230, 1024 515 vs 450; 4096 x 14336: 384 170 vs 171, 512 250 vs 228,
// 1024 848 vs 442; 2048 x 2048: 256 8.2 vs 9.0, 512 18.5 vs 17.4, 1024 39.2 vs 32.4.
constexpr int64_t GEMM_MAX_ROWS_AVX512 = 384;
// Output features per at::parallel_for work item in the GEMV kernel.
constexpr int64_t GEMV_GRAIN_N = 64;
// Weight rows dequantised per GEMM call in the prefill path (256 x 4096 fp32 = 4 MiB, L3-resident).
constexpr int64_t PREFILL_TILE_N = 256;

// The GEMV's build (csrc/cpu/int8_gemv_kernel.h) for instruction set isa.
cpu::Int8GemvFn gemv_build(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512: return &cpu::int8_gemv_avx512;
    case CpuIsa::avx2: return &cpu::int8_gemv_avx2;
    default: return &cpu::int8_gemv_baseline;
  }
}

// y_f32 [M, N] = (x_f32 [M, K] @ qweight^T) * scales + bias, the scale and bias applied as each
// dot product is stored (no passes over y afterwards: at decode sizes those cost as much as the
// dot products).
void gemv(CpuIsa isa, const at::Tensor& x_f32, const at::Tensor& qweight, const float* scales, const float* bias,
          at::Tensor& y_f32) {
  const cpu::Int8GemvArgs args{x_f32.data_ptr<float>(), qweight.data_ptr<int8_t>(), scales, bias,
                               y_f32.data_ptr<float>(), x_f32.size(0), x_f32.size(1), qweight.size(0)};
  const cpu::Int8GemvFn gemv_fn = gemv_build(isa);
  at::parallel_for(0, qweight.size(0), GEMV_GRAIN_N,
                   [&](int64_t n_begin, int64_t n_end) { gemv_fn(args, n_begin, n_end); });
}

// The packed GEMM's build for M rows of x on instruction set isa, if it should take them.
enum class GemmBuild { none, avx2, avx512 };
GemmBuild gemm_build(CpuIsa isa, int64_t M) {
  if (isa == CpuIsa::avx512) {
    return M >= GEMM_MIN_ROWS_AVX512 && M <= GEMM_MAX_ROWS_AVX512 ? GemmBuild::avx512 : GemmBuild::none;
  }
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

// y_f32 [M, N] = (x_f32 @ qweight^T) * scales + bias_f32 (undefined: none): PREFILL_TILE_N weight rows
// at a time dequantised into one reused float32 tile, whose product the BLAS GEMM writes straight into
// y's columns, scaled and biased while they are still in cache.
void gemm_tiled(const at::Tensor& x_f32, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& bias_f32, at::Tensor& y_f32) {
  const int64_t N = qweight.size(0);
  at::Tensor tile = at::empty({std::min(N, PREFILL_TILE_N), qweight.size(1)}, x_f32.options());
  for (int64_t n0 = 0; n0 < N; n0 += PREFILL_TILE_N) {
    const int64_t n1 = std::min(N, n0 + PREFILL_TILE_N);
    at::Tensor w_tile = tile.narrow(0, 0, n1 - n0);
    w_tile.copy_(qweight.slice(0, n0, n1));
    at::Tensor y_columns = y_f32.slice(1, n0, n1);
    at::mm_out(y_columns, x_f32, w_tile.t());
    y_columns.mul_(scales.slice(0, n0, n1));
    if (bias_f32.defined()) y_columns.add_(bias_f32.slice(0, n0, n1));
  }
}

// The GEMV and dequantise-and-GEMM paths (the packed GEMM's products go through run_packed):
// inputs already checked, y in x's dtype.
at::Tensor int8_linear_unpacked(CpuIsa isa, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = qweight.size(0);
  const at::Tensor x_f32 = x.to(at::kFloat).contiguous();
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  at::Tensor y_f32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M <= GEMV_MAX_ROWS) {
    if (M > 0 && N > 0) {
      gemv(isa, x_f32, qweight, scales.data_ptr<float>(), bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr,
           y_f32);
    }
  } else {
    gemm_tiled(x_f32, qweight, scales, bias_f32, y_f32);
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
  gemv_build(isa)(cpu::Int8GemvArgs{x, w, scales, bias, y, M, K, ldy}, n_begin, n_end);
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
  GPTFAST_CHECK_DIM(op, scales, 1);
  GPTFAST_CHECK_SIZE(op, scales, 0, qweight.size(0));
  GPTFAST_CHECK_CONTIGUOUS(op, qweight);
  GPTFAST_CHECK_CONTIGUOUS(op, scales);
  GPTFAST_CHECK_DEVICE(op, qweight, x.device());
  GPTFAST_CHECK_DEVICE(op, scales, x.device());
  if (bias.has_value()) {
    GPTFAST_CHECK_DIM(op, (*bias), 1);
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
  TORCH_CHECK(weight.size(1) > 0, op, ": weight must have at least one input feature (K >= 1), got shape ",
              weight.sizes());
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
