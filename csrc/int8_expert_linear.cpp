// int8 weight-only linear per mixture-of-experts expert: the int8_expert_linear schema and its CPU
// kernel.
//
//   y[p, n] = sum_k x[p, k] * qweight[experts[p], n, k] * scales[experts[p], n] + bias[experts[p], n]
//             (float32 sums; bias optional, [E, N] in x's dtype)
//   y[p, :] = 0 where experts[p] is outside [0, E) (-1: padding)
//
// Rows are grouped by expert (a counting sort of the P ids) and each chosen expert's rows go through
// int8_linear's CPU kernel as one matrix: its GEMV for a few rows (decode), its packed GEMM for more
// (verification, prompts), on the CPU's instruction set. Experts no row chose are never read, and a
// row's result is what int8_linear gives it with its expert's weight.
#include <vector>

#include "common.h"

namespace gptfast_kernels {
namespace {

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
  const at::Tensor row_ids = at::tensor(rows, experts.options());
  for (int64_t e = 0; e < qweight.size(0); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    const at::Tensor ids = row_ids.slice(0, offsets[e], offsets[e + 1]);
    const std::optional<at::Tensor> expert_bias = bias.has_value() ? std::optional<at::Tensor>((*bias)[e]) : std::nullopt;
    y.index_copy_(0, ids, int8_linear_cpu(x.index_select(0, ids), qweight[e], scales[e], expert_bias));
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("int8_expert_linear(Tensor x, Tensor qweight, Tensor scales, Tensor experts, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CPU, m) {
  m.impl("int8_expert_linear", &int8_expert_linear_cpu);
}

}  // namespace gptfast_kernels
