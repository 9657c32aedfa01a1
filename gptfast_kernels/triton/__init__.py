"""Triton kernels, one module per op. Importing this package requires Triton; the op wrappers in
gptfast_kernels.ops import it lazily so the package works without Triton. This module holds what
the op modules share."""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc

from gptfast_kernels import _extension

# Software-pipeline stages for float32 inputs: Triton's default (3) double-buffers fp32 tiles and
# needs 180-390 KiB of shared memory on sm_90 for the attention tiles (measured with an AOT
# compile), past the 227 KiB an H100 block may use; one stage needs 48-128 KiB. fp32 is for
# correctness, bf16 / fp16 for speed.
FP32_NUM_STAGES = 1


def on_device(tensor: torch.Tensor):
    """Context that makes ``tensor``'s GPU current: Triton launches on the current device and its
    stream, whatever device the arguments are on."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


# SM count the split heuristics assume under the interpreter (there is no device to ask).
INTERPRETER_NUM_SMS = 16


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` for grid-size heuristics; INTERPRETER_NUM_SMS for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _programmatic_launch_requested() -> bool:
    value = os.environ.get("GPTFAST_CUDA_PDL", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"the environment variable GPTFAST_CUDA_PDL must be 0 or 1, got {value!r}")
    return value == "1"


def programmatic_launch(device: torch.device) -> bool:
    """Whether the Triton kernels written for it (the decode attention's) launch as programmatic
    dependent launches on ``device``: GPTFAST_CUDA_PDL=1 (read once per process, as the CUDA kernels
    read it) on a GPU of compute capability 9.0 or newer. Such a kernel may start while the one
    before it finishes; it calls ``wait_for_inputs`` before it touches memory and
    ``allow_dependents`` to let the next start. Off unless asked for, where the CUDA int8 kernels'
    launches are programmatic by default (csrc/cuda/cuda_common.cuh): on the H200 (2026-11-28,
    a284fc8, a decode step's attention calls in a CUDA graph) they made the decode attention
    slower, 13.5 -> 16.2 us per call at batch 1 and a 4k context, 42 -> 46 us at batch 8. Its
    kernels have since allowed the next launch only after their main loops, not first (not yet
    timed)."""
    if device.type != "cuda" or not _programmatic_launch_requested():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """griddepcontrol.wait when PDL (see programmatic_launch): the kernel before this one has
    finished and its writes are visible."""
    if PDL:
        gdc.gdc_wait()


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """griddepcontrol.launch_dependents when PDL: the next programmatic launch may start once every
    program of this grid has called it or exited."""
    if PDL:
        gdc.gdc_launch_dependents()


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``dot`` should multiply in float32: fp32 inputs keep full-precision products (no
    tf32), and the Triton interpreter computes dots with numpy, which has no bfloat16, so it upcasts
    bf16 tiles (exact for int8 weights)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _extension.triton_interpreting())


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """tl.dot, in full float32 when FP32_DOT (see dot_in_fp32)."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)
