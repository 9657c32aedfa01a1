// int8_expert_linear CUDA kernel: int8 weight-only GEMV per mixture-of-experts expert.
//
//   y[p, n] = sum_k x[p, k] * qweight[experts[p], n, k] * scales[experts[p], n] + bias[experts[p], n]
//             (float32 sums; bias optional)
//
// Grid = (tiles of N_TILE output features, E experts). A block first lists the rows routed to its
// expert (a scan of the P ids into shared memory, THREADS at a time) and exits if there are none,
// so the weights of experts no row chose are never read: a decode step streams top-k of E experts.
// The listed rows are then computed ROWS at a time: each warp owns OUTPUTS_PER_WARP features and
// streams their int8 rows over K (16 weights per lane per step, the 16-byte loads of int8_linear's
// GEMV), FMAs them in fp32 against the rows' x and reduces across the warp. Written without a GPU
// and not yet timed: the constants below are reasoned, not tuned.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "../common.h"
#include "cuda_common.cuh"

namespace gptfast_kernels {
namespace {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / WARP;
// Features per warp: 4 independent weight streams per lane keep loads in flight (as the GEMV's
// FEATURES); a block covers 32 features, so a 14336-feature expert spreads over 448 blocks.
constexpr int OUTPUTS_PER_WARP = 4;
constexpr int N_TILE = WARPS * OUTPUTS_PER_WARP;
// Rows sharing one pass over the weights: decode routes 1 row (batch 1) to an expert, batched decode
// and verification a few; 4 x 4 accumulators and 4 x 16 x values stay in registers.
constexpr int ROWS = 4;
constexpr int VEC = 16;  // int8 weights per 16-byte load
// No minimum of resident blocks: capping ptxas at 128 registers (2 blocks per SM) spills the 16-bit
// variants (ptxas -v, sm_90a); whether the occupancy or the spill costs more is for the bench.
constexpr int MAX_EXPERTS = 65535;  // gridDim.y

// VECTORIZED: K % VEC == 0 and 16-byte aligned x / qweight (checked by the launcher); else each
// lane walks K one element at a time.
template <typename T, bool VECTORIZED>
__global__ void __launch_bounds__(THREADS) expert_gemv_kernel(const T* __restrict__ x, const int8_t* __restrict__ qweight,
                                                              const float* __restrict__ scales,
                                                              const int64_t* __restrict__ experts,
                                                              const T* __restrict__ bias, T* __restrict__ y,
                                                              int64_t P, int64_t N, int64_t K) {
  __shared__ int listed[THREADS];
  __shared__ int count;
  const int e = static_cast<int>(blockIdx.y);
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int64_t n_first = static_cast<int64_t>(blockIdx.x) * N_TILE + warp * OUTPUTS_PER_WARP;
  for (int64_t p0 = 0; p0 < P; p0 += THREADS) {
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const int64_t p = p0 + threadIdx.x;
    if (p < P && experts[p] == e) listed[atomicAdd(&count, 1)] = static_cast<int>(threadIdx.x);
    __syncthreads();
    const int rows_here = count;
    for (int r0 = 0; r0 < rows_here; r0 += ROWS) {
      const int rows = min(ROWS, rows_here - r0);
      const T* x_row[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) x_row[r] = x + (p0 + listed[r0 + min(r, rows - 1)]) * K;
      float acc[OUTPUTS_PER_WARP][ROWS] = {};
      if constexpr (VECTORIZED) {
        for (int64_t k = static_cast<int64_t>(lane) * VEC; k < K; k += WARP * VEC) {
          float xf[ROWS][VEC];
#pragma unroll
          for (int r = 0; r < ROWS; ++r)
            if (r < rows) load_to_float(x_row[r] + k, xf[r]);
#pragma unroll
          for (int j = 0; j < OUTPUTS_PER_WARP; ++j) {
            const int64_t n = n_first + j;
            if (n >= N) break;
            const int4 wv = __ldg(reinterpret_cast<const int4*>(qweight + (e * N + n) * K + k));
            const int8_t* w = reinterpret_cast<const int8_t*>(&wv);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
              if (r >= rows) break;
#pragma unroll
              for (int i = 0; i < VEC; ++i) acc[j][r] = fmaf(xf[r][i], static_cast<float>(w[i]), acc[j][r]);
            }
          }
        }
      } else {
        for (int64_t k = lane; k < K; k += WARP) {
#pragma unroll
          for (int j = 0; j < OUTPUTS_PER_WARP; ++j) {
            const int64_t n = n_first + j;
            if (n >= N) break;
            const float w = static_cast<float>(qweight[(e * N + n) * K + k]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
              if (r < rows) acc[j][r] = fmaf(to_float(x_row[r][k]), w, acc[j][r]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < OUTPUTS_PER_WARP; ++j) {
        const int64_t n = n_first + j;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const float sum = warp_sum(acc[j][r]);  // every lane takes part, whatever n and rows
          if (lane == 0 && n < N && r < rows) {
            const float shift = bias != nullptr ? to_float(bias[e * N + n]) : 0.f;
            y[(p0 + listed[r0 + r]) * N + n] = T(sum * scales[e * N + n] + shift);
          }
        }
      }
    }
    __syncthreads();  // listed / count are rewritten for the next THREADS ids
  }
}

}  // namespace

at::Tensor int8_expert_linear_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const at::Tensor& experts, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_expert_linear";
  check_int8_expert_linear_inputs(x, qweight, scales, experts, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t P = x.size(0), K = x.size(1), E = qweight.size(0), N = qweight.size(1);
  at::Tensor y = at::zeros({P, N}, x.options());  // rows whose expert is outside [0, E) stay 0
  if (y.numel() == 0) return y;
  TORCH_CHECK(E <= MAX_EXPERTS, op, ": at most ", MAX_EXPERTS, " experts, got ", E);
  const int64_t n_tiles = (N + N_TILE - 1) / N_TILE;
  TORCH_CHECK(n_tiles <= INT_MAX, op, ": N = ", N, " exceeds the CUDA grid");
  const bool vectorized = K % VEC == 0 && aligned16(x.data_ptr()) && aligned16(qweight.data_ptr());
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(E));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "int8_expert_linear_cuda", [&] {
    auto kernel = vectorized ? expert_gemv_kernel<scalar_t, true> : expert_gemv_kernel<scalar_t, false>;
    kernel<<<grid, THREADS, 0, stream>>>(x.data_ptr<scalar_t>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                         experts.data_ptr<int64_t>(),
                                         bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr,
                                         y.data_ptr<scalar_t>(), P, N, K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("int8_expert_linear", &int8_expert_linear_cuda);
}

}  // namespace gptfast_kernels
