"""Triton int8_expert_linear: row p of x times expert experts[p]'s int8 weight and scales (plus its
bias, if any), for the expert layers of mixture-of-experts models.

The grid is N tiles x E experts. Program (n tile, e) first counts the rows routed to expert e
(a scan of the P expert ids) and returns at once when there are none, so the weights of experts no
row chose are never read: a decode step streams only the chosen experts' bytes. Otherwise it runs
tl.dot tiles of rows x its N tile over K, with the int8 tile dequantised to x's dtype (exact: int8
values fit fp16 / bf16) and the scales applied after the K loop, so each weight tile is loaded
once per row tile of its expert:

* few rows (P <= the tuning's block_p: decode, verification): one row tile holds every row, padded
  to 16 for tl.dot; the rows of other experts are masked (loaded as zeros, never stored).
* more rows (prefill): the rows are first sorted by expert id (one argsort on the device, no host
  synchronisation), so expert e's rows are a contiguous range of the order, located by the scan
  (rows with smaller ids before it); its tiles gather x rows through the order and hold only
  expert e's rows (no MMA on other experts' rows, weights read once per block_p rows of e).

Rows whose id is outside [0, E) (-1 = padding; unchecked under torch.compile) match no expert and
are never used as an index; the programs of expert 0 write their zero output rows. Sums are float32.
Registered as ``gptfast_kernels::int8_expert_linear_triton`` (opaque to torch.compile);
``gptfast_kernels.ops.int8_expert_linear(..., backend="triton")`` calls it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gptfast_kernels.ops._dispatch import check_contiguous, check_tensor
from gptfast_kernels.ops.int8_expert_linear import (check_inputs, int8_expert_linear_backward, int8_expert_linear_fake,
                                                     setup_expert_grad)
from gptfast_kernels.triton import FP32_NUM_STAGES, dot, dot_in_fp32, on_device

# tl.dot needs at least 16 rows per tile: smaller row counts are padded with masked rows.
MIN_DOT_DIM = 16


class Tuning(NamedTuple):
    """Launch constants of one target (GPU or Triton interpreter)."""
    block_p: int     # most rows per tile; more rows than this are sorted by expert (grouped)
    block_n: int     # output features per program
    block_k: int     # input features per step of the K loop
    scan_block: int  # expert ids compared per step of the row count
    num_stages: int
    num_warps: int


# Not yet tuned on a GPU (none was available when this was written). Decode / verification
# (P <= 64) is memory-bound on the chosen experts' weights: the int8_linear skinny tile, whose
# narrow N tiles give 128 programs per chosen expert at N = 4096 (2 experts fill an H100's 132 SMs
# twice) and whose 4 stages of 256-deep K tiles keep ~32 KiB of weights in flight per SM.
_GPU_DECODE = Tuning(block_p=64, block_n=32, block_k=256, scan_block=64, num_stages=4, num_warps=4)
# Prefill (grouped rows): compute-bound, the usual 64 x 128 x 64 tensor-core tile; 256 ids per scan
# step keep the row count short next to the GEMM at P in the thousands.
_GPU_PREFILL = Tuning(block_p=64, block_n=128, block_k=64, scan_block=256, num_stages=3, num_warps=4)
# The interpreter runs every program in numpy: small tiles keep the tests quick, and make their
# small shapes (P up to ~40, N ~50, K ~100) span several row, N, K and scan tiles and the grouping.
_INTERPRETER = Tuning(block_p=16, block_n=16, block_k=32, scan_block=16, num_stages=1, num_warps=4)


@triton.jit
def _int8_expert_linear_kernel(X_ptr, W_ptr, S_ptr, B_ptr, Experts_ptr, Order_ptr, Y_ptr, P, N, K, E,
                               stride_xm, stride_xk, stride_we, stride_wn, stride_se, stride_ym,
                               HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, FP32_DOT: tl.constexpr,
                               SCAN_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)  # e * stride_we may pass 2^31 (E * N * K int8 weights above 2 GiB)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < N

    # Rows of expert e, and (grouped) rows with smaller ids: the start of e's range in the order.
    n_rows = 0
    n_before = 0
    for p0 in range(0, P, SCAN_BLOCK):
        offs_p = p0 + tl.arange(0, SCAN_BLOCK)
        ids = tl.load(Experts_ptr + offs_p, mask=offs_p < P, other=-1)
        n_rows += tl.sum((ids == e).to(tl.int32), axis=0)
        if GROUPED:
            n_before += tl.sum(((ids < e) & (offs_p < P)).to(tl.int32), axis=0)
    if e == 0:  # rows of no expert get zeros, from the programs of expert 0 (one per N tile)
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(Experts_ptr + offs_p, mask=offs_p < P, other=0)
            bad = (ids < 0) | (ids >= E)
            zeros = tl.zeros((BLOCK_P, BLOCK_N), dtype=Y_ptr.dtype.element_ty)
            tl.store(Y_ptr + offs_p[:, None].to(tl.int64) * stride_ym + offs_n[None, :], zeros,
                     mask=bad[:, None] & mask_n[None, :])
    if n_rows == 0:  # no row chose expert e: its weights are never read
        return

    if GROUPED:
        lo = n_before
        hi = n_before + n_rows
    else:
        lo = 0
        hi = P
    w_ptr = W_ptr + e * stride_we + offs_n[None, :] * stride_wn
    scales = tl.load(S_ptr + e * stride_se + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:  # bias [E, N] contiguous, in x's dtype
        shift = tl.load(B_ptr + e * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    for r0 in range(lo, hi, BLOCK_P):
        offs_r = r0 + tl.arange(0, BLOCK_P)
        if GROUPED:  # positions lo..hi of the order are exactly expert e's rows
            mask_r = offs_r < hi
            rows = tl.load(Order_ptr + offs_r, mask=mask_r, other=0)
        else:
            mask_r = (tl.load(Experts_ptr + offs_r, mask=offs_r < P, other=-1) == e) & (offs_r < P)
            rows = offs_r.to(tl.int64)
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(X_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptr + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0)
            if FP32_DOT:  # straight to float32: the Triton interpreter casts int8 -> bf16 to NaN
                acc += dot(x, w.to(tl.float32), FP32_DOT)
            else:  # int8 values in [-127, 127] are exact in fp16 / bf16: the MMA runs in x's dtype
                acc += dot(x, w.to(x.dtype), FP32_DOT)
        acc *= scales[None, :]
        if HAS_BIAS:
            acc += shift[None, :]
        tl.store(Y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc.to(Y_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_n[None, :])


def _tuning(device: torch.device, P: int) -> Tuning:
    if device.type != "cuda":
        return _INTERPRETER
    return _GPU_DECODE if P <= _GPU_DECODE.block_p else _GPU_PREFILL


def int8_expert_linear_tuned(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                             experts: torch.Tensor, bias: torch.Tensor | None, tune: Tuning) -> torch.Tensor:
    """The Triton op's computation with the launch constants ``tune`` (for tile tuning); inputs as
    ``int8_expert_linear_triton``'s."""
    P, K = x.shape
    E, N, _ = qweight.shape
    y = torch.empty((P, N), dtype=x.dtype, device=x.device)
    if P == 0 or N == 0:
        return y
    grouped = P > tune.block_p
    block_p = tune.block_p if grouped else min(max(triton.next_power_of_2(P), MIN_DOT_DIM), tune.block_p)
    order = torch.argsort(experts) if grouped else experts  # never read when not grouped
    with on_device(x):
        _int8_expert_linear_kernel[(triton.cdiv(N, tune.block_n), E)](
            x, qweight, scales, scales if bias is None else bias, experts, order, y, P, N, K, E,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, GROUPED=grouped, FP32_DOT=dot_in_fp32(x.dtype), SCAN_BLOCK=tune.scan_block,
            BLOCK_P=block_p, BLOCK_N=tune.block_n, BLOCK_K=tune.block_k,
            num_stages=FP32_NUM_STAGES if x.dtype == torch.float32 else tune.num_stages,
            num_warps=tune.num_warps)
    return y


