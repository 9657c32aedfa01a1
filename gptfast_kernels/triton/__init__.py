"""Triton kernels, one module per op. Importing this package requires Triton; the op wrappers in
gptfast_kernels.ops import it lazily so the package works without Triton."""

import contextlib

import torch


def on_device(tensor: torch.Tensor):
    """Context that makes ``tensor``'s GPU current: Triton launches on the current device and its
    stream, whatever device the arguments are on."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
