// Shared input checks for every op's C++ entry points (CPU and CUDA).
// The Python wrappers in gptfast_kernels/ops check inputs first and raise ValueError naming the
// argument; these checks (op is a const char* naming the op) are the last line of defence for callers of torch.ops directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#define GPTFAST_CHECK_DEVICE(op, x, expected_device)                                    \
  TORCH_CHECK((x).device() == (expected_device), op, ": " #x " must be on ", (expected_device), \
              ", got ", (x).device())
#define GPTFAST_CHECK_DTYPE(op, x, dtype) \
  TORCH_CHECK((x).scalar_type() == (dtype), op, ": " #x " must be ", (dtype), ", got ", (x).scalar_type())
#define GPTFAST_CHECK_DIM(op, x, ndim) \
  TORCH_CHECK((x).dim() == (ndim), op, ": " #x " must have ", (ndim), " dimensions, got ", (x).dim())
#define GPTFAST_CHECK_CONTIGUOUS(op, x) \
  TORCH_CHECK((x).is_contiguous(), op, ": " #x " must be contiguous")
#define GPTFAST_CHECK_SIZE(op, x, d, expected)                                                 \
  TORCH_CHECK((x).size(d) == (expected), op, ": " #x ".size(", d, ") must be ", (expected),   \
              ", got ", (x).size(d))
#define GPTFAST_CHECK_FLOATING(op, x)                                                            \
  TORCH_CHECK((x).scalar_type() == at::kFloat || (x).scalar_type() == at::kHalf ||               \
                  (x).scalar_type() == at::kBFloat16,                                            \
              op, ": " #x " must be float16, bfloat16 or float32, got ", (x).scalar_type())

// The activation dtypes every kernel supports.
#define GPTFAST_DISPATCH_FLOAT_HALF_BF16(TYPE, NAME, ...)        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace gptfast_kernels {
// The instruction set the CPU kernels run (their builds in csrc/cpu/): GPTFAST_KERNELS_CPU_ISA names
// one (an error if this CPU lacks it), else the best this CPU runs; the private op _cpu_isa switches
// it. Defined in cpu_isa.cpp.
enum class CpuIsa : int64_t { baseline = 0, avx2 = 1, avx512 = 2 };  // avx2: + FMA; avx512: F + BW
CpuIsa cpu_isa();

// int8_linear's shape / dtype / device / contiguity checks, shared by the CPU and CUDA entry points
// (defined in int8_linear.cpp); bias must be in x's dtype.
void check_int8_linear_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias);
// int8_linear's CPU kernel and its parts that int8_expert_linear's runs per expert (int8_linear.cpp):
// - the op itself, and int8_linear_cpu_many: the op on several matrices at once (xs[i] @ qweights[i]^T
//   * scales[i] + biases[i]), those its packed GEMM takes in one parallel loop, each result as
//   int8_linear_cpu gives it (experts with many rows);
// - int8_linear_cpu_gemv_rows(isa): the most rows of x int8_linear runs through its GEMV on isa
//   (more take the packed GEMM or the dequantise path);
// - int8_gemv_cpu: that GEMV on raw arrays, y[m * ldy + n] = (x[m] . w[n]) * scales[n] + bias[n] (bias
//   may be null) for the M rows of x [M, K] and features n_begin .. n_end - 1 of w [N, K], with the
//   bits int8_linear gives them however N is split.
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias);
std::vector<at::Tensor> int8_linear_cpu_many(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& qweights,
                                             const std::vector<at::Tensor>& scales,
                                             const std::vector<std::optional<at::Tensor>>& biases);
int64_t int8_linear_cpu_gemv_rows(CpuIsa isa);
void int8_gemv_cpu(CpuIsa isa, const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales,
                   const float* bias, float* y, int64_t ldy, int64_t n_begin, int64_t n_end);

// kv_cache_attention's shape / dtype / device / contiguity checks, shared by the CPU and CUDA
// entry points (defined in kv_cache_attention.cpp). Position values are checked by each backend.
// value_dim > 0: values in keys (v and v_cache empty, unused); returns the output's head dim, Dv.
// chunk_size > 0: chunked attention, refused together with a window; ring needs a window or a chunk_size.
// sinks and alibi_slopes: contiguous float32 [Hq] or none. |scale| at most 2^126, softcap 2^125.
int64_t check_kv_cache_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& positions, double scale, int64_t window, double softcap,
                                        const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                        int64_t chunk_size, const std::optional<at::Tensor>& alibi_slopes);

// int8_expert_linear's shape / dtype / device / contiguity checks, shared by the CPU and CUDA entry
// points (defined in int8_expert_linear.cpp).
void check_int8_expert_linear_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                     const at::Tensor& experts, const std::optional<at::Tensor>& bias);
}  // namespace gptfast_kernels
