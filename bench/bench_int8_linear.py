"""int8_linear against F.linear in the activation dtype and torch._weight_int8pack_mm."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.harness import PDL_SUFFIX, add_cpu_isa_rows, cpu_isa_of_row
from bench.read_floor import read_floor_candidates
from gptfast_kernels import ops

# decode (1), batched decode (4, 8, 16), speculative verification with k = 4 at B = 1 and 8 (5, 40), prefill
ROWS = (1, 4, 5, 8, 16, 40, 256)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K): Llama-3-8B attention / MLP
# GPTFAST_INT8_CUDA_KERNEL (read once per process, see csrc/cuda/int8_linear.cu) moves the CUDA op
# to other kernels: "tensor_core" takes one row on tensor cores too, "fma" keeps 2-16 rows on the FMA
# GEMV. A second process times such a choice on the rows it changes (--cases one_row or multi_row)
# against the default's figures (bench/gpu_run.sh, stage int8-kernels); its rows carry the choice in
# their names.
CUDA_KERNEL = os.environ.get("GPTFAST_INT8_CUDA_KERNEL", "")
# GPTFAST_INT8_GEMV picks the one-row GEMV's unroll depth and features per warp (u4f1 the default):
# bench/gpu_run.sh's int8-gemv stage times each in a process of its own (--cases layers,one_row).
GEMV_SHAPE = os.environ.get("GPTFAST_INT8_GEMV", "")
ROWS_OF_CASE = {"one_row": (1,), "multi_row": (4, 5, 8, 16), "prefill": (256, 1024)}  # prefill: a long prompt too


# --cases layers: a decode step's linears as they run in it, back to back in one CUDA graph, rather
# than one call between two events after an L2 flush (whose fixed cost, the launch and the first
# loads' latency, is a large share of a few-microsecond call). Each shape gets as many layers of
# distinct weights as fill LAYERS_BYTES of int8 (ten times an H100's or H200's L2, so every layer
# reads cold weights), and a row is the time of all of them (its GB/s: all their bytes).
LAYERS_BYTES = 512 << 20
LAYERS_QUICK_BYTES = 64 << 20
LAYERS_ROWS = (1, 4, 8, 16)


def graph_suffix(device: torch.device) -> str:
    """This process's kernel choices (GPTFAST_INT8_CUDA_KERNEL, GPTFAST_INT8_GEMV, GPTFAST_CUDA_PDL) as
    the graphed CUDA candidate's name carries them ("" on a CPU)."""
    if device.type != "cuda":
        return ""
    return "".join(f"_{choice}" for choice in (CUDA_KERNEL, GEMV_SHAPE) if choice) + PDL_SUFFIX


def min_bytes(M: int, N: int, K: int, element_size: int) -> int:
    """What one call must move: int8 weights + scales + activations in + out."""
    return N * K + 4 * N + element_size * M * (K + N)


def projection_candidates(inputs: dict, weights: list, quantized: list, baseline: str, suffix: str,
                          device: torch.device) -> dict:
    """Candidates for harness.compare, each running every projection (``weights`` float [N, K], each with
    its (qweight, scales) in ``quantized``) on the input of its width (``inputs``: K -> [M, K]) and
    returning the outputs. On a GPU at the default kernel choices (no ``suffix``) also Triton's and, at
    one row, the read floor over the int8 weights (one launch a projection: bench/read_floor.py)."""
    candidates = {baseline: lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
                  "ours_auto": lambda: [ops.int8_linear(inputs[q.shape[1]], q, s) for q, s in quantized]}
    if device.type == "cuda":
        candidates["ours_cuda" + suffix] = lambda: [ops.int8_linear(inputs[q.shape[1]], q, s, backend="cuda")
                                                    for q, s in quantized]
        if not suffix:
            candidates["ours_triton"] = lambda: [ops.int8_linear(inputs[q.shape[1]], q, s, backend="triton")
                                                 for q, s in quantized]
            if next(iter(inputs.values())).shape[0] == 1:
                candidates.update(read_floor_candidates([q.view(1, -1) for q, _ in quantized]))
    return candidates


