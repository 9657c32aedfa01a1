"""Test set-up: Triton runs under its interpreter on CPU tensors when no GPU is present (this
must be decided before any Triton kernel is defined), seeds are fixed for every test."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _compiled_outputs_last_until_the_next_compiled_call(monkeypatch):
    """Holds every test to what CUDA graphs allow: on a GPU a compiled step's outputs live in the
    CUDA-graph memory pool, and the next compiled call (a new cudagraph-trees generation) may
    write over them (or, in the call that records its graph, make reading them an error). So here,
    at the start of every compiled call, the previous call's outputs are overwritten with garbage:
    code that reads one after the next compiled call fails on a CPU too."""
    from torch.utils._pytree import tree_leaves

    from gptfast_kernels.generation.forward import CompiledStep

    previous: list[torch.Tensor] = []
    original = CompiledStep.__call__

    def call(self, *args):
        for output in previous:  # (NaN: a distribution or a sample built on it fails loudly)
            output.fill_(float("nan") if output.is_floating_point() else True if output.dtype == torch.bool else -3)
        previous.clear()
        out = original(self, *args)
        previous.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(CompiledStep, "__call__", call)
    yield
