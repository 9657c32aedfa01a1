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
