// int8 weight-only linear, CUDA kernels.
//
//   y[m, n] = (sum_k x[m, k] * qweight[n, k]) * scales[n] + bias[n], accumulated in float32.
//
// One row of x (decode, batch 1): memory-bound on the N*K weight bytes. One warp per output
// feature; each lane streams 16 int8 weights per 16-byte load (a warp reads 512 contiguous bytes
// per step), widens them in registers with integer-pipe tricks and FMAs them in fp32.
// 2..16 rows (batched decode, speculative verification), fp16 / bf16: still memory-bound, but fp32
// FMAs per weight byte grow with the rows and overtake the weight stream from about 4 rows (the H100
// run: 4 rows took twice as long as 1). The tensor-core kernel below (mma.sync, weights straight
// from global memory into fragments) makes the rows nearly free; 8 warps split K per feature group.
// More rows, fp16 / bf16: the same tensor-core kernel, 16 x 64 output tiles up to 64 rows and
// 64 x 64 tiles (prefill) above.
// fp32 activations, and inputs the vector loads cannot take (K % 16 != 0, misaligned rows), use
// the FMA GEMV for up to 16 rows and a SIMT tiled kernel above, so fp32 products stay exact fp32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../common.h"
#include "cuda_common.cuh"
#include "int8_linear_tensor_core.cuh"

namespace gptfast_kernels {
namespace {

using namespace int8_tensor_core;

// Largest M served by the GEMV kernel: up to 16 rows the weight stream still dominates.
constexpr int64_t GEMV_MAX_ROWS = 16;
// Warps per GEMV block; each warp owns one output feature (8 warps: 256 threads, enough
// blocks for >= 3 waves on 132 SMs at N = 4096).
constexpr int GEMV_WARPS = 8;
// int8 weights per lane per step: one 16-byte vector load.
constexpr int GEMV_VEC = 16;
// Weight vectors in flight per lane (4 x 16 B); K = 4096 is then two trips of the unrolled loop.
constexpr int GEMV_UNROLL = 4;
// From this many rows of x on, a warp computes two output features, so each x vector read from L1
// serves two weight rows (reasoned from L1's 128 B / clock on sm_90; not yet measured).
constexpr int GEMV_SHARED_X_ROWS = 4;

// SIMT tile for fp32 prefill (and 16-bit inputs the vector loads cannot take): 64 x 64 outputs,
// 256 threads each computing 4 x 4.
constexpr int SIMT_BLOCK = 64;
// Weight bytes per warp that a programmatic launch has L2 fetch before its wait: four trips of the
// default shape. The first wave's blocks then ask for 132 SMs x 5 blocks x 8 warps x 8 KiB = 42 MB
// at most, within an H100's or H200's 50 MB L2. Programmatic launches with it, timed on the H200
// (a284fc8, a decode step's layers in a graph): one row 7.8 -> 7.9 us at 4096 x 4096, 19.3 -> 18.3 us
// at 4096 x 14336; the prefetch's own share was not separated.
constexpr int64_t GEMV_PREFETCH_BYTES = 8 << 10;
constexpr int SIMT_BLOCK_K = 16;
constexpr int SIMT_THREADS = 256;
// CUDA's limit on gridDim.y, which holds the SIMT kernel's row tiles and the tensor-core kernel's
// feature tiles.
constexpr int64_t MAX_GRID_Y = 65535;

// 16 int8 weights -> float without the conversion unit (biased_int8_to_float): I2F runs at 16 per
// clock per SM on sm_80 / sm_90, and streaming int8 weights at full HBM3 bandwidth (~3 TB/s over
// 132 SMs at ~1.75 GHz) needs ~13 per clock.
static_assert(GEMV_VEC == 16, "int8x16_to_float widens one 16-byte vector of weights");
__device__ __forceinline__ void int8x16_to_float(const int4& packed, float* out) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned biased = word_of(packed, w) ^ 0x80808080u;  // each signed byte b -> unsigned b + 128
#pragma unroll
    for (int i = 0; i < 4; ++i) out[4 * w + i] = biased_int8_to_float(biased, i);
  }
}

