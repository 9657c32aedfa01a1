// int8_linear's tensor-core kernel (fp16 / bf16 activations, K % 16 == 0, sm_80+), for 2 or more rows
// of x (batched decode, speculative verification, prefill) in three block layouts below;
// int8_linear.cu launches it.
//
// mma.sync m16n8k16 with fp32 accumulators: A = 16 weight rows (output features) x 16 k, B = 16 k x
// 8 rows of x, D = 16 features x 8 rows. int8 -> fp16 / bf16 is exact (|q| <= 128) and so is every
// product, as in the fp32 FMA path; the fp32 sums run in another order, so a row of x can come out
// a few ulps different from the same row in a one-row (FMA GEMV) call.
//
// Fragment order (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4 g + t holds A rows g and
// g + 8 at k pairs {2t, 2t+1} and {2t+8, 2t+9}, B column g at the same k pairs, and D rows g, g + 8
// at columns 2t, 2t + 1. A dot product does not care which k a fragment slot stands for as long as
// A and B agree, so every lane loads 16 contiguous weights of its rows (one 16-byte load per row)
// and the 16 matching activations (two 16-byte loads), and the four m16n8k16 steps of a 64-wide k
// chunk each take 4 of them: in step s, slots 2t, 2t+1 hold the lane's elements 4s, 4s+1 and slots
// 2t+8, 2t+9 its elements 4s+2, 4s+3. Weights go from global memory to registers to tensor cores
// with no shared memory, no ldmatrix and no shuffles.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace gptfast_kernels {
namespace int8_tensor_core {

constexpr int64_t MMA_CHUNK_K = 64;  // k per chunk: 4 lanes x 16 elements

// How one block of the tensor-core kernel is laid out. A warp computes FT x 16 features for RT x 8
// rows; WARPS_N x WARPS_M warps tile the block's outputs, and WARPS_K warps split K between them
// (their partial sums meet in shared memory). Each warp keeps STAGE chunks in flight while it
// multiplies the previous STAGE (register double buffering). STREAM_WEIGHTS loads weights past L1:
// in the GEMV layout no other warp reads them again, and L1 is better spent on x.
template <int FT_, int RT_, int WARPS_N_, int WARPS_M_, int WARPS_K_, int STAGE_, bool STREAM_WEIGHTS_>
struct MmaTiling {
  static constexpr int FT = FT_, RT = RT_, STAGE = STAGE_;
  static constexpr int WARPS_N = WARPS_N_, WARPS_M = WARPS_M_, WARPS_K = WARPS_K_;
  static constexpr int WARPS = WARPS_N * WARPS_M * WARPS_K;
  static constexpr int64_t BLOCK_N = FT * 16 * WARPS_N, BLOCK_M = RT * 8 * WARPS_M;
  static constexpr bool STREAM_WEIGHTS = STREAM_WEIGHTS_;
};
// Decode, 2..16 rows of x: the weight stream is the cost. 8 warps split K for one group of 16 or 32
// features (by N: dispatch_mma_gemv in int8_linear.cu), so N = 4096 still makes 256 blocks for 132
// SMs and a block reads x once per 16-32 weight rows. Two chunks per stage: 2-4 KiB of weights in
// flight per warp. Reasoned from H100's figures; timed on the H200 (a284fc8, layers in a graph):
// 4-8 rows of 4096 x 4096 8.2 us (7.2 with programmatic launches), 1.6x bf16 F.linear; 4-16 rows of
// 14336 x 4096 28.3-32.4 us, behind Triton's 21 us there (auto picks Triton).
constexpr int MMA_GEMV_WARPS_K = 8;
constexpr int MMA_GEMV_STAGE = 2;
template <int FT, int RT>
using MmaGemvTiling = MmaTiling<FT, RT, 1, 1, MMA_GEMV_WARPS_K, MMA_GEMV_STAGE, true>;
// Skinny, 17..64 rows (speculative verification of several rows, short prompts): the prefill
// layout would make only N / 64 blocks (64 at N = 4096). Instead 16 features x 64 rows per block of
// 8 warps: 4 warps along the rows (they share each weight chunk through L1) times 2 splitting K,
// so N = 4096 makes 256 blocks. Reasoned, not yet timed.
using MmaSkinnyTiling = MmaTiling<1, 2, 1, 4, 2, 2, false>;
// Prefill: 64 x 64 outputs per block of 4 warps (32 x 32 each); x and weight chunks are shared
// through L1 by the two warps on the same rows / features, and through L2 by the blocks that run
// together: blockIdx.x walks the row tiles, so consecutive blocks share one feature tile. Reasoned,
// not yet timed (about 160 registers a thread: 3 blocks per SM).
using MmaPrefillTiling = MmaTiling<2, 4, 2, 2, 1, 1, false>;

// 16 bytes of weights that no other warp of the block reads again: skip L1 (ld.global.nc with the
// L1::no_allocate hint) so the activations stay there. Volatile, so that the compiler neither moves it
// above wait_for_inputs (a weight may have just been quantized by the kernel before) nor merges or
// drops it.
__device__ __forceinline__ int4 load_weights_streaming(const int8_t* ptr) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

// Per 16-bit type: four int8 weights (one 32-bit word) -> two packed pairs, {byte 0, byte 1} in
// `lo` and {byte 2, byte 3} in `hi`, the lower-addressed element in the low half (as x's pairs
// sit in memory); and the m16n8k16 instruction.
template <typename scalar_t>
struct MmaOps;

template <>
struct MmaOps<c10::Half> {
  // fp16 0x64XX is 1024 + XX exactly (the ulp at 1024 is 1): one PRMT builds two of them from the
  // biased bytes b + 128 and one packed subtract of 1152 leaves b.
  static __device__ __forceinline__ void widen(uint32_t word, uint32_t& lo, uint32_t& hi) {
    constexpr uint32_t MAGIC = 0x64646464u;
    constexpr uint32_t BIAS = 0x64806480u;  // fp16x2 {1152, 1152}
    const uint32_t biased = word ^ 0x80808080u;
    const uint32_t l = __byte_perm(biased, MAGIC, 0x4140);  // bytes [b0, 0x64, b1, 0x64]
    const uint32_t h = __byte_perm(biased, MAGIC, 0x4342);  // bytes [b2, 0x64, b3, 0x64]
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(l), "r"(BIAS));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(h), "r"(BIAS));
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct MmaOps<c10::BFloat16> {
  // bf16 has too few mantissa bits for the fp16 trick (its exponent's lowest bit is a byte's top
  // bit), so each byte b is split: bf16 0x43XX with XX's top bit cleared is 128 + (b & 0x7f), with
  // only that bit kept 128 or, for b < 0, 256; one packed FMA, (the second) x -1 + (the first),
  // leaves b exactly. Per 4 weights: 2 PRMT, 4 LOP3, 2 FMA (the fp32 route, kept in the upper halves
  // of biased_int8_to_float's floats, took a XOR, 4 PRMT + 4 FADD and 2 PRMT to pack).
  static __device__ __forceinline__ uint32_t split_sub(uint32_t pair) {
    constexpr uint32_t MINUS_ONE = 0xbf80bf80u;  // bf16x2 {-1, -1}
    uint32_t out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(pair & 0xff80ff80u), "r"(MINUS_ONE), "r"(pair & 0xff7fff7fu));
    return out;
  }
  static __device__ __forceinline__ void widen(uint32_t word, uint32_t& lo, uint32_t& hi) {
    constexpr uint32_t EXPONENTS = 0x43434343u;
    lo = split_sub(__byte_perm(word, EXPONENTS, 0x4140));  // bytes [b0, 0x43, b1, 0x43]
    hi = split_sub(__byte_perm(word, EXPONENTS, 0x4342));  // bytes [b2, 0x43, b3, 0x43]
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// Requires K % 16 == 0 and 16-byte aligned qweight, x and x rows (checked by the launcher): a
// lane's 16 elements of a chunk are then all inside K or all outside. blockIdx.x is the row tile,
// blockIdx.y the feature tile.
template <typename scalar_t, typename Tiling>
__global__ void __launch_bounds__(Tiling::WARPS * WARP)
int8_linear_mma_kernel(const scalar_t* __restrict__ x, const int8_t* __restrict__ qweight,
                       const float* __restrict__ scales, const scalar_t* __restrict__ bias,
                       scalar_t* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm,
                       bool programmatic) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int FT = Tiling::FT, RT = Tiling::RT, STAGE = Tiling::STAGE, WARPS_K = Tiling::WARPS_K;
  using Ops = MmaOps<scalar_t>;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int g = lane / 4, t = lane % 4;
  // warp = (warp_m * WARPS_N + warp_n) * WARPS_K + warp_k
  const int warp_k = warp % WARPS_K, tile = warp / WARPS_K;
  const int warp_n = tile % Tiling::WARPS_N, warp_m = tile / Tiling::WARPS_N;
  const int64_t n_warp = static_cast<int64_t>(blockIdx.y) * Tiling::BLOCK_N + warp_n * FT * 16;
  const int64_t m_warp = static_cast<int64_t>(blockIdx.x) * Tiling::BLOCK_M + warp_m * RT * 8;

  // This lane's weight rows (features n_warp + 16 i + 8 h + g) and x rows (m_warp + 8 j + g), at
  // its offset 16 t inside every chunk; null where the row is past N or M (it contributes zeros).
  const int8_t* w_rows[FT][2];
  const scalar_t* x_rows[RT];
#pragma unroll
  for (int i = 0; i < FT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n_warp + 16 * i + 8 * h + g;
      w_rows[i][h] = n < N ? qweight + n * K + 16 * t : nullptr;
    }
#pragma unroll
  for (int j = 0; j < RT; ++j) {
    const int64_t m = m_warp + 8 * j + g;
    x_rows[j] = m < M ? x + m * stride_xm + 16 * t : nullptr;
  }

  struct Stage {
    int4 w[STAGE][FT][2];
    int4 x[STAGE][RT][2];
  };
  const int4 zero = make_int4(0, 0, 0, 0);
  // FULL: the stage lies inside K and every weight row of the warp inside N (warp-uniform), so its
  // weight loads need no tests; x rows past M still read as zeros.
  auto load = [&](auto full, Stage& s, int64_t stage) {
    constexpr bool FULL = decltype(full)::value;
#pragma unroll
    for (int u = 0; u < STAGE; ++u) {
      const int64_t k = (stage * STAGE + u) * MMA_CHUNK_K;
      const bool inside = FULL || k + 16 * t < K;
#pragma unroll
      for (int i = 0; i < FT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int8_t* src = w_rows[i][h];
          if (!FULL && (!inside || src == nullptr)) {
            s.w[u][i][h] = zero;
          } else if constexpr (Tiling::STREAM_WEIGHTS) {
            s.w[u][i][h] = load_weights_streaming(src + k);
          } else {
            s.w[u][i][h] = __ldg(reinterpret_cast<const int4*>(src + k));
          }
        }
#pragma unroll
      for (int j = 0; j < RT; ++j) {
        const bool ok = inside && x_rows[j] != nullptr;
        const int4* src = reinterpret_cast<const int4*>(x_rows[j] + (ok ? k : 0));
        s.x[u][j][0] = ok ? __ldg(src) : zero;
        s.x[u][j][1] = ok ? __ldg(src + 1) : zero;
      }
    }
  };
  const bool warp_rows_inside = n_warp + FT * 16 <= N;
  auto load_stage = [&](Stage& s, int64_t stage) {
    if (warp_rows_inside && (stage + 1) * STAGE * MMA_CHUNK_K <= K) {
      load(std::true_type{}, s, stage);
    } else {
      load(std::false_type{}, s, stage);
    }
  };

  float acc[FT][RT][4];
#pragma unroll
  for (int i = 0; i < FT; ++i)
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
  auto multiply = [&](const Stage& s) {
#pragma unroll
    for (int u = 0; u < STAGE; ++u)
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        // B: the lane's elements 4 step .. 4 step + 3 are 32-bit words 2 step, 2 step + 1 of its 16.
        uint32_t b[RT][2];
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          b[j][0] = word_of(s.x[u][j][step / 2], 2 * (step % 2));
          b[j][1] = word_of(s.x[u][j][step / 2], 2 * (step % 2) + 1);
        }
#pragma unroll
        for (int i = 0; i < FT; ++i) {
          // A: the same elements of rows g (a0, a2) and g + 8 (a1, a3) are word `step` of each load.
          uint32_t a[4];
          Ops::widen(word_of(s.w[u][i][0], step), a[0], a[2]);
          Ops::widen(word_of(s.w[u][i][1], step), a[1], a[3]);
#pragma unroll
          for (int j = 0; j < RT; ++j) Ops::mma(acc[i][j], a, b[j]);
        }
      }
  };

  const int64_t stages = (K + STAGE * MMA_CHUNK_K - 1) / (STAGE * MMA_CHUNK_K);
  // Two register sets in turn (no copy between them): a stage's loads go out before the previous
  // stage's multiplies.
  // Under a programmatic launch L2 fetches the first stage's weights while the kernel before this
  // one finishes (a hint only: the loads themselves come after wait_for_inputs, as x and y do);
  // otherwise the loads follow at once and a prefetch would only add instructions.
  if (programmatic && warp_k < stages) {
#pragma unroll
    for (int u = 0; u < STAGE; ++u) {
      const int64_t k = (static_cast<int64_t>(warp_k) * STAGE + u) * MMA_CHUNK_K;
#pragma unroll
      for (int i = 0; i < FT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (w_rows[i][h] != nullptr && k + 16 * t < K) prefetch_l2(w_rows[i][h] + k);
    }
  }
  wait_for_inputs();
  allow_dependents();  // after the wait (cuda_common.cuh)
  Stage even{}, odd{};
  if (warp_k < stages) load_stage(even, warp_k);
  for (int64_t stage = warp_k; stage < stages; stage += 2 * WARPS_K) {
    if (stage + WARPS_K < stages) load_stage(odd, stage + WARPS_K);
    multiply(even);
    if (stage + WARPS_K >= stages) break;
    if (stage + 2 * WARPS_K < stages) load_stage(even, stage + 2 * WARPS_K);
    multiply(odd);
  }

  if constexpr (WARPS_K > 1) {
    __shared__ float partial[WARPS_K - 1][Tiling::WARPS_N * Tiling::WARPS_M][FT * RT * 4][WARP];
    if (warp_k > 0) {
#pragma unroll
      for (int i = 0; i < FT; ++i)
#pragma unroll
        for (int j = 0; j < RT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) partial[warp_k - 1][tile][(i * RT + j) * 4 + r][lane] = acc[i][j][r];
    }
    __syncthreads();
    if (warp_k > 0) return;
#pragma unroll
    for (int w = 0; w < WARPS_K - 1; ++w)
#pragma unroll
      for (int i = 0; i < FT; ++i)
#pragma unroll
        for (int j = 0; j < RT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[i][j][r] += partial[w][tile][(i * RT + j) * 4 + r][lane];
  }

  // D register r holds feature g + 8 (r / 2) and row 2t + r % 2 of its 16 x 8 tile.
#pragma unroll
  for (int i = 0; i < FT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n_warp + 16 * i + 8 * h + g;
      if (n >= N) continue;
      const float scale = scales[n];
      const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t m = m_warp + 8 * j + 2 * t + e;
          if (m < M) y[m * N + n] = from_float<scalar_t>(acc[i][j][2 * h + e] * scale + b);
        }
    }
#else
  __trap();  // the launcher only picks this kernel on sm_80+
#endif
}

}  // namespace int8_tensor_core
}  // namespace gptfast_kernels
