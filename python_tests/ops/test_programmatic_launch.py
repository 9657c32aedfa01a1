"""Programmatic dependent launches (each kernel may start while the kernel before it finishes, and
must still wait for it before touching memory): the CUDA int8 kernels launch so unless
GPTFAST_CUDA_PDL=0, the Triton decode attention only with GPTFAST_CUDA_PDL=1. The variable is read
once per process, so the GPU tests run their chains in processes of their own, in CUDA graphs,
against references; here, without a GPU, the variable's parsing (the kernels themselves compile for
sm_90a in test_triton_hopper_compile.py and test_cuda_kernel_resources.py)."""

import os
import subprocess
import sys

import pytest
import torch

import gptfast_kernels.triton as gptfast_triton
from gptfast_kernels import _extension

requires_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and _extension.has_kernel("int8_linear", "CUDA")),
    reason="requires CUDA and an extension built with CUDA")


def _run_with_programmatic_launches(code: str, value: str = "1") -> None:
    env = {**os.environ, "GPTFAST_CUDA_PDL": value}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("value, wanted", [("", False), ("0", False), ("1", True)])
def test_the_variable_turns_programmatic_launches_on(monkeypatch, value, wanted):
    monkeypatch.setenv("GPTFAST_CUDA_PDL", value)
    gptfast_triton._programmatic_launch_requested.cache_clear()
    try:
        assert gptfast_triton._programmatic_launch_requested() is wanted
        assert not gptfast_triton.programmatic_launch(torch.device("cpu"))  # never on the CPU
    finally:
        gptfast_triton._programmatic_launch_requested.cache_clear()


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("GPTFAST_CUDA_PDL", "yes")
    gptfast_triton._programmatic_launch_requested.cache_clear()
    try:
        with pytest.raises(ValueError, match="GPTFAST_CUDA_PDL must be 0 or 1, got 'yes'"):
            gptfast_triton.programmatic_launch(torch.device("cuda", 0))
    finally:
        gptfast_triton._programmatic_launch_requested.cache_clear()


@requires_cuda_kernels
@pytest.mark.parametrize("value", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 4])
def test_int8_linear_chain_in_a_cuda_graph(rows, value):
    """With programmatic launches (the default; GPTFAST_CUDA_PDL=1 the same) each int8_linear kernel
    may start while the one before it finishes, and must still read its x only after that one wrote
    it; with GPTFAST_CUDA_PDL=0 none does (read once per process, so a process of its own). A chain
    of layers, each fed the previous one's output (GEMVs back to back, K > N and K < N, one row on
    the GEMV or tensor cores, 4 rows on tensor cores), replayed in a CUDA graph against float64 and
    against the same chain run eagerly."""
    code = f"""
import torch
from gptfast_kernels import ops
torch.manual_seed(0)
sizes = [4096, 14336, 4096, 1024, 4096, 4096]
layers = [ops.quantize_int8(torch.randn(n, k, device='cuda') / k ** 0.5) for k, n in zip(sizes, sizes[1:])]
def chain(x):
    for qweight, scales in layers:
        x = torch.ops.gptfast_kernels.int8_linear(x, qweight, scales, None)
    return x
x = torch.randn({rows}, sizes[0], device='cuda', dtype=torch.bfloat16)
want = x.double()
for qweight, scales in layers:
    want = ((want @ qweight.double().T) * scales.double()).bfloat16().double()
static_x = x.clone()
torch.cuda.synchronize()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    chain(static_x)  # warm-up outside the capture
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = chain(static_x)
for trial in range(21):  # ends on x
    static_x.copy_(torch.randn_like(x) if trial % 2 else x)
    graph.replay()
    if trial % 2 == 0:
        err = ((static_y.double() - want).abs() / (want.abs() + 1)).max().item()
        assert err < 5e-2, (trial, err)
assert torch.equal(chain(x), static_y)
print('ok')
"""
    _run_with_programmatic_launches(code, value)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="requires a GPU of compute capability 9.0 or newer (programmatic launches)")
@pytest.mark.parametrize("T", [1, 5])
def test_triton_decode_attention_chain_in_a_cuda_graph(T):
    """Two decode attention calls (split kernel and combine each, Llama-3-8B heads, a 4k cache),
    the second's queries the first's output, then an int8 projection of it, in a CUDA graph with
    programmatic launches, against the reference on the same caches; replayed with other inputs
    between checks."""
    code = f"""
import torch
from gptfast_kernels import ops
torch.manual_seed(0)
B, Hq, Hkv, D, S, T = 2, 32, 8, 128, 4096, {T}
def randn(*shape):
    return torch.randn(*shape, device='cuda', dtype=torch.bfloat16)
caches = [(randn(B, Hkv, S, D), randn(B, Hkv, S, D)) for _ in range(2)]
new = [(randn(B, Hkv, T, D), randn(B, Hkv, T, D)) for _ in range(2)]
positions = torch.tensor([[3000 + t for t in range(T)], [4000 + t for t in range(T)]], device='cuda')
qweight, scales = ops.quantize_int8(torch.randn(1024, Hq * D, device='cuda') / (Hq * D) ** 0.5)
def chain(q, backend):
    for (k_cache, v_cache), (k, v) in zip(caches, new):
        q = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, backend=backend, check_positions=False)
    return ops.int8_linear(q.transpose(1, 2).reshape(B * T, Hq * D), qweight, scales, backend='cuda' if backend == 'triton' else backend)
q0 = randn(B, Hq, T, D)
want = chain(q0, 'reference').double()
static_q = q0.clone()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    chain(static_q, 'triton')  # warm-up outside the capture
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out = chain(static_q, 'triton')
for trial in range(11):  # ends on q0
    static_q.copy_(randn(B, Hq, T, D) if trial % 2 else q0)
    graph.replay()
    if trial % 2 == 0:
        err = ((static_out.double() - want).abs() / (want.abs() + 1)).max().item()
        assert err < 5e-2, (trial, err)
print('ok')
"""
    _run_with_programmatic_launches(code)