// One warp computes FEATURES output features for ROWS rows of x; each lane dots a strided share
// of K and the warp reduces. VECTORIZED requires K % 16 == 0 and 16-byte aligned x / qweight rows
// (checked by the launcher). FEATURES > 1 reuses every x vector loaded from L1 for several weight
// rows: with 4+ rows of x, one feature per warp would read ROWS x 2 bytes of x per weight byte,
// more than L1 serves at the HBM3 weight rate.
// PIPELINED (one row's variant "u4p", not the default) issues a trip's weight loads before the
// previous trip's arithmetic, from a second set of registers, so a warp keeps loads in flight while
// it computes.
// STAGED_X (one row, VECTORIZED, K <= STAGED_X_MAX_K): the block first converts the whole x row to
// float32 in shared memory, and every trip reads its 16 activations from there as 4 float4s, instead
// of loading them from L1 and widening them per trip (about 12 instructions per 16 weight bytes
// fewer). The float4s are stored XOR-swizzled (staged_slot) so that a warp's 128-bit reads, each
// lane 64 bytes past the previous one, hit distinct banks.
constexpr int64_t STAGED_X_MAX_K = 8192;  // 32 KiB of floats: five blocks still fit on an SM

__device__ __forceinline__ int staged_slot(int quad) { return quad ^ ((quad >> 3) & 7); }

template <typename scalar_t, int ROWS, int FEATURES, bool VECTORIZED, int UNROLL = GEMV_UNROLL,
          bool PIPELINED = false, bool STAGED_X = false>
__global__ void __launch_bounds__(GEMV_WARPS * WARP)
int8_linear_gemv_kernel(const scalar_t* __restrict__ x, const int8_t* __restrict__ qweight,
                        const float* __restrict__ scales, const scalar_t* __restrict__ bias,
                        scalar_t* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm,
                        int64_t row_offset, int64_t prefetch_bytes) {
  static_assert(!STAGED_X || (ROWS == 1 && VECTORIZED && GEMV_VEC == 16), "x is staged for one vectorized row");
  extern __shared__ float4 staged_x[];  // STAGED_X: x as float, K rounded up to 32
  const int lane = threadIdx.x % WARP;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * GEMV_WARPS + threadIdx.x / WARP) * FEATURES;
  const int features = N - n0 < FEATURES ? static_cast<int>(N - n0) : FEATURES;  // (<= 0: no rows)
  const int8_t* w_rows = qweight + n0 * K;
  const scalar_t* x_rows = x + row_offset * stride_xm;
  const int64_t remaining = M - row_offset;
  const int rows = remaining < ROWS ? static_cast<int>(remaining) : ROWS;
  // Under a programmatic launch (prefetch_bytes > 0) L2 fetches the first prefetch_bytes of the
  // warp's weight rows while the kernel before this one finishes (one request per 128-byte line,
  // lanes side by side; the rows are consecutive in qweight). A hint only, never a load into
  // registers: should an earlier kernel still be writing the weights, the loads after
  // wait_for_inputs read its result. x and y only after wait_for_inputs too.
  const int64_t prefetch_end = prefetch_bytes < features * K ? prefetch_bytes : features * K;
#pragma unroll 1
  for (int64_t at = static_cast<int64_t>(lane) * L2_LINE; at < prefetch_end; at += WARP * L2_LINE) {
    prefetch_l2(w_rows + at);
  }
  wait_for_inputs();
  allow_dependents();  // after the wait (cuda_common.cuh)
  if constexpr (STAGED_X) {  // every thread of the block, before any warp leaves
#pragma unroll 1
    for (int e = threadIdx.x * GEMV_VEC; e < K; e += GEMV_WARPS * WARP * GEMV_VEC) {
      float v[GEMV_VEC];
      load_to_float(x_rows + e, v);
#pragma unroll
      for (int j = 0; j < GEMV_VEC / 4; ++j) {
        staged_x[staged_slot(e / 4 + j)] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
      }
    }
    __syncthreads();
  }
  if (n0 >= N) return;  // whole warps
  float acc[FEATURES][ROWS];
