// int8_linear's GEMV for a few rows of x (decode, and the experts of int8_expert_linear), written once
// over GCC vectors of the CPU's width and compiled per instruction set: int8_linear_{avx512,avx2,
// baseline}.cpp set a target and include this file with GPTFAST_INT8_GEMV naming the function to define.
//
// The weight bytes dominate at decode sizes, so reading 1 byte per weight instead of 4 is the speed-up
// over a float32 GEMV: each weight row is streamed once, widened to float32 in registers and reused
// for a block of up to X_ROWS rows of x; several weight rows are read together so that each vector of
// x loaded feeds several multiply-add chains. With many rows, widening every weight again for each
// block costs more than the packed GEMM's widening once per call (int8_gemm_kernel.h; int8_linear.cpp
// sets from how many rows).
//
// Each sum is LANES multiply-add chains over k in order, added pairwise (reduce_add, simd.h), then the
// last K % LANES products in order, then * scale + bias; the blocks only group sums, so a result does
// not depend on M, on the rows and features beside it, or on how features are split among threads.
//
// Only C headers and internal linkage here (see simd.h for why).
#include <stdint.h>

#include "int8_linear_cpu.h"
#include "simd.h"

#ifndef GPTFAST_INT8_GEMV
#error "define GPTFAST_INT8_GEMV before including int8_gemv_kernel.h"
#endif

namespace gptfast_kernels {
namespace cpu {
namespace {

// Rows of x per block: they share each widened weight vector.
constexpr int X_ROWS = 4;
// Weight rows read together. A block of x_rows rows keeps x_rows x weight_rows(x_rows) registers of
// sums, plus weight_rows widened weights and one vector of x: AVX-512's 32 registers hold 4 x 4 sums,
// 16-register builds 2 x 4 or 4 x 2.
constexpr int W_ROWS = 4;
constexpr int weight_rows(int x_rows) { return LANES == 16 || x_rows <= 2 ? W_ROWS : W_ROWS / 2; }
// Each weight row's lines are prefetched one group of rows ahead (the next group's same line, W_ROWS x
// K bytes on), into every cache level (a non-temporal hint was slower: 13.7-16.4 GB/s below). A row
// of K = 768 is only 12 lines, too few for the hardware prefetcher to lock on before the group moves
// on. Measured on the 2-core Sapphire Rapids VM (its L3 is 260 MiB), one row of x, GB/s of int8
// weights, no prefetch -> prefetch: from DRAM (500 MB of matrices) 768 x 768 11.0 -> 17.3, 2304 x 768
// 11.8 -> 19.2, 768 x 2048 13.4 -> 20.5, 4096 x 4096 19.1 -> 25.2, 4096 x 14336 22.6 -> 26.4; from
// L3 (6 x 4096 x 4096) 31.8 -> 41.8; the 134M Llama's 49 decode-step products (110 MB, L3) 9.5 ->
// 3.1 ms; L2-resident matrices (the demo's) unchanged.
constexpr int64_t PREFETCH_LINE = 64;  // bytes per cache line (x86-64; a guess elsewhere, and harmless)

// dots[r][i] = x[r, :] . w[i, :] for XR rows of x and WR rows of w (both K apart).
template <int XR, int WR>
GPTFAST_INLINE void dot_tile(const float* x, const int8_t* w, int64_t K, float (&dots)[XR][WR]) {
  vfloat acc[XR][WR];
  for (int r = 0; r < XR; ++r)
    for (int i = 0; i < WR; ++i) acc[r][i] = vfloat{};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    if (k % PREFETCH_LINE < LANES) {  // once per line of each row: the next group's same line
      for (int i = 0; i < WR; ++i) __builtin_prefetch(w + (WR + i) * K + k, 0, 3);
    }
    vfloat wf[WR];
    for (int i = 0; i < WR; ++i) wf[i] = widen(w + i * K + k);
    for (int r = 0; r < XR; ++r) {
      const vfloat xv = load_floats(x + r * K + k);
      for (int i = 0; i < WR; ++i) acc[r][i] = mul_add(xv, wf[i], acc[r][i]);
    }
  }
  for (int r = 0; r < XR; ++r) {
    for (int i = 0; i < WR; ++i) {
      float dot = reduce_add(acc[r][i]);
      for (int64_t kk = k; kk < K; ++kk) dot = mul_add(x[r * K + kk], static_cast<float>(w[i * K + kk]), dot);
      dots[r][i] = dot;
    }
  }
}

// y for the XR rows of x from m0 and the WR features from n, each dot product scaled and biased.
template <int XR, int WR>
GPTFAST_INLINE void tile(const Int8GemvArgs& a, int64_t m0, int64_t n) {
  float dots[XR][WR];
  dot_tile<XR, WR>(a.x + m0 * a.K, a.w + n * a.K, a.K, dots);
  for (int r = 0; r < XR; ++r) {
    for (int j = 0; j < WR; ++j) {
      const float bias = a.bias != nullptr ? a.bias[n + j] : 0.f;
      a.y[(m0 + r) * a.ldy + n + j] = dots[r][j] * a.scales[n + j] + bias;
    }
  }
}

// y for the XR rows of x from m0 and the count <= W_ROWS features from n: weight_rows(XR) of them at
// a time, then one.
template <int XR>
void x_block(const Int8GemvArgs& a, int64_t m0, int64_t n, int64_t count) {
  constexpr int WR = weight_rows(XR);
  int64_t i = 0;
  for (; i + WR <= count; i += WR) tile<XR, WR>(a, m0, n + i);
  for (; i < count; ++i) tile<XR, 1>(a, m0, n + i);
}

}  // namespace

// W_ROWS features at a time, each group's weights (W_ROWS x K bytes: L1 or L2) read by every block of
// rows of x before the next group is streamed in.
void GPTFAST_INT8_GEMV(const Int8GemvArgs& a, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; n += W_ROWS) {
    const int64_t count = n_end - n < W_ROWS ? n_end - n : W_ROWS;
    int64_t m = 0;
    for (; m + X_ROWS <= a.M; m += X_ROWS) x_block<X_ROWS>(a, m, n, count);
    switch (a.M - m) {
      case 3: x_block<3>(a, m, n, count); break;
      case 2: x_block<2>(a, m, n, count); break;
      case 1: x_block<1>(a, m, n, count); break;
      default: break;
    }
  }
}

}  // namespace cpu
}  // namespace gptfast_kernels
