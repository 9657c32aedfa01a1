// int8 weight-only linear, CUDA kernels.
//
//   y[m, n] = (sum_k x[m, k] * qweight[n, k]) * scales[n] + bias[n], accumulated in float32.
//
// Decode (M <= GEMV_MAX_ROWS): memory-bound on the N*K weight bytes. One warp per output feature
// (two from GEMV_SHARED_X_ROWS rows of x on); each lane streams 16 int8 weights per 16-byte load (a
// warp reads 512 contiguous bytes per step), widens them in registers and reuses them for every
// row of x. x is small and L1/L2-resident.
// Prefill (M > GEMV_MAX_ROWS): compute-bound. fp16/bf16 use tensor cores (WMMA 16x16x16, fp32
// accumulators) on tiles whose int8 weights are widened to x's dtype while staged in shared memory
// (exact: |q| <= 127); fp32 uses a SIMT tiled kernel so its products stay in full fp32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>

#include "../common.h"
#include "cuda_common.cuh"

namespace gptfast_kernels {
namespace {

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

// WMMA tile for fp16/bf16 prefill: 64 x 64 outputs per block, 4 warps of 32 x 32, K step 32.
constexpr int TC_BLOCK_M = 64;
constexpr int TC_BLOCK_N = 64;
constexpr int TC_BLOCK_K = 32;
constexpr int TC_WARPS = 4;
constexpr int TC_SMEM_PAD = 8;  // breaks shared-memory bank conflicts on the fragment loads
// SIMT tile for fp32 prefill: 64 x 64 outputs, 256 threads each computing 4 x 4.
constexpr int SIMT_BLOCK = 64;
constexpr int SIMT_BLOCK_K = 16;
constexpr int SIMT_THREADS = 256;
// CUDA's limit on gridDim.y, which holds the prefill kernels' row tiles.
constexpr int64_t MAX_GRID_Y = 65535;

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_float(float v) { return static_cast<scalar_t>(v); }


// 16 int8 weights -> float without the conversion unit: I2F runs at 16 per clock per SM on
// sm_80 / sm_90, and streaming int8 weights at full HBM3 bandwidth (~3 TB/s over 132 SMs at
// ~1.75 GHz) needs ~13 per clock. Instead, byte b + 128 placed in the mantissa of 2^23 reads as
// the float 2^23 + 128 + b (exact: the ulp there is 1), so one PRMT (integer pipe) and one FADD
// give b exactly.
static_assert(GEMV_VEC == 16, "int8x16_to_float widens one 16-byte vector of weights");
__device__ __forceinline__ void int8x16_to_float(const int4& packed, float* out) {
  constexpr unsigned MAGIC_BITS = 0x4B000000u;  // 2^23 as float bits
  constexpr float MAGIC_PLUS_BIAS = 8388608.f + 128.f;
  const unsigned words[4] = {static_cast<unsigned>(packed.x), static_cast<unsigned>(packed.y),
                             static_cast<unsigned>(packed.z), static_cast<unsigned>(packed.w)};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const unsigned biased = words[w] ^ 0x80808080u;  // each signed byte b -> unsigned b + 128
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // result bytes: [biased byte i, 0, 0, 0x4B] (selector nibbles 7, 5, 4, i over {biased, MAGIC_BITS})
      out[4 * w + i] = __uint_as_float(__byte_perm(biased, MAGIC_BITS, 0x7540u | i)) - MAGIC_PLUS_BIAS;
    }
  }
}

// One warp computes FEATURES output features for ROWS rows of x; each lane dots a strided share
// of K and the warp reduces. VECTORIZED requires K % 16 == 0 and 16-byte aligned x / qweight rows
// (checked by the launcher). FEATURES > 1 reuses every x vector loaded from L1 for several weight
// rows: with 4+ rows of x, one feature per warp would read ROWS x 2 bytes of x per weight byte,
// more than L1 serves at the HBM3 weight rate.
template <typename scalar_t, int ROWS, int FEATURES, bool VECTORIZED>
__global__ void __launch_bounds__(GEMV_WARPS * WARP)
int8_linear_gemv_kernel(const scalar_t* __restrict__ x, const int8_t* __restrict__ qweight,
                        const float* __restrict__ scales, const scalar_t* __restrict__ bias,
                        scalar_t* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm,
                        int64_t row_offset) {
  const int lane = threadIdx.x % WARP;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * GEMV_WARPS + threadIdx.x / WARP) * FEATURES;
  if (n0 >= N) return;  // whole warps
  const int features = N - n0 < FEATURES ? static_cast<int>(N - n0) : FEATURES;
  const int8_t* w_rows = qweight + n0 * K;
  const scalar_t* x_rows = x + row_offset * stride_xm;
  const int64_t remaining = M - row_offset;
  const int rows = remaining < ROWS ? static_cast<int>(remaining) : ROWS;
  float acc[FEATURES][ROWS];
