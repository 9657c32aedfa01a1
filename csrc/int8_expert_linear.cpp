// int8 weight-only linear per mixture-of-experts expert: the int8_expert_linear schema and its CPU
// kernel.
//
//   y[p, n] = sum_k x[p, k] * qweight[experts[p], n, k] * scales[experts[p], n] + bias[experts[p], n]
//             (float32 sums; bias optional, [E, N] in x's dtype)
//   y[p, :] = 0 where experts[p] is outside [0, E) (-1: padding)
//
// Rows are grouped by expert (a counting sort of the P ids), and each chosen expert's rows go through
// int8_linear's CPU kernel as one matrix, on the CPU's instruction set: experts with a few rows
// (decode; multi-head latent attention's heads) through its GEMV, all of them in one parallel loop
// over (expert, block of outputs) so that each weight row is read once for all its expert's rows;
// experts with more rows (verification, prompts) through the op itself, i.e. its packed GEMM, all of
// them in one parallel loop too.
// Experts no row chose are never read, and a row's result is what int8_linear gives it with its
// expert's weight.
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "common.h"

namespace gptfast_kernels {
namespace {

// Output features per parallel work item of the few-row experts: enough weight rows (64 x K bytes)
// to amortise the task.
constexpr int64_t N_BLOCK = 64;
// Rows of x per work item of the gather into expert order: decode's few rows stay on one thread.
constexpr int64_t GATHER_GRAIN_ROWS = 64;

void expert_rows(const int64_t* experts, int64_t P, int64_t E, std::vector<int64_t>& offsets,
                 std::vector<int64_t>& rows) {
  offsets.assign(E + 1, 0);
  for (int64_t p = 0; p < P; ++p)
    if (experts[p] >= 0 && experts[p] < E) ++offsets[experts[p] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  rows.resize(offsets[E]);
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p)
    if (experts[p] >= 0 && experts[p] < E) rows[next[experts[p]]++] = p;
}

// x's rows in the order of `rows` (by expert), as float32 [rows.size(), K]: one copy up front instead of
// one per work item, and no ATen dispatches but the conversion (a no-op for float32 x).
at::Tensor sorted_rows(const at::Tensor& x, const std::vector<int64_t>& rows) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t K = x.size(1);
  at::Tensor sorted = at::empty({static_cast<int64_t>(rows.size()), K}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = sorted.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), GATHER_GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * K, src + rows[i] * K, K * sizeof(float));
  });
  return sorted;
}

// y's rows of the experts with 1 .. max_rows rows, through int8_linear's GEMV: per work item (expert,
// block of N_BLOCK outputs) the expert's rows of x_sorted (x's rows in expert order, float32) are
// multiplied and the results scattered.
template <typename scalar_t>
void few_row_experts(CpuIsa isa, int64_t max_rows, const at::Tensor& x_sorted, const at::Tensor& qweight,
                     const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                     const std::vector<int64_t>& offsets, const std::vector<int64_t>& rows, at::Tensor& y) {
  const int64_t E = qweight.size(0), N = qweight.size(1), K = qweight.size(2);
  std::vector<int64_t> chosen;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] > offsets[e] && offsets[e + 1] - offsets[e] <= max_rows) chosen.push_back(e);
  }
  if (chosen.empty()) return;
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  const float* x_ptr = x_sorted.data_ptr<float>();
  const int8_t* w_ptr = qweight.data_ptr<int8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  const float* b_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  scalar_t* y_ptr = y.data_ptr<scalar_t>();
  const int64_t n_blocks = (N + N_BLOCK - 1) / N_BLOCK;
  at::parallel_for(0, static_cast<int64_t>(chosen.size()) * n_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y_rows(max_rows * N_BLOCK);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = chosen[item / n_blocks], n0 = (item % n_blocks) * N_BLOCK;
      const int64_t width = std::min(N_BLOCK, N - n0), first = offsets[e], count = offsets[e + 1] - first;
      const int64_t feature = e * N + n0;  // the block's first weight row, scale and bias
      int8_gemv_cpu(isa, x_ptr + first * K, count, K, w_ptr + feature * K, s_ptr + feature,
                    b_ptr != nullptr ? b_ptr + feature : nullptr, y_rows.data(), width, 0, width);
      for (int64_t i = 0; i < count; ++i) {
        scalar_t* out = y_ptr + rows[first + i] * N + n0;
        for (int64_t j = 0; j < width; ++j) out[j] = static_cast<scalar_t>(y_rows[i * width + j]);
      }
    }
  });
}

}  // namespace

