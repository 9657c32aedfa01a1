"""int8 weight-only linear: ``quantize_int8`` and ``int8_linear`` (API.md section 1)."""

from __future__ import annotations

import torch

from gptfast_kernels import _extension
from gptfast_kernels.ops import reference
from gptfast_kernels.ops._dispatch import (FLOAT_DTYPES, check_same_device, check_tensor, gpu_backend, needs_grad,
                                           resolve_backend, tracing_or_dispatch_mode)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float16/bfloat16/float32 -> (qweight [N, K] int8, scales [N] float32).

    Symmetric per output channel: scales = max|w[n, :]| / 127 (1 for an all-zero row). A NaN or an
    infinity has no int8 code (its row's scale would be NaN or inf, or the NaN would read as 0), so
    a weight holding one is refused (one host sync: quantisation happens once, at load time)."""
    check_tensor("quantize_int8", "weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.shape[1] == 0:
        raise ValueError("quantize_int8: weight must have at least one input feature (K >= 1), "
                         f"got shape {list(weight.shape)}")
    if weight.device.type != "meta" and not tracing_or_dispatch_mode():  # (meta: a model built without data)
        finite = torch.isfinite(weight).all(dim=1)
        if not bool(finite.all()):
            rows = (~finite).nonzero().flatten()
            raise ValueError(f"quantize_int8: weight must be finite (no NaN or inf), got {rows.numel()} row(s) "
                             f"that are not, the first being row {int(rows[0])}")
    if _extension.extension_loaded():
        return torch.ops.gptfast_kernels.quantize_int8(weight)
    return reference.quantize_int8(weight)


def check_int8_linear(x, qweight, scales, bias, op: str = "int8_linear") -> None:
    check_tensor(op, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dimension [..., K], got a scalar")
    check_tensor(op, "qweight", qweight, dtypes=(torch.int8,), ndim=2)
    N, K = qweight.shape
    if K == 0:
        raise ValueError(f"{op}: qweight must have at least one input feature (K >= 1), "
                         f"got shape {list(qweight.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"{op}: x's last dimension ({x.shape[-1]}) must equal qweight's in_features "
                         f"K = {K} (qweight is [N, K] = {list(qweight.shape)})")
    check_tensor(op, "scales", scales, dtypes=(torch.float32, x.dtype), ndim=1)
    if scales.shape[0] != N:
        raise ValueError(f"{op}: scales must have shape [N] = [{N}], got {list(scales.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"{op}: bias must have shape [N] = [{N}], got {list(bias.shape)}")
    check_same_device(op, x=x, qweight=qweight, scales=scales, bias=bias)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """y = (x @ qweight.T) * scales + bias, accumulated in float32.

    x [..., K] float16/bfloat16/float32, qweight [N, K] int8, scales [N] float32 (or x's dtype),
    bias [N] or None -> [..., N] in x's dtype. backend: "auto" | "cuda" | "triton" | "cpu" |
    "reference".
    """
    check_int8_linear(x, qweight, scales, bias)
    rows = x.numel() // x.shape[-1]  # K >= 1 (checked)
    chosen = resolve_backend("int8_linear", backend, x.device,
                             auto=lambda usable: auto_backend(usable, rows, qweight.shape[1], qweight.shape[0]))
    return run_int8_linear(chosen, x, qweight, scales, bias)


# Measured on an H200 (bench/results/nvidia-h200_2026-11-28_*, bf16, CUDA-graph replays of a decode
# step's layers back to back and of single calls; shapes N x K): the CUDA op is the fastest for one
# row on every Llama-3-8B shape (4096 x 4096: 251 us for 32 layers against Triton's 312; it takes
# one row to its GEMV, or to tensor cores where K > N: see csrc/cuda/int8_linear.cu). For 2-16 rows
# the CUDA tensor-core GEMV wins where the weight rows are long (K >= N: 4096 x 14336 at 4-8 rows,
# 194 against 245) and Triton's tiles where there are many short ones (14336 x 4096 at 4-8 rows: 192
# against 222; at 16 rows 189 against 313); at 16 rows of 4096 x 4096 they tie (306 / 310). From 40
# rows on Triton wins everywhere (4096 x 4096, M = 40: 20 us against 29).
CUDA_MAX_ROWS = 16


def auto_backend(usable: list[str], rows: int, K: int, N: int) -> str:
    """backend="auto" for M = ``rows`` rows of x, K input and N output features: on a GPU the CUDA
    kernel or Triton by shape, on a CPU the C++ kernel; the reference where nothing else is usable."""
    return gpu_backend(usable, rows <= 1 or (rows <= CUDA_MAX_ROWS and N <= K))


def run_int8_linear(chosen: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear on already-checked inputs with a resolved backend (Int8Linear's fast path)."""
    if chosen == "reference":
        return reference.int8_linear(x, qweight, scales, bias)
    # Int8Linear calls this for every linear of every decode step, so conversions that are usually
    # no-ops are skipped by a dtype test rather than dispatched (each dispatch costs ~1 us on a CPU).
    lead_shape = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    qweight = qweight.contiguous()
    if scales.dtype != torch.float32:
        scales = scales.to(torch.float32)
    scales = scales.contiguous()
    if bias is not None:
        bias = (bias if bias.dtype == x.dtype else bias.to(x.dtype)).contiguous()
    if chosen == "triton":  # (checked above; see tracing_or_dispatch_mode)
        from gptfast_kernels.triton.int8_linear import int8_linear_triton, int8_linear_unchecked

        # (the op where a gradient is wanted: its autograd formula is registered on it, not on the launch)
        direct = not tracing_or_dispatch_mode() and not needs_grad(x2d, bias)
        y = (int8_linear_unchecked if direct else int8_linear_triton)(x2d, qweight, scales, bias)
    else:  # the compiled CPU or CUDA kernel, chosen by the dispatcher from x's device
        y = torch.ops.gptfast_kernels.int8_linear(x2d, qweight, scales, bias)
    return y.reshape(*lead_shape, qweight.shape[0])


def int8_linear_fake(x, qweight, scales, bias):
    """The fake (meta) implementation of the C++ and Triton int8_linear ops; also their Meta
    kernel, so a call with one argument on meta and the rest elsewhere raises rather than answers."""
    check_same_device("int8_linear", x=x, qweight=qweight, scales=scales, bias=bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


def setup_int8_linear_grad(ctx, inputs, output) -> None:
    x, qweight, scales, bias = inputs
    ctx.save_for_backward(qweight, scales)
    ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype


def int8_linear_backward(ctx, grad: torch.Tensor):
    """The int8_linear ops' gradients: x's through the dequantised weight (in float32), and the
    bias's. The int8 weight and its scales are constants: weight-only quantization trains no
    weight, but layers before (adapters, a float model below) get their gradients through it."""
    qweight, scales = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight = qweight.to(torch.float32) * scales.to(torch.float32)[:, None]
        grad_x = (grad.to(torch.float32) @ weight).to(ctx.x_dtype)
    if ctx.needs_input_grad[3]:
        grad_bias = grad.to(torch.float32).sum(dim=0).to(ctx.bias_dtype)
    return grad_x, None, None, grad_bias


if _extension.extension_loaded():
    torch.library.register_fake("gptfast_kernels::int8_linear")(int8_linear_fake)
    torch.library.register_autograd("gptfast_kernels::int8_linear", int8_linear_backward,
                                    setup_context=setup_int8_linear_grad)