#pragma unroll
  for (int f = 0; f < FEATURES; ++f)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[f][r] = 0.f;

  if constexpr (VECTORIZED) {
    // GEMV_UNROLL independent 16-byte loads per lane and feature are issued before any is used, so
    // each warp keeps FEATURES x 2 KiB of weights in flight (latency hiding without more warps).
    constexpr int64_t WARP_STEP = WARP * GEMV_VEC;
    for (int64_t k_base = static_cast<int64_t>(lane) * GEMV_VEC; k_base < K;
         k_base += WARP_STEP * GEMV_UNROLL) {
      int4 packed[FEATURES][GEMV_UNROLL];
#pragma unroll
      for (int f = 0; f < FEATURES; ++f)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
          const int64_t k = k_base + u * WARP_STEP;
          packed[f][u] = f < features && k < K ? __ldg(reinterpret_cast<const int4*>(w_rows + f * K + k))
                                               : make_int4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int64_t k = k_base + u * WARP_STEP;
        if (k >= K) break;
        float w[FEATURES][GEMV_VEC];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) int8x16_to_float(packed[f][u], w[f]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < rows) {
            // 16 activations = 16 * sizeof(scalar_t) bytes, loaded as 16-byte vectors.
            constexpr int X_VECS = GEMV_VEC * sizeof(scalar_t) / 16;
            int4 xv[X_VECS];
            const int4* x_src = reinterpret_cast<const int4*>(x_rows + r * stride_xm + k);
#pragma unroll
            for (int j = 0; j < X_VECS; ++j) xv[j] = __ldg(x_src + j);
            const scalar_t* xs = reinterpret_cast<const scalar_t*>(xv);
#pragma unroll
            for (int i = 0; i < GEMV_VEC; ++i) {
              const float xf = to_float(xs[i]);
#pragma unroll
              for (int f = 0; f < FEATURES; ++f) acc[f][r] = fmaf(xf, w[f][i], acc[f][r]);
            }
          }
        }
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
__global__ void __launch_bounds__(TC_WARPS * WARP)
int8_linear_wmma_kernel(const scalar_t* __restrict__ x, const int8_t* __restrict__ qweight,
                        const float* __restrict__ scales, const scalar_t* __restrict__ bias,
                        scalar_t* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm) {
  using namespace nvcuda;
  using mma_t = typename MmaType<scalar_t>::type;
  constexpr int LD = TC_BLOCK_K + TC_SMEM_PAD;
  __shared__ __align__(32) mma_t x_tile[TC_BLOCK_M][LD];
  __shared__ __align__(32) mma_t w_tile[TC_BLOCK_N][LD];  // [n][k]: column-major B of K x N
  __shared__ __align__(32) float out_tile[TC_BLOCK_M][TC_BLOCK_N + TC_SMEM_PAD];

  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * TC_BLOCK_M;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * TC_BLOCK_N;
  const int warp = threadIdx.x / WARP;
  const int warp_m = (warp / 2) * 32, warp_n = (warp % 2) * 32;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  for (int64_t k0 = 0; k0 < K; k0 += TC_BLOCK_K) {
    for (int idx = threadIdx.x; idx < TC_BLOCK_M * TC_BLOCK_K; idx += blockDim.x) {
      const int r = idx / TC_BLOCK_K, c = idx % TC_BLOCK_K;
      const int64_t gm = m0 + r, gk = k0 + c;
      const scalar_t v = (gm < M && gk < K) ? x[gm * stride_xm + gk] : scalar_t(0.f);
      x_tile[r][c] = *reinterpret_cast<const mma_t*>(&v);
    }
    for (int idx = threadIdx.x; idx < TC_BLOCK_N * TC_BLOCK_K; idx += blockDim.x) {
      const int r = idx / TC_BLOCK_K, c = idx % TC_BLOCK_K;
      const int64_t gn = n0 + r, gk = k0 + c;
      const scalar_t v = scalar_t(static_cast<float>((gn < N && gk < K) ? qweight[gn * K + gk] : 0));
      w_tile[r][c] = *reinterpret_cast<const mma_t*>(&v);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TC_BLOCK_K; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &x_tile[warp_m + 16 * i][kk], LD);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &w_tile[warp_n + 16 * j][kk], LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&out_tile[warp_m + 16 * i][warp_n + 16 * j], acc[i][j],
                              TC_BLOCK_N + TC_SMEM_PAD, wmma::mem_row_major);
  __syncthreads();
  for (int idx = threadIdx.x; idx < TC_BLOCK_M * TC_BLOCK_N; idx += blockDim.x) {
    const int r = idx / TC_BLOCK_N, c = idx % TC_BLOCK_N;
    const int64_t gm = m0 + r, gn = n0 + c;
    if (gm < M && gn < N) {
      float v = out_tile[r][c] * scales[gn];
      if (bias != nullptr) v += to_float(bias[gn]);
      y[gm * N + gn] = from_float<scalar_t>(v);
    }
  }
}