// Checks shared by the CPU and CUDA entry points (declared in common.h). Expert id values are
// not checked here: ids outside [0, E) give zero rows in every kernel.
void check_int8_expert_linear_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                     const at::Tensor& experts, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_expert_linear";
  GPTFAST_CHECK_DIM(op, x, 2);
  GPTFAST_CHECK_FLOATING(op, x);
  GPTFAST_CHECK_DIM(op, qweight, 3);
  GPTFAST_CHECK_DTYPE(op, qweight, at::kChar);
  const int64_t E = qweight.size(0), N = qweight.size(1), K = qweight.size(2);
  TORCH_CHECK(E > 0 && K > 0, op, ": qweight must be [E, N, K] with E, K >= 1, got ", qweight.sizes());
  GPTFAST_CHECK_SIZE(op, x, 1, K);
  GPTFAST_CHECK_DTYPE(op, scales, at::kFloat);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == E && scales.size(1) == N, op, ": scales must be [E, N] = [",
              E, ", ", N, "], got ", scales.sizes());
  GPTFAST_CHECK_DTYPE(op, experts, at::kLong);
  TORCH_CHECK(experts.dim() == 1 && experts.size(0) == x.size(0), op, ": experts must be [P] = [", x.size(0),
              "], got ", experts.sizes());
  if (bias.has_value()) {
    GPTFAST_CHECK_DTYPE(op, (*bias), x.scalar_type());
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == E && bias->size(1) == N, op, ": bias must be [E, N] = [", E,
                ", ", N, "], got ", bias->sizes());
    GPTFAST_CHECK_CONTIGUOUS(op, (*bias));
    GPTFAST_CHECK_DEVICE(op, (*bias), x.device());
  }
  for (const auto* t : {&qweight, &scales, &experts}) GPTFAST_CHECK_DEVICE(op, *t, x.device());
  for (const auto* t : {&x, &qweight, &scales, &experts}) {
    TORCH_CHECK(t->is_contiguous(), op, ": x, qweight, scales and experts must be contiguous");
  }
}

// x [P, K] float, qweight [E, N, K] int8, scales [E, N] float32, experts [P] int64, bias [E, N]
// (x's dtype) or None -> y [P, N].
at::Tensor int8_expert_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                  const at::Tensor& experts, const std::optional<at::Tensor>& bias) {
  check_int8_expert_linear_inputs(x, qweight, scales, experts, bias);
  at::Tensor y = at::zeros({x.size(0), qweight.size(1)}, x.options());  // rows of no expert stay 0
  if (y.numel() == 0) return y;
  std::vector<int64_t> offsets, rows;
  expert_rows(experts.data_ptr<int64_t>(), x.size(0), qweight.size(0), offsets, rows);
  const CpuIsa isa = cpu_isa();
  const int64_t gemv_rows = int8_linear_cpu_gemv_rows(isa);
  const at::Tensor row_ids = at::tensor(rows, experts.options());
  const at::Tensor x_sorted = sorted_rows(x, rows);
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "int8_expert_linear_cpu", [&] {
    few_row_experts<scalar_t>(isa, gemv_rows, x_sorted, qweight, scales, bias, offsets, rows, y);
  });
  std::vector<at::Tensor> ids, xs, qweights, expert_scales;
  std::vector<std::optional<at::Tensor>> biases;
  for (int64_t e = 0; e < qweight.size(0); ++e) {
    if (offsets[e + 1] - offsets[e] <= gemv_rows) continue;  // none, or done above
    ids.push_back(row_ids.slice(0, offsets[e], offsets[e + 1]));
    xs.push_back(x_sorted.slice(0, offsets[e], offsets[e + 1]));
    qweights.push_back(qweight[e]);
    expert_scales.push_back(scales[e]);
    biases.push_back(bias.has_value() ? std::optional<at::Tensor>((*bias)[e].to(at::kFloat)) : std::nullopt);
  }
  const std::vector<at::Tensor> outs = int8_linear_cpu_many(xs, qweights, expert_scales, biases);
  for (size_t i = 0; i < outs.size(); ++i) y.index_copy_(0, ids[i], outs[i].to(y.scalar_type()));
  return y;
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("int8_expert_linear(Tensor x, Tensor qweight, Tensor scales, Tensor experts, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("int8_expert_linear", &int8_expert_linear_cpu);
}

}  // namespace gptfast_kernels