#pragma unroll
  for (int f = 0; f < FEATURES; ++f)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[f][r] = 0.f;

  if constexpr (VECTORIZED) {
    // UNROLL independent 16-byte loads per lane and feature are issued before any is used, so
    // each warp keeps FEATURES x UNROLL x 512 bytes of weights in flight (latency hiding without
    // more warps). A trip is those loads (load) and their arithmetic (consume). A trip that ends
    // inside K (every trip when K is a multiple of TRIP, as in every Llama shape) runs without
    // bounds checks (CHECKED = false): its loads, conversions and FMAs are then the whole loop
    // body; only a ragged last trip tests each load (a warp-uniform choice per trip).
    constexpr int64_t WARP_STEP = WARP * GEMV_VEC;
    constexpr int64_t TRIP = WARP_STEP * UNROLL;
    const int64_t lane_k = static_cast<int64_t>(lane) * GEMV_VEC;
    // STAGED_X: the lane's 16 activations of a step are float4s 4 lane .. 4 lane + 3 past the step's
    // first, a multiple of 64 (WARP_STEP / 4 = 128), which adds nothing to staged_slot's XOR key
    // (bits 3-5) and is untouched by it: staged_lane[j], float4 j's slot past the step's first, is
    // the same every step.
    static_assert(WARP_STEP / 4 % 64 == 0, "a step's first float4 must not change the swizzle");
    int staged_lane[GEMV_VEC / 4];
#pragma unroll
    for (int j = 0; j < GEMV_VEC / 4; ++j) staged_lane[j] = staged_slot(4 * lane + j);
    auto load = [&](auto checked, int4 (&packed)[FEATURES][UNROLL], int64_t trip) {
      constexpr bool CHECKED = decltype(checked)::value;
#pragma unroll
      for (int f = 0; f < FEATURES; ++f)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t k = trip + lane_k + u * WARP_STEP;
          const bool inside = (FEATURES == 1 || f < features) && (!CHECKED || k < K);
          packed[f][u] = inside ? __ldg(reinterpret_cast<const int4*>(w_rows + f * K + k)) : make_int4(0, 0, 0, 0);
        }
    };
    auto consume = [&](auto checked, const int4 (&packed)[FEATURES][UNROLL], int64_t trip) {
      constexpr bool CHECKED = decltype(checked)::value;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t k = trip + lane_k + u * WARP_STEP;
        if (CHECKED && k >= K) break;
        float w[FEATURES][GEMV_VEC];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) int8x16_to_float(packed[f][u], w[f]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (ROWS == 1 || r < rows) {
            float xf[GEMV_VEC];
            if constexpr (STAGED_X) {
              const int step_quad = static_cast<int>((trip + u * WARP_STEP) >> 2);  // a multiple of 64
#pragma unroll
              for (int j = 0; j < GEMV_VEC / 4; ++j) {
                const float4 q = staged_x[step_quad + staged_lane[j]];
                xf[4 * j] = q.x, xf[4 * j + 1] = q.y, xf[4 * j + 2] = q.z, xf[4 * j + 3] = q.w;
              }
            } else {
              load_to_float(x_rows + r * stride_xm + k, xf);
            }
#pragma unroll
            for (int i = 0; i < GEMV_VEC; ++i)
#pragma unroll
              for (int f = 0; f < FEATURES; ++f) acc[f][r] = fmaf(xf[i], w[f][i], acc[f][r]);
          }
        }
      }
    };
    using Unchecked = std::false_type;
    using Checked = std::true_type;
    auto load_trip = [&](int4 (&packed)[FEATURES][UNROLL], int64_t trip) {
      if (trip + TRIP <= K) load(Unchecked{}, packed, trip); else load(Checked{}, packed, trip);
    };
    auto consume_trip = [&](const int4 (&packed)[FEATURES][UNROLL], int64_t trip) {
      if (trip + TRIP <= K) consume(Unchecked{}, packed, trip); else consume(Checked{}, packed, trip);
    };
    int4 packed[FEATURES][UNROLL];
    if constexpr (PIPELINED) {
      // ping-pong between two register sets: the next trip's loads go out before this one's FMAs
      int4 ahead[FEATURES][UNROLL];
      load_trip(packed, 0);
      for (int64_t trip = 0; trip < K; trip += 2 * TRIP) {
        if (trip + TRIP < K) load_trip(ahead, trip + TRIP);
        consume_trip(packed, trip);
        if (trip + TRIP >= K) break;
        if (trip + 2 * TRIP < K) load_trip(packed, trip + 2 * TRIP);
        consume_trip(ahead, trip + TRIP);
      }
    } else {
      for (int64_t trip = 0; trip < K; trip += TRIP) {
        load_trip(packed, trip);
        consume_trip(packed, trip);
      }
    }
  } else {
    for (int64_t k = lane; k < K; k += WARP) {
      float w[FEATURES];
#pragma unroll
      for (int f = 0; f < FEATURES; ++f) w[f] = f < features ? static_cast<float>(w_rows[f * K + k]) : 0.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < rows) {
          const float xf = to_float(x_rows[r * stride_xm + k]);
#pragma unroll
          for (int f = 0; f < FEATURES; ++f) acc[f][r] = fmaf(xf, w[f], acc[f][r]);
        }
      }
    }
  }
