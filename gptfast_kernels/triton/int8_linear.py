"""Triton int8 weight-only linear: a GEMV kernel for one row, and a tiled tl.dot kernel for more
(skinny tiles up to 64 rows: batched decode and speculative verification; wide tiles above).

Registered as the custom op ``gptfast_kernels::int8_linear_triton`` (opaque to torch.compile,
safe in CUDA graphs); ``gptfast_kernels.ops.int8_linear(..., backend="triton")`` calls it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gptfast_kernels.ops._dispatch import check_contiguous, check_tensor
from gptfast_kernels.ops.int8_linear import (check_int8_linear, int8_linear_backward, int8_linear_fake,
                                              setup_int8_linear_grad)
from gptfast_kernels.triton import FP32_NUM_STAGES, dot_in_fp32, on_device

# Rows of x served by the GEMV kernel (CUDA-core FMAs, one output block per program). From 2 rows
# on, the tl.dot kernel reads each weight tile once for every row (the GEMV grid would re-stream
# the weights once per row) and runs the row products on tensor cores.
GEMV_MAX_ROWS = 1
# GEMV tile: BLOCK_N output features per program, BLOCK_K int8 weights per row per step.
# 16-byte int8 loads per thread need BLOCK_K >= 128 with 8 warps; chosen on the H100 target
# shapes (N, K in 4096..14336) to give >= 2 waves of programs over 132 SMs for N = 4096.
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 512
GEMV_NUM_WARPS = 8


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


# Skinny M (2..64 rows: batched decode, speculative verification): memory-bound on the weights.
# Narrow N tiles give >= 128 programs at N = 4096 (one per H100 SM) and deep K tiles with 4 stages
# keep ~32 KiB of weights in flight per SM (HBM3 needs ~23 KiB at ~1 us latency). Not yet measured.
SKINNY_MAX_ROWS = 64
_SKINNY = TileConfig(block_m=16, block_n=32, block_k=256, num_stages=4, num_warps=4)
# Prefill (more rows): compute-bound, the usual 64 x 128 x 64 tensor-core tile.
_PREFILL = TileConfig(block_m=64, block_n=128, block_k=64, num_stages=3, num_warps=4)


def _tile_config(M: int, dtype: torch.dtype) -> TileConfig:
    if M <= SKINNY_MAX_ROWS:
        # the M tile grows with M (tl.dot needs >= 16 rows) so one tile covers every row
        config = _SKINNY._replace(block_m=max(16, min(triton.next_power_of_2(M), SKINNY_MAX_ROWS)))
    else:
        config = _PREFILL
    return config._replace(num_stages=FP32_NUM_STAGES) if dtype == torch.float32 else config


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
        if FP32_DOT:  # straight to float32: the Triton interpreter casts int8 -> bf16 to NaN
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc *= tl.load(S_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def int8_linear_unchecked(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``int8_linear_triton`` on inputs already checked (gptfast_kernels.int8_linear's eager path)."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bias_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    with on_device(x):
        _launch(x, qweight, scales, bias_arg, bias is not None, y)
    return y


@torch.library.custom_op("gptfast_kernels::int8_linear_triton", mutates_args=())
def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float (any strides), qweight [N, K] int8 contiguous, scales [N] float32 contiguous,
    bias [N] contiguous or None -> [M, N] in x's dtype. Checks them (ValueError naming the argument)."""
    op = "int8_linear_triton"
    check_tensor(op, "x", x, ndim=2)
    check_int8_linear(x, qweight, scales, bias, op)
    check_tensor(op, "scales", scales, dtypes=(torch.float32,))
    check_contiguous(op, qweight=qweight, scales=scales, bias=bias)
    return int8_linear_unchecked(x, qweight, scales, bias)


def tiled_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      config: TileConfig) -> torch.Tensor:
    """The tiled kernel with the tile ``config`` given, whatever M (for tile tuning:
    bench/bench_int8_tiles.py); inputs as ``int8_linear_triton``'s, no bias."""
    y = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
    with on_device(x):
        _launch(x, qweight, scales, scales, False, y, config)
    return y


def _launch(x, qweight, scales, bias_arg, has_bias, y, config: TileConfig | None = None):
    M, K = x.shape
    N = qweight.shape[0]
    if M <= GEMV_MAX_ROWS and config is None:
        grid = (triton.cdiv(N, GEMV_BLOCK_N), M)
        _int8_linear_gemv_kernel[grid](
            x, qweight, scales, bias_arg, y, N, K, x.stride(0), x.stride(1), qweight.stride(0),
            y.stride(0), HAS_BIAS=has_bias, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
            num_warps=GEMV_NUM_WARPS)
    else:
        config = config or _tile_config(M, x.dtype)
        grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n))
        _int8_linear_tiled_kernel[grid](
            x, qweight, scales, bias_arg, y, M, N, K, x.stride(0), x.stride(1), qweight.stride(0),
            y.stride(0), HAS_BIAS=has_bias, FP32_DOT=dot_in_fp32(x.dtype),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_stages=config.num_stages, num_warps=config.num_warps)


int8_linear_triton.register_fake(int8_linear_fake)
int8_linear_triton.register_autograd(int8_linear_backward, setup_context=setup_int8_linear_grad)
