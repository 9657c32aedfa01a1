"""int8 weight-only linear per mixture-of-experts expert: ``int8_expert_linear``.

Row p of x goes through expert ``experts[p]``'s int8 weight (and bias, for GPT-OSS): the expert
layers of Mixtral, Qwen-MoE, OLMoE, GPT-OSS ... with each (token, chosen expert) pair as one row.
The kernels read each expert's weight once for all the rows routed to it, and never read the
experts no row chose, so a decode step streams only the chosen experts' bytes (top-k of E), in int8.
"""

from __future__ import annotations

import torch

from gptfast_kernels import _extension
from gptfast_kernels.ops import reference
from gptfast_kernels.ops._dispatch import (FLOAT_DTYPES, check_same_device, check_tensor, needs_grad,
                                           resolve_backend, tracing_or_dispatch_mode)

OP = "int8_expert_linear"


def check_inputs(x, qweight, scales, experts, bias, op: str = OP) -> None:
    check_tensor(op, "x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(op, "qweight", qweight, dtypes=(torch.int8,), ndim=3)
    E, N, K = qweight.shape
    if E == 0 or K == 0:
        raise ValueError(f"{op}: qweight must be [E, N, K] with at least one expert and one input feature, "
                         f"got {list(qweight.shape)}")
    if x.shape[1] != K:
        raise ValueError(f"{op}: x must be [P, K] with K = {K} (qweight is [E, N, K] = {list(qweight.shape)}), "
                         f"got {list(x.shape)}")
    check_tensor(op, "scales", scales, dtypes=(torch.float32, x.dtype), ndim=2)
    if tuple(scales.shape) != (E, N):
        raise ValueError(f"{op}: scales must have shape [E, N] = [{E}, {N}], got {list(scales.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=FLOAT_DTYPES, ndim=2)
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"{op}: bias must have shape [E, N] = [{E}, {N}], got {list(bias.shape)}")
    check_tensor(op, "experts", experts, dtypes=(torch.int32, torch.int64), ndim=1)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: experts must have one entry per row of x ([P] = [{x.shape[0]}]), "
                         f"got {list(experts.shape)}")
    check_same_device(op, x=x, qweight=qweight, scales=scales, experts=experts, bias=bias)


def _check_expert_values(experts: torch.Tensor, E: int) -> None:
    """Value check that needs the data (one host synchronisation); skipped while tracing."""
    if experts.numel() == 0:
        return
    low, high = torch.stack([experts.min(), experts.max()]).tolist()
    if low < -1 or high >= E:
        raise ValueError(f"{OP}: experts must lie in [-1, E) = [-1, {E}) (-1 marks a padding row); "
                         f"got values from {low} to {high}")


def int8_expert_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                       bias: torch.Tensor | None = None, *, backend: str = "auto",
                       check_experts: bool = True) -> torch.Tensor:
    """y[p] = (x[p] @ qweight[experts[p]].T) * scales[experts[p]] + bias[experts[p]], accumulated in
    float32.

    x [P, K] float16/bfloat16/float32, qweight [E, N, K] int8, scales [E, N] float32 (or x's
    dtype), experts [P] int32/int64 in [-1, E) (-1: a padding row, whose output is zero), bias
    [E, N] (any float dtype; used in x's, as int8_linear's) or None -> [P, N] in x's dtype. In eager
    mode the expert ids are checked (one host synchronisation) unless ``check_experts=False``
    (routers produce valid ids by construction); the kernels treat any id outside [0, E) as padding
    and never read outside qweight either way.
    """
    check_inputs(x, qweight, scales, experts, bias)
    if check_experts and not tracing_or_dispatch_mode():
        _check_expert_values(experts, qweight.shape[0])
    chosen = resolve_backend(OP, backend, x.device)
    if chosen == "reference":
        return reference.int8_expert_linear(x, qweight, scales, experts, bias)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    x = x.contiguous()
    qweight = qweight.contiguous()
    scales = scales.to(torch.float32).contiguous()
    experts = experts.to(torch.int64).contiguous()
    if chosen == "triton":  # (checked above; see tracing_or_dispatch_mode)
        from gptfast_kernels.triton.int8_expert_linear import int8_expert_linear_triton, int8_expert_linear_unchecked

        # (the op where a gradient is wanted: its autograd formula is registered on it, not on the launch)
        direct = not tracing_or_dispatch_mode() and not needs_grad(x, bias)
        run = int8_expert_linear_unchecked if direct else int8_expert_linear_triton
        return run(x, qweight, scales, experts, bias)
    return torch.ops.gptfast_kernels.int8_expert_linear(x, qweight, scales, experts, bias)


def int8_expert_linear_fake(x, qweight, scales, experts, bias=None):
    """The fake (meta) implementation of the C++ and Triton int8_expert_linear ops; also their Meta
    kernel, so a call with one argument on meta and the rest elsewhere raises rather than answers."""
    check_same_device(OP, x=x, qweight=qweight, scales=scales, experts=experts, bias=bias)
    return x.new_empty((x.shape[0], qweight.shape[1]))


def setup_expert_grad(ctx, inputs, output) -> None:
    x, qweight, scales, experts, bias = inputs
    ctx.save_for_backward(qweight, scales, experts)
    ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype


def int8_expert_linear_backward(ctx, grad: torch.Tensor):
    """The int8_expert_linear ops' gradients, as int8_linear's (ops/int8_linear.py): x's through each
    row's expert's dequantised weight (one matmul per expert present), and the bias's; a padding
    row's are zero."""
    qweight, scales, experts = ctx.saved_tensors
    E = qweight.shape[0]
    valid = (experts >= 0) & (experts < E)
    grad32 = grad.to(torch.float32)
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad32.new_zeros(grad.shape[0], qweight.shape[2])
        for e in experts[valid].unique().tolist():
            rows = experts == e
            grad_x[rows] = grad32[rows] @ (qweight[e].to(torch.float32) * scales[e].to(torch.float32)[:, None])
        grad_x = grad_x.to(ctx.x_dtype)
    if ctx.needs_input_grad[4]:
        grad_bias = grad32.new_zeros(E, grad.shape[1]).index_add_(0, experts[valid], grad32[valid])
        grad_bias = grad_bias.to(ctx.bias_dtype)
    return grad_x, None, None, None, grad_bias


if _extension.has_kernel(OP, "CPU"):
    torch.library.register_fake(f"gptfast_kernels::{OP}")(int8_expert_linear_fake)
    torch.library.register_autograd(f"gptfast_kernels::{OP}", int8_expert_linear_backward,
                                    setup_context=setup_expert_grad)