#pragma unroll
  for (int f = 0; f < FEATURES; ++f) {
    if (f >= features) break;  // warp-uniform
    const int64_t n = n0 + f;
    const float scale = scales[n];
    const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float total = warp_sum(acc[f][r]);
      if (lane == 0 && r < rows) y[(row_offset + r) * N + n] = from_float<scalar_t>(total * scale + b);
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(SIMT_THREADS)
int8_linear_simt_kernel(const scalar_t* __restrict__ x, const int8_t* __restrict__ qweight,
                        const float* __restrict__ scales, const scalar_t* __restrict__ bias,
                        scalar_t* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm) {
  constexpr int MICRO = 4;  // each thread: 4 x 4 outputs
  __shared__ float x_tile[SIMT_BLOCK_K][SIMT_BLOCK + 1];
  __shared__ float w_tile[SIMT_BLOCK_K][SIMT_BLOCK + 1];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * SIMT_BLOCK;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * SIMT_BLOCK;
  const int tm = (threadIdx.x / (SIMT_BLOCK / MICRO)) * MICRO;
  const int tn = (threadIdx.x % (SIMT_BLOCK / MICRO)) * MICRO;
  float acc[MICRO][MICRO] = {};
  for (int64_t k0 = 0; k0 < K; k0 += SIMT_BLOCK_K) {
    for (int idx = threadIdx.x; idx < SIMT_BLOCK * SIMT_BLOCK_K; idx += blockDim.x) {
      const int r = idx / SIMT_BLOCK_K, c = idx % SIMT_BLOCK_K;
      const int64_t gk = k0 + c;
      x_tile[c][r] = (m0 + r < M && gk < K) ? to_float(x[(m0 + r) * stride_xm + gk]) : 0.f;
      w_tile[c][r] = (n0 + r < N && gk < K) ? static_cast<float>(qweight[(n0 + r) * K + gk]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < SIMT_BLOCK_K; ++kk) {
      float a[MICRO], b[MICRO];
#pragma unroll
      for (int i = 0; i < MICRO; ++i) a[i] = x_tile[kk][tm + i];
#pragma unroll
      for (int j = 0; j < MICRO; ++j) b[j] = w_tile[kk][tn + j];
#pragma unroll
      for (int i = 0; i < MICRO; ++i)
#pragma unroll
        for (int j = 0; j < MICRO; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < MICRO; ++i)
#pragma unroll
    for (int j = 0; j < MICRO; ++j) {
      const int64_t gm = m0 + tm + i, gn = n0 + tn + j;
      if (gm < M && gn < N)
        y[gm * N + gn] = from_float<scalar_t>(acc[i][j] * scales[gn] + (bias ? to_float(bias[gn]) : 0.f));
    }
}

// The one-row GEMV's unroll depth and features per warp, from GPTFAST_INT8_GEMV (read once per
// process): "u4f1" (the default: 4 loads of 16 bytes in flight per lane, one feature per warp), "u8f1",
// "u16f1", "u4f2", "u8f2", or "u4p" (u4f1 with the next trip's loads issued before this one's
// arithmetic: PIPELINED), or "u4s" (u4f1 with x staged in shared memory as float32: STAGED_X; u4f1
// where K > STAGED_X_MAX_K or x cannot be read as vectors). bench/gpu_run.sh (stage int8-gemv) times
// them against each other. On an H200 (bench/results/nvidia-h200_2026-11-28_e9ab4ef_int8_gemv.json)
// the default was the fastest of the first five on all three Llama-3-8B shapes, by 6-30 %: the
// deeper ones hold more registers, so fewer warps. u4p and u4s have not run on a GPU yet.
struct GemvShape {
  const char* name;
  int unroll;
  int features;
  bool pipelined;
  bool staged_x;
};

constexpr GemvShape GEMV_SHAPES[] = {{"u4f1", 4, 1, false, false}, {"u8f1", 8, 1, false, false},
                                     {"u16f1", 16, 1, false, false}, {"u4f2", 4, 2, false, false},
                                     {"u8f2", 8, 2, false, false},  {"u4p", 4, 1, true, false},
                                     {"u4s", 4, 1, false, true}};
static_assert(GEMV_SHAPES[0].unroll == GEMV_UNROLL, "the default shape comes first");

GemvShape one_row_gemv_shape() {
  static const GemvShape chosen = [] {
    const char* value = std::getenv("GPTFAST_INT8_GEMV");
    if (value == nullptr || *value == '\0') return GEMV_SHAPES[0];
    for (const GemvShape& shape : GEMV_SHAPES) {
      if (std::strcmp(shape.name, value) == 0) return shape;
    }
    TORCH_CHECK(false, "int8_linear: the environment variable GPTFAST_INT8_GEMV must be u4f1, u8f1, u16f1, u4f2, "
                "u8f2, u4p or u4s, got '", value, "'");
  }();
  return chosen;
}

template <typename scalar_t, int ROWS, int FEATURES, int UNROLL, bool PIPELINED = false, bool STAGED_X = false>
void launch_gemv_shaped(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const bool vectorized = K % GEMV_VEC == 0 && (M == 1 || x.stride(0) % GEMV_VEC == 0) &&
                          aligned16(x.data_ptr()) && aligned16(qweight.data_ptr());
  if constexpr (STAGED_X) {
    if (!vectorized || K > STAGED_X_MAX_K) {
      return launch_gemv_shaped<scalar_t, ROWS, FEATURES, UNROLL>(x, qweight, scales, bias, y, stream);
    }
  }
  const int64_t per_block = static_cast<int64_t>(GEMV_WARPS) * FEATURES;
  const dim3 grid(static_cast<unsigned>((N + per_block - 1) / per_block));
  // STAGED_X: K floats, rounded up to whole 128-byte rows of the swizzle
  const size_t shared_bytes = STAGED_X ? static_cast<size_t>((K + 31) / 32 * 32) * sizeof(float) : 0;
  const auto kernel = vectorized ? int8_linear_gemv_kernel<scalar_t, ROWS, FEATURES, true, UNROLL, PIPELINED, STAGED_X>
                                 : int8_linear_gemv_kernel<scalar_t, ROWS, FEATURES, false>;  // (no unroll)
  const bool programmatic = programmatic_launch_enabled(kernel);
  for (int64_t row = 0; row < M; row += ROWS) {
    launch_kernel(kernel, grid, GEMV_WARPS * WARP, shared_bytes, stream, programmatic, x.data_ptr<scalar_t>(),
                  qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y.data_ptr<scalar_t>(), M, N, K,
                  x.stride(0), row, programmatic ? GEMV_PREFETCH_BYTES : int64_t{0});
  }
}

template <typename scalar_t, int ROWS>
void launch_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  if constexpr (ROWS == 1) {
    const GemvShape shape = one_row_gemv_shape();
    if (shape.pipelined) {
      return launch_gemv_shaped<scalar_t, 1, 1, GEMV_UNROLL, true>(x, qweight, scales, bias, y, stream);
    }
    if (shape.staged_x) {
      return launch_gemv_shaped<scalar_t, 1, 1, GEMV_UNROLL, false, true>(x, qweight, scales, bias, y, stream);
    }
    if (shape.features == 2) {
      return shape.unroll == 8 ? launch_gemv_shaped<scalar_t, 1, 2, 8>(x, qweight, scales, bias, y, stream)
                               : launch_gemv_shaped<scalar_t, 1, 2, 4>(x, qweight, scales, bias, y, stream);
    }
    if (shape.unroll == 8) return launch_gemv_shaped<scalar_t, 1, 1, 8>(x, qweight, scales, bias, y, stream);
    if (shape.unroll == 16) return launch_gemv_shaped<scalar_t, 1, 1, 16>(x, qweight, scales, bias, y, stream);
    return launch_gemv_shaped<scalar_t, 1, 1, GEMV_UNROLL>(x, qweight, scales, bias, y, stream);
  } else {
    constexpr int FEATURES = ROWS >= GEMV_SHARED_X_ROWS ? 2 : 1;
    launch_gemv_shaped<scalar_t, ROWS, FEATURES, GEMV_UNROLL>(x, qweight, scales, bias, y, stream);
  }
}

template <typename scalar_t>
void dispatch_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  const int64_t M = x.size(0);
  // One launch streams the weights once for all M <= GEMV_MAX_ROWS rows; the row count is a
  // template parameter so the accumulators stay in registers.
  if (M == 1) return launch_gemv<scalar_t, 1>(x, qweight, scales, bias, y, stream);
  if (M == 2) return launch_gemv<scalar_t, 2>(x, qweight, scales, bias, y, stream);
  if (M <= 4) return launch_gemv<scalar_t, 4>(x, qweight, scales, bias, y, stream);
  if (M <= 8) return launch_gemv<scalar_t, 8>(x, qweight, scales, bias, y, stream);
  return launch_gemv<scalar_t, GEMV_MAX_ROWS>(x, qweight, scales, bias, y, stream);
}

// Whether the tensor-core kernel can take x: fp16 / bf16, 16-byte vector loads possible (K % 16 ==
// 0, aligned rows), an sm_80+ device, and the feature tiles within gridDim.y.
template <typename scalar_t>
bool mma_path_applies(const at::Tensor& x, const at::Tensor& qweight) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  constexpr int64_t ELEMS_PER_16B = 16 / sizeof(scalar_t);
  const bool vectorized = K % GEMV_VEC == 0 && (M == 1 || x.stride(0) % ELEMS_PER_16B == 0) &&
                          aligned16(x.data_ptr()) && aligned16(qweight.data_ptr());
  constexpr int64_t NARROWEST_BLOCK_N = 16;
  return vectorized && device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8 &&
         (N + NARROWEST_BLOCK_N - 1) / NARROWEST_BLOCK_N <= MAX_GRID_Y;
}

// Which kernels take fp16 / bf16 x, from GPTFAST_INT8_CUDA_KERNEL (read once per process):
// - unset or "auto": 2+ rows on tensor cores; one row on the FMA GEMV, or on tensor cores where the
//   weight rows are longer than there are of them (K > N). On an H200, over a decode step's layers
//   back to back in a CUDA graph (bench/results/nvidia-h200_2026-11-28_e9ab4ef_int8_gemv.json, bf16):
//   4096 x 14336 (N x K) took 193 us for 9 layers on tensor cores against the GEMV's 217, while
//   4096 x 4096 took 253 us for 32 against 272 and 14336 x 4096 189 for 9 against 222 on the GEMV;
// - "tensor_core": every row count on tensor cores, one row too (timed as above);
// - "fma": no tensor cores: the FMA GEMV up to 16 rows, the SIMT tiles above (the kernels before the
//   tensor-core ones, for timing both from one build and as a fallback).
// bench/gpu_run.sh (stages int8-gemv, int8-kernels) times the choices against the default.
enum class Int8KernelChoice { Auto, TensorCore, Fma };

Int8KernelChoice int8_kernel_choice() {
  static const Int8KernelChoice chosen = [] {
    const char* value = std::getenv("GPTFAST_INT8_CUDA_KERNEL");
    if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return Int8KernelChoice::Auto;
    if (std::strcmp(value, "tensor_core") == 0) return Int8KernelChoice::TensorCore;
    if (std::strcmp(value, "fma") == 0) return Int8KernelChoice::Fma;
    TORCH_CHECK(false, "int8_linear: the environment variable GPTFAST_INT8_CUDA_KERNEL must be auto, "
                "tensor_core or fma, got '", value, "'");
  }();
  return chosen;
}

bool on_tensor_cores(int64_t rows, int64_t K, int64_t N) {
  switch (int8_kernel_choice()) {
    case Int8KernelChoice::TensorCore: return true;
    case Int8KernelChoice::Fma: return false;
    case Int8KernelChoice::Auto: break;
  }
  return rows > 1 || K > N;
}

template <typename scalar_t, typename Tiling>
void launch_mma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t feature_tiles = (N + Tiling::BLOCK_N - 1) / Tiling::BLOCK_N;
  const int64_t row_tiles = (M + Tiling::BLOCK_M - 1) / Tiling::BLOCK_M;  // gridDim.x: up to 2^31 - 1
  TORCH_CHECK(feature_tiles <= MAX_GRID_Y && row_tiles < (int64_t{1} << 31),
              "int8_linear: shape too large for the tensor-core kernel's grid");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(feature_tiles));
  const auto kernel = int8_linear_mma_kernel<scalar_t, Tiling>;
  const bool programmatic = programmatic_launch_enabled(kernel);
  launch_kernel(kernel, grid, Tiling::WARPS * WARP, 0, stream, programmatic, x.data_ptr<scalar_t>(),
                qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y.data_ptr<scalar_t>(), M, N, K,
                x.stride(0), programmatic);
}

