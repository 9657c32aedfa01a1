// What int8_linear.cpp hands its CPU kernels, which are compiled once per instruction set
// (int8_linear_{avx512,avx2,baseline}.cpp) and chosen at run time (cpu_isa(), common.h): the GEMV
// for a few rows of x (int8_gemv_kernel.h, every build) and the packed GEMM for more
// (int8_gemm_kernel.h, the AVX2 and AVX-512 builds).
//
// Included under those files' `#pragma GCC target`: plain types, constants and functions of internal
// linkage only (see simd.h).
#pragma once

#include <stdint.h>

namespace gptfast_kernels {
namespace cpu {

struct Int8GemmArgs {
  const float* x;       // x [M, K] in blocks of ROWS rows (below), [ceil(M / ROWS)][K][ROWS]: a block's
                        // ROWS numbers at one k are adjacent (rows past M are read as zeros)
  const int8_t* w;      // [N, K], contiguous
  const float* scales;  // [N]
  const float* bias;    // [N] or null
  float* y;             // [M, ldy]; ldy >= N rounded up to whole panels (columns past N are scratch)
  int64_t M, N, K, ldy;
};

// Output features per panel: two registers of floats (AVX-512: 2 x 16, AVX2: 2 x 8).
constexpr int64_t INT8_GEMM_PANEL_AVX512 = 32;
constexpr int64_t INT8_GEMM_PANEL_AVX2 = 16;
// Rows of x per tile: 12 x 2 sums + 2 weight registers of the 32 (AVX-512), 6 x 2 + 2 of the 16 (AVX2).
constexpr int64_t INT8_GEMM_ROWS_AVX512 = 12;
constexpr int64_t INT8_GEMM_ROWS_AVX2 = 6;
// A panel's weights are widened to float32 one block of K at a time into a buffer of this many bytes:
// half of a 32 KiB L1 data cache (Skylake-SP, Zen 2/3; 48 KiB on Sapphire Rapids), which keeps the
// block in L1 while every row of x streams past it.
constexpr int64_t INT8_GEMM_PACK_BYTES = 16 * 1024;

// Floats of scratch a call needs: one packed block.
static constexpr int64_t int8_gemm_scratch_floats() { return INT8_GEMM_PACK_BYTES / 4; }

// y[m, p * panel .. (p + 1) * panel) for panels p0 .. p1 - 1 and the rows m of x's blocks
// b0 .. b1 - 1 (rows b0 * ROWS .. min(M, b1 * ROWS) - 1), K > 0:
//   y[m, n] = (sum_k x[m, k] * w[n, k]) * scales[n] + bias[n],
// each sum one multiply-add chain over k in order, so a row's result does not depend on M, on the
// rows beside it or on how panels and rows are split among threads.
using Int8GemmPanelsFn = void (*)(const Int8GemmArgs& args, int64_t p0, int64_t p1, int64_t b0, int64_t b1,
                                  float* scratch);

void int8_gemm_panels_avx2(const Int8GemmArgs&, int64_t, int64_t, int64_t, int64_t, float*);
void int8_gemm_panels_avx512(const Int8GemmArgs&, int64_t, int64_t, int64_t, int64_t, float*);

struct Int8GemvArgs {
  const float* x;       // [M, K], contiguous
  const int8_t* w;      // [N, K], contiguous
  const float* scales;  // [N]
  const float* bias;    // [N] or null
  float* y;             // [M, ldy]
  int64_t M, K, ldy;
};

// y[m, n] = (sum_k x[m, k] * w[n, k]) * scales[n] + bias[n] for every row m of x and the features
// n_begin .. n_end - 1. Each sum is LANES multiply-add chains over k in order, added pairwise, then the
// last K % LANES products in order: a result does not depend on M, on the rows or features beside it,
// or on how the features are split among threads.
using Int8GemvFn = void (*)(const Int8GemvArgs& args, int64_t n_begin, int64_t n_end);

void int8_gemv_baseline(const Int8GemvArgs&, int64_t, int64_t);
void int8_gemv_avx2(const Int8GemvArgs&, int64_t, int64_t);
void int8_gemv_avx512(const Int8GemvArgs&, int64_t, int64_t);

}  // namespace cpu
}  // namespace gptfast_kernels