def int8_expert_linear_unchecked(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                 experts: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_expert_linear_triton`` on inputs already checked (the public op's eager path)."""
    return int8_expert_linear_tuned(x, qweight, scales, experts, bias, _tuning(x.device, x.shape[0]))


@torch.library.custom_op("gptfast_kernels::int8_expert_linear_triton", mutates_args=())
def int8_expert_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                              experts: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [P, K] float (any strides), qweight [E, N, K] int8 contiguous, scales [E, N] float32
    contiguous, experts [P] int64 contiguous (outside [0, E): a zero row), bias [E, N] contiguous
    in x's dtype or None -> [P, N] in x's dtype. Checks them (ValueError naming the argument)."""
    op = "int8_expert_linear_triton"
    check_inputs(x, qweight, scales, experts, bias, op)
    check_tensor(op, "scales", scales, dtypes=(torch.float32,))
    check_tensor(op, "experts", experts, dtypes=(torch.int64,))
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=(x.dtype,))
    check_contiguous(op, qweight=qweight, scales=scales, experts=experts, bias=bias)
    return int8_expert_linear_unchecked(x, qweight, scales, experts, bias)


int8_expert_linear_triton.register_fake(int8_expert_linear_fake)
int8_expert_linear_triton.register_autograd(int8_expert_linear_backward, setup_context=setup_expert_grad)