// 2..16 rows on tensor cores: 16-row tiles of A are the weights, 8-row tiles of B the rows of x.
// 32 features per warp halve the reads of x per weight byte, but only pay when N leaves enough
// blocks (two per SM) for the whole GPU.
template <typename scalar_t>
void dispatch_mma_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  constexpr int BLOCKS_PER_SM = 2;
  const int64_t M = x.size(0), N = qweight.size(0);
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount);
  const bool wide = N >= BLOCKS_PER_SM * sms * MmaGemvTiling<2, 1>::BLOCK_N;
  if (M <= 8) {
    return wide ? launch_mma<scalar_t, MmaGemvTiling<2, 1>>(x, qweight, scales, bias, y, stream)
                : launch_mma<scalar_t, MmaGemvTiling<1, 1>>(x, qweight, scales, bias, y, stream);
  }
  return wide ? launch_mma<scalar_t, MmaGemvTiling<2, 2>>(x, qweight, scales, bias, y, stream)
              : launch_mma<scalar_t, MmaGemvTiling<1, 2>>(x, qweight, scales, bias, y, stream);
}

template <typename scalar_t>
void launch_simt(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  // Row tiles go in gridDim.y (at most MAX_GRID_Y): larger M runs as several launches.
  const int64_t rows_per_launch = MAX_GRID_Y * SIMT_BLOCK;
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_launch) {
    const int64_t rows = std::min(rows_per_launch, M - m0);
    const dim3 grid(static_cast<unsigned>((N + SIMT_BLOCK - 1) / SIMT_BLOCK),
                    static_cast<unsigned>((rows + SIMT_BLOCK - 1) / SIMT_BLOCK));
    int8_linear_simt_kernel<scalar_t><<<grid, SIMT_THREADS, 0, stream>>>(
        x.data_ptr<scalar_t>() + m0 * x.stride(0), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
        bias, y.data_ptr<scalar_t>() + m0 * N, rows, N, K, x.stride(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

at::Tensor int8_linear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  check_int8_linear_inputs(x, qweight, scales, bias);
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, "int8_linear: x must have a contiguous last dimension");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "int8_linear_cuda", [&] {
    const scalar_t* bias_ptr = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (on_tensor_cores(M, K, N) && mma_path_applies<scalar_t>(x, qweight)) {
        if (M <= GEMV_MAX_ROWS) return dispatch_mma_gemv<scalar_t>(x, qweight, scales, bias_ptr, y, stream);
        if (M <= MmaSkinnyTiling::BLOCK_M) return launch_mma<scalar_t, MmaSkinnyTiling>(x, qweight, scales, bias_ptr, y, stream);
        return launch_mma<scalar_t, MmaPrefillTiling>(x, qweight, scales, bias_ptr, y, stream);
      }
    }
    if (M <= GEMV_MAX_ROWS) return dispatch_gemv<scalar_t>(x, qweight, scales, bias_ptr, y, stream);
    launch_simt<scalar_t>(x, qweight, scales, bias_ptr, y, stream);
  });
  return y;
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("int8_linear", &int8_linear_cuda);
}

}  // namespace gptfast_kernels
