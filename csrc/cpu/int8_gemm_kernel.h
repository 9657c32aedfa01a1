// int8_linear's GEMM for more than a few rows of x, written once over GCC vectors of the CPU's width
// and compiled per instruction set: int8_linear_{avx2,avx512}.cpp set a target and include this file
// with GPTFAST_INT8_GEMM_PANELS naming the function to define, GPTFAST_INT8_GEMM_ROWS the rows of x
// per tile and GPTFAST_INT8_GEMM_TRANSPOSE_BYTES the register width of the packing's byte transposes.
//
// The weights are the GEMM's packed operand: a panel of PANEL = 2 x LANES output features is widened
// from int8 to float32 one block of K at a time into a [k][PANEL] buffer (transposed 16 features x
// T_COLS bytes at a time with byte unpacks), which stays in L1 while every block of ROWS rows of x
// (packed by the caller as [k][ROWS]) passes over it. A tile keeps ROWS x 2 registers of sums; each
// step of k loads two weight registers and broadcasts one number of each row of x into them, so the
// loop is multiply-adds with few loads. The GEMV's shuffle-bound widening of every weight for every 4
// rows of x is paid once per weight here.
//
// Each output is one multiply-add chain over k in order (a tile carries its sums across K blocks
// through y exactly), then * scale + bias: the result of a row of x does not depend on the rows
// beside it, on M, or on how panels are split among threads.
//
// Only C headers and internal linkage here (see simd.h for why).
#include <stdint.h>

#include "int8_linear_cpu.h"
#include "simd.h"

#if !defined(GPTFAST_INT8_GEMM_PANELS) || !defined(GPTFAST_INT8_GEMM_ROWS) || \
    !defined(GPTFAST_INT8_GEMM_TRANSPOSE_BYTES)
#error "define GPTFAST_INT8_GEMM_PANELS, _ROWS and _TRANSPOSE_BYTES before including int8_gemm_kernel.h"
#endif