__global__ void __launch_bounds__(SIMT_THREADS)
int8_linear_simt_kernel(const float* __restrict__ x, const int8_t* __restrict__ qweight,
                        const float* __restrict__ scales, const float* __restrict__ bias,
                        float* __restrict__ y, int64_t M, int64_t N, int64_t K, int64_t stride_xm) {
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
      x_tile[c][r] = (m0 + r < M && gk < K) ? x[(m0 + r) * stride_xm + gk] : 0.f;
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
      if (gm < M && gn < N) y[gm * N + gn] = acc[i][j] * scales[gn] + (bias ? bias[gn] : 0.f);
    }
}

template <typename scalar_t, int ROWS>
void launch_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  constexpr int FEATURES = ROWS >= GEMV_SHARED_X_ROWS ? 2 : 1;
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const bool vectorized = K % GEMV_VEC == 0 && (M == 1 || x.stride(0) % GEMV_VEC == 0) &&
                          aligned16(x.data_ptr()) && aligned16(qweight.data_ptr());
  const int64_t per_block = static_cast<int64_t>(GEMV_WARPS) * FEATURES;
  const dim3 grid(static_cast<unsigned>((N + per_block - 1) / per_block));
  for (int64_t row = 0; row < M; row += ROWS) {
    auto kernel = vectorized ? int8_linear_gemv_kernel<scalar_t, ROWS, FEATURES, true>
                             : int8_linear_gemv_kernel<scalar_t, ROWS, FEATURES, false>;
    kernel<<<grid, GEMV_WARPS * WARP, 0, stream>>>(
        x.data_ptr<scalar_t>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias,
        y.data_ptr<scalar_t>(), M, N, K, x.stride(0), row);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

template <typename scalar_t>
void launch_prefill(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const scalar_t* bias, at::Tensor& y, cudaStream_t stream) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  constexpr bool fp32 = std::is_same_v<scalar_t, float>;
  constexpr int64_t block_m = fp32 ? SIMT_BLOCK : TC_BLOCK_M, block_n = fp32 ? SIMT_BLOCK : TC_BLOCK_N;
  // Row tiles go in gridDim.y (at most MAX_GRID_Y): larger M runs as several launches.
  const int64_t rows_per_launch = MAX_GRID_Y * block_m;
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_launch) {
    const int64_t rows = std::min(rows_per_launch, M - m0);
    const dim3 grid(static_cast<unsigned>((N + block_n - 1) / block_n), static_cast<unsigned>((rows + block_m - 1) / block_m));
    const scalar_t* x_rows = x.data_ptr<scalar_t>() + m0 * x.stride(0);
    scalar_t* y_rows = y.data_ptr<scalar_t>() + m0 * N;
    if constexpr (fp32) {
      int8_linear_simt_kernel<<<grid, SIMT_THREADS, 0, stream>>>(
          x_rows, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y_rows, rows, N, K, x.stride(0));
    } else {
      int8_linear_wmma_kernel<scalar_t><<<grid, TC_WARPS * WARP, 0, stream>>>(
          x_rows, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y_rows, rows, N, K, x.stride(0));
    }
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
    if (M <= GEMV_MAX_ROWS) {
      dispatch_gemv<scalar_t>(x, qweight, scales, bias_ptr, y, stream);
    } else {
      launch_prefill<scalar_t>(x, qweight, scales, bias_ptr, y, stream);
    }
  });
  return y;
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("int8_linear", &int8_linear_cuda);
}

}  // namespace gptfast_kernels
