"""Triton int8 weight-only linear: a GEMV kernel for decode and a tiled tl.dot kernel for prefill.

Registered as the custom op ``gptfast_kernels::int8_linear_triton`` (opaque to torch.compile,
safe in CUDA graphs); ``gptfast_kernels.ops.int8_linear(..., backend="triton")`` calls it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptfast_kernels import _extension
from gptfast_kernels.triton import on_device

# Rows of x up to which the GEMV kernel is used; above it tl.dot tiles win (tensor cores need
# at least 16 rows per tile, and a 16-row tile with 1-4 real rows wastes most of the MMA).
GEMV_MAX_ROWS = 4
# GEMV tile: BLOCK_N output features per program, BLOCK_K int8 weights per row per step.
# 16-byte int8 loads per thread need BLOCK_K >= 128 with 8 warps; chosen on the H100 target
# shapes (N, K in 4096..14336) to give >= 2 waves of programs over 132 SMs for N = 4096.
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 512
# Prefill tiles (H100-class defaults; the tiled path is compute-bound).
TILE_BLOCK_N = 128
TILE_BLOCK_K = 64
TILE_BLOCK_M_SMALL = 16   # for 5..16 rows
TILE_BLOCK_M_LARGE = 64


@triton.jit
def _int8_linear_gemv_kernel(X_ptr, W_ptr, S_ptr, B_ptr, Y_ptr, N, K,
                             stride_xm, stride_xk, stride_wn, stride_ym,
                             HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X_ptr + m * stride_xm + offs_k * stride_xk, mask=mask_k, other=0.0)
        w = tl.load(W_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    acc *= tl.load(S_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y_ptr + m * stride_ym + offs_n, acc.to(Y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _int8_linear_tiled_kernel(X_ptr, W_ptr, S_ptr, B_ptr, Y_ptr, M, N, K,
                              stride_xm, stride_xk, stride_wn, stride_ym,
                              HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0)
        # int8 values in [-127, 127] are exact in fp16/bf16, so the MMA runs in x's dtype.
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc *= tl.load(S_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 activations keep full-precision products (no tf32). The Triton interpreter computes
    # dots with numpy, which has no bfloat16, so it upcasts bf16 tiles (exact for the int8 side).
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _extension.triton_interpreting())


@torch.library.custom_op("gptfast_kernels::int8_linear_triton", mutates_args=())
def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float (any strides), qweight [N, K] int8 contiguous, scales [N] float32,
    bias [N] or None -> [M, N] in x's dtype."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bias_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    with on_device(x):
        _launch(x, qweight, scales, bias_arg, bias is not None, y)
    return y


def _launch(x, qweight, scales, bias_arg, has_bias, y):
    M, K = x.shape
    N = qweight.shape[0]
    if M <= GEMV_MAX_ROWS:
        grid = (triton.cdiv(N, GEMV_BLOCK_N), M)
        _int8_linear_gemv_kernel[grid](
            x, qweight, scales, bias_arg, y, N, K, x.stride(0), x.stride(1), qweight.stride(0),
            y.stride(0), HAS_BIAS=has_bias, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K)
    else:
        block_m = TILE_BLOCK_M_SMALL if M <= 16 else TILE_BLOCK_M_LARGE
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, TILE_BLOCK_N))
        _int8_linear_tiled_kernel[grid](
            x, qweight, scales, bias_arg, y, M, N, K, x.stride(0), x.stride(1), qweight.stride(0),
            y.stride(0), HAS_BIAS=has_bias, FP32_DOT=_dot_in_fp32(x.dtype),
            BLOCK_M=block_m, BLOCK_N=TILE_BLOCK_N, BLOCK_K=TILE_BLOCK_K)


@int8_linear_triton.register_fake
def _(x, qweight, scales, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))