namespace gptfast_kernels {
namespace cpu {
namespace {

constexpr int64_t PANEL = 2 * LANES;                        // output features per panel (two registers)
constexpr int ROWS = static_cast<int>(GPTFAST_INT8_GEMM_ROWS);  // rows of x per tile
constexpr int64_t BLOCK_K = INT8_GEMM_PACK_BYTES / (PANEL * 4);  // k per packed block
// One transpose: 16 features x T_COLS k, as T_COLS / 16 blocks of 16 x 16 bytes side by side (one per
// 16-byte lane of a register: byte unpacks work per lane).
constexpr int64_t T_ROWS = 16, T_COLS = GPTFAST_INT8_GEMM_TRANSPOSE_BYTES;
static_assert(PANEL % T_ROWS == 0 && BLOCK_K % T_COLS == 0, "packing works in whole transposes");

typedef int8_t vbytes __attribute__((vector_size(T_COLS)));  // T_COLS weights of one feature

#if GPTFAST_NATIVE_LANES != 8 && GPTFAST_NATIVE_LANES != 16
#error "int8_gemm_kernel.h is built for AVX2 (8 lanes) and AVX-512 (16 lanes)"
#endif

// Bytes interleaved in each 16-byte lane, as x86's unpack instructions do: each lane's first 8 bytes of
// a and b (a0 b0 a1 b1 ...), or its last 8.
#define GPTFAST_PAIR(i) (i), (i) + T_COLS
#define GPTFAST_LANE_LOW(l)                                                                             \
  GPTFAST_PAIR(16 * (l)), GPTFAST_PAIR(16 * (l) + 1), GPTFAST_PAIR(16 * (l) + 2), GPTFAST_PAIR(16 * (l) + 3), \
      GPTFAST_PAIR(16 * (l) + 4), GPTFAST_PAIR(16 * (l) + 5), GPTFAST_PAIR(16 * (l) + 6), GPTFAST_PAIR(16 * (l) + 7)
#define GPTFAST_LANE_HIGH(l)                                                                                \
  GPTFAST_PAIR(16 * (l) + 8), GPTFAST_PAIR(16 * (l) + 9), GPTFAST_PAIR(16 * (l) + 10), GPTFAST_PAIR(16 * (l) + 11), \
      GPTFAST_PAIR(16 * (l) + 12), GPTFAST_PAIR(16 * (l) + 13), GPTFAST_PAIR(16 * (l) + 14), GPTFAST_PAIR(16 * (l) + 15)
#if GPTFAST_INT8_GEMM_TRANSPOSE_BYTES == 64
GPTFAST_INLINE vbytes interleave_low(vbytes a, vbytes b) {
  return __builtin_shufflevector(a, b, GPTFAST_LANE_LOW(0), GPTFAST_LANE_LOW(1), GPTFAST_LANE_LOW(2), GPTFAST_LANE_LOW(3));
}
GPTFAST_INLINE vbytes interleave_high(vbytes a, vbytes b) {
  return __builtin_shufflevector(a, b, GPTFAST_LANE_HIGH(0), GPTFAST_LANE_HIGH(1), GPTFAST_LANE_HIGH(2),
                                 GPTFAST_LANE_HIGH(3));
}
#elif GPTFAST_INT8_GEMM_TRANSPOSE_BYTES == 32
GPTFAST_INLINE vbytes interleave_low(vbytes a, vbytes b) {
  return __builtin_shufflevector(a, b, GPTFAST_LANE_LOW(0), GPTFAST_LANE_LOW(1));
}
GPTFAST_INLINE vbytes interleave_high(vbytes a, vbytes b) {
  return __builtin_shufflevector(a, b, GPTFAST_LANE_HIGH(0), GPTFAST_LANE_HIGH(1));
}
#else
#error "GPTFAST_INT8_GEMM_TRANSPOSE_BYTES must be 32 or 64"
#endif
#undef GPTFAST_PAIR
#undef GPTFAST_LANE_LOW
#undef GPTFAST_LANE_HIGH

// Transposes the 16 x 16 byte blocks of every lane at once (r[j] holds feature j's k = 16 l .. 16 l + 15
// in lane l; afterwards r[q] holds every feature's k = 16 l + q in lane l).
// Each round maps element (row bits r3 r2 r1 r0, column bits c3 c2 c1 c0) to row r2 r1 r0 c3, column
// c2 c1 c0 r3, a rotation of the eight bits by one; four rounds swap rows and columns.
GPTFAST_INLINE void transpose_16x16_lanes(vbytes* r) {
  for (int round = 0; round < 4; ++round) {
    vbytes t[T_ROWS];
    for (int i = 0; i < T_ROWS / 2; ++i) {
      t[2 * i] = interleave_low(r[i], r[i + T_ROWS / 2]);
      t[2 * i + 1] = interleave_high(r[i], r[i + T_ROWS / 2]);
    }
    for (int i = 0; i < T_ROWS; ++i) r[i] = t[i];
  }
}

// packed[k][j] = w[j][k0 + k] as float for the panel's features j < n_valid (0 past them) and
// k < kc; rows w[j] are K apart. Writes whole transposes (k up to kc rounded up to T_COLS).
void pack_block(const int8_t* w, int64_t K, int64_t n_valid, int64_t k0, int64_t kc, float* packed) {
  for (int64_t j0 = 0; j0 < PANEL; j0 += T_ROWS) {
    for (int64_t k = 0; k < kc; k += T_COLS) {
      const int64_t width = kc - k < T_COLS ? kc - k : T_COLS;
      vbytes r[T_ROWS];
      for (int64_t j = 0; j < T_ROWS; ++j) {
        r[j] = vbytes{};
        if (j0 + j >= n_valid) continue;
        const int8_t* src = w + (j0 + j) * K + k0 + k;
        if (width == T_COLS) __builtin_memcpy(&r[j], src, T_COLS);  // one load, not a call
        else __builtin_memcpy(&r[j], src, width);
      }
      transpose_16x16_lanes(r);
      int8_t bytes[T_ROWS][T_COLS];  // widened from memory: vpmovsxbd reads it directly
      __builtin_memcpy(bytes, r, sizeof(bytes));
      for (int64_t q = 0; q < T_ROWS; ++q) {
        for (int64_t lane = 0; lane < T_COLS / T_ROWS; ++lane) {  // k = q, 16 + q, ...
          for (int64_t l = 0; l < T_ROWS; l += LANES) {
            store_floats(packed + (k + lane * T_ROWS + q) * PANEL + j0 + l, widen(bytes[q] + lane * T_ROWS + l));
          }
        }
      }
    }
  }
}

// What a tile does with its sums after its K block: keep them (more blocks follow) or finish them.
struct TileEnd {
  const float* scale;  // the panel's scales (PANEL floats) on the last block, else null
  const float* bias;   // the panel's bias on the last block, or null
};

// c[i][0..PANEL) (rows ldc apart) += x[i][0..kc) @ packed for R rows of x (x[i][k] at x[k * ROWS + i]); c is
// read unless first, and on the last block multiplied by the scale and the bias added (two
// roundings, as the GEMV does).
template <int R>
void tile(int64_t kc, const float* x, const float* packed, float* c, int64_t ldc, bool first,
          TileEnd end) {
  vfloat acc[R][2];
  for (int i = 0; i < R; ++i) {
    acc[i][0] = first ? vfloat{} : load_floats(c + i * ldc);
    acc[i][1] = first ? vfloat{} : load_floats(c + i * ldc + LANES);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const vfloat w0 = load_floats(packed + k * PANEL), w1 = load_floats(packed + k * PANEL + LANES);
    for (int i = 0; i < R; ++i) {
      const vfloat xv = broadcast(x + k * ROWS + i);
      acc[i][0] = mul_add(xv, w0, acc[i][0]);
      acc[i][1] = mul_add(xv, w1, acc[i][1]);
    }
  }
  if (end.scale != nullptr) {
    for (int h = 0; h < 2; ++h) {
      const vfloat scale = load_floats(end.scale + h * LANES);
      const vfloat bias = end.bias != nullptr ? load_floats(end.bias + h * LANES) : vfloat{};
      for (int i = 0; i < R; ++i) acc[i][h] = acc[i][h] * scale + bias;
    }
  }
  for (int i = 0; i < R; ++i) {
    store_floats(c + i * ldc, acc[i][0]);
    store_floats(c + i * ldc + LANES, acc[i][1]);
  }
}

// tile<rows> for 1 <= rows <= R.
template <int R>
GPTFAST_INLINE void tile_of(int rows, int64_t kc, const float* x, const float* packed, float* c, int64_t ldc,
                            bool first, TileEnd end) {
  if (rows == R) return tile<R>(kc, x, packed, c, ldc, first, end);
  if constexpr (R > 1) tile_of<R - 1>(rows, kc, x, packed, c, ldc, first, end);
}

}  // namespace

void GPTFAST_INT8_GEMM_PANELS(const Int8GemmArgs& a, int64_t p0, int64_t p1, int64_t b0, int64_t b1,
                              float* scratch) {
  const int64_t m_end = b1 * ROWS < a.M ? b1 * ROWS : a.M;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * PANEL;
    const int64_t n_valid = a.N - n0 < PANEL ? a.N - n0 : PANEL;
    float scale[PANEL], bias[PANEL];  // the panel's, zero past N
    for (int64_t j = 0; j < PANEL; ++j) {
      scale[j] = j < n_valid ? a.scales[n0 + j] : 0.f;
      bias[j] = j < n_valid && a.bias != nullptr ? a.bias[n0 + j] : 0.f;
    }
    for (int64_t k0 = 0; k0 < a.K; k0 += BLOCK_K) {
      const int64_t kc = a.K - k0 < BLOCK_K ? a.K - k0 : BLOCK_K;
      pack_block(a.w + n0 * a.K, a.K, n_valid, k0, kc, scratch);
      const bool first = k0 == 0, last = k0 + kc == a.K;
      const TileEnd end{last ? scale : nullptr, last && a.bias != nullptr ? bias : nullptr};
      for (int64_t m0 = b0 * ROWS; m0 < m_end; m0 += ROWS) {
        const int rows = static_cast<int>(m_end - m0 < ROWS ? m_end - m0 : ROWS);
        tile_of<ROWS>(rows, kc, a.x + (m0 * a.K + k0 * ROWS), scratch, a.y + m0 * a.ldy + n0, a.ldy, first, end);
      }
    }
  }
}

}  // namespace cpu
}  // namespace gptfast_kernels