def run_layers(h, dtype, shapes) -> None:
    device = h.device
    one_row = h.quick or "one_row" in h.cases
    suffix = graph_suffix(device)
    for N, K in shapes:
        layers = max(2, (LAYERS_QUICK_BYTES if h.quick else LAYERS_BYTES) // (N * K))
        weights = [torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5 for _ in range(layers)]
        quantized = [ops.quantize_int8(weight) for weight in weights]
        for M in (1,) if one_row else LAYERS_ROWS:
            x = torch.randn(M, K, device=device, dtype=dtype)
            baseline = f"F.linear_{str(dtype)[6:]}"
            candidates = projection_candidates({K: x}, weights, quantized, baseline, suffix, device)
            nbytes = layers * min_bytes(M, N, K, x.element_size())
            h.compare("int8_linear", {"M": M, "N": N, "K": K, "dtype": str(dtype)[6:], "layers": layers},
                      candidates, baseline=baseline, nbytes=nbytes, graphed=tuple(candidates))
        del weights, quantized


# --cases step: every int8 projection of a decode step as the patched model runs it (q / k / v and
# gate / up fused: modules/fused_qkv.py, modules/gated_mlp.py), each layer's weights distinct, then
# the output head, back to back in one CUDA graph, at generate's batch 1 / 8 / 32. The shapes of
# `layers` are the model's unfused ones, three of its five; here a row is the time of the whole
# step's projections (Llama-3-8B: 129, 7.5 GB of int8) and its GB/s over all their bytes, the figure
# the end-to-end decode rate rests on. Nothing runs between the projections (no norms, no attention),
# so a programmatic launch overlaps more than it can in a real step. On a CPU, and with --quick, a
# two-layer model of the same proportions (the bf16 baseline's 15 GB would not fit a small machine).
@dataclass(frozen=True)
class StepModel:
    name: str
    hidden: int
    qkv: int  # the fused q / k / v projection's outputs: (query heads + 2 x kv heads) x head_dim
    intermediate: int
    vocab: int
    layers: int

    def projections(self) -> list[tuple[int, int]]:
        """(N, K) of every int8 projection of one decode step, in the order the step runs them."""
        layer = [(self.qkv, self.hidden), (self.hidden, self.hidden), (2 * self.intermediate, self.hidden),
                 (self.hidden, self.intermediate)]
        return layer * self.layers + [(self.vocab, self.hidden)]


LLAMA3_8B = StepModel("llama-3-8b", hidden=4096, qkv=(32 + 2 * 8) * 128, intermediate=14336, vocab=128256,
                      layers=32)
SMALL_STEP = StepModel("small", hidden=256, qkv=(8 + 2 * 2) * 32, intermediate=896, vocab=2048, layers=2)
STEP_ROWS = (1, 8, 32)


def run_step(h, dtype) -> None:
    device = h.device
    model = LLAMA3_8B if device.type == "cuda" and not h.quick else SMALL_STEP
    suffix = graph_suffix(device)
    weights, quantized = [], []
    for N, K in model.projections():
        weights.append(torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5)
        quantized.append(ops.quantize_int8(weights[-1]))
    baseline = f"F.linear_{str(dtype)[6:]}"
    for M in (1,) if "one_row" in h.cases else STEP_ROWS:
        inputs = {K: torch.randn(M, K, device=device, dtype=dtype) for K in {model.hidden, model.intermediate}}
        candidates = projection_candidates(inputs, weights, quantized, baseline, suffix, device)
        nbytes = sum(min_bytes(M, N, K, inputs[K].element_size()) for N, K in model.projections())
        h.compare("int8_linear", {"M": M, "step": model.name, "projections": len(weights), "dtype": str(dtype)[6:]},
                  candidates, baseline=baseline, nbytes=nbytes, graphed=tuple(candidates))
    del weights, quantized


def run(h) -> None:
    device = h.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SHAPES[:1] if h.quick else SHAPES
    if h.cases is not None and "step" in h.cases:
        run_step(h, dtype)
    if h.cases is not None and "layers" in h.cases:
        run_layers(h, dtype, shapes)
    if h.cases is not None and h.cases & {"layers", "step"} and not h.cases & (set(ROWS_OF_CASE) - {"one_row"}):
        return
    named = [case for case in ROWS_OF_CASE if h.cases is not None and case in h.cases]
    rows = sorted({m for case in named for m in ROWS_OF_CASE[case]}) if named else ROWS
    suffix = f"_{CUDA_KERNEL}" if CUDA_KERNEL and device.type == "cuda" else ""
    for N, K in shapes:
        weight = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
        qweight, scales = ops.quantize_int8(weight)
        for M in rows:
            x = torch.randn(M, K, device=device, dtype=dtype)
            candidates = {f"F.linear_{str(dtype)[6:]}": lambda: F.linear(x, weight)}
            if device.type == "cpu" or dtype != torch.float32:
                # _weight_int8pack_mm takes the same per-channel int8 layout (scales in x's dtype)
                candidates["torch._weight_int8pack_mm"] = (
                    lambda: torch._weight_int8pack_mm(x, qweight, scales.to(dtype)))
            candidates["ours_auto" + suffix] = lambda: ops.int8_linear(x, qweight, scales)
            if device.type == "cuda":
                candidates["ours_cuda" + suffix] = lambda: ops.int8_linear(x, qweight, scales, backend="cuda")
                candidates["ours_triton"] = lambda: ops.int8_linear(x, qweight, scales,
                                                                    backend="triton")
            add_cpu_isa_rows(candidates, device, "ours_auto")
            nbytes = min_bytes(M, N, K, x.element_size())
            # as a decode step runs them: in a CUDA graph, without the host's launch work
            graphed = tuple(name for name in candidates if name != "torch._weight_int8pack_mm")
            h.compare("int8_linear", {"M": M, "N": N, "K": K, "dtype": str(dtype)[6:], **cpu_isa_of_row(device)},
                      candidates, baseline=f"F.linear_{str(dtype)[6:]}", nbytes=nbytes, graphed=graphed)
