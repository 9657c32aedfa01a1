"""Where a decode step's time goes: the compiled step ``generate`` replays (a CUDA graph on a GPU),
profiled over STEPS steps, its time split by kernel family, so that a GPU session can tell which of
the int8 projections, the attention, the other kernels (inductor's fused norms, rotary embeddings,
activations, sampling) and the gaps between kernels stands between a model and its bandwidth bound.

GPU: Llama-3-8B shapes (bench_generate's), bf16 activations, int8 weights, batch 1 and 8, a 4k
prompt's cache (so that attention reads what it reads at that context). Each row is one family:
microseconds per step, kernels per step and its share of the step's wall time (measured without the
profiler); the row "idle" is the wall time no kernel covered (launch gaps, the graph's own overhead).
Kernels that overlap (a programmatic launch starts during its predecessor and waits) count once, the
overlap for the kernel that started first (exclusive_times).
Then rows "kernel": the TOP_KERNELS longest kernels by name, each with its family.
The rows' names carry the launch choices' suffix (bench.harness.pdl_suffix: "_pdl", "_nopdl", ...).
CPU: bench_generate's 125M shape, eager; the families are the ops' own (self) CPU time.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_generate import CPU_CONFIG, GPU_CONFIG
from bench.harness import PDL_SUFFIX, default_dtype, synchronize

STEPS = 20
TOP_KERNELS, NAME_CHARS = 16, 160
GPU_CONTEXT, CPU_CONTEXT = 4096, 256
# (family, substrings of kernel / op names that belong to it), first match wins
FAMILIES = (
    ("int8_linear", ("int8_linear",)),
    ("attention", ("kv_cache_attention", "kv_attention")),
    ("other", ("",)),
)
# Kernels inductor generates (triton_poi_fused_..., triton_red_..., cpp_fused_...) are "other" whatever
# their names hold: inductor names a fused kernel after the ops of its nodes' origins, and the norm
# feeding a projection becomes e.g. triton_red_fused_add_int8_linear_mean_mul_pow_rsqrt_0. (Until
# 2026-11-28 they counted as int8 projections and attention: the H200's batch-1 breakdown at a284fc8
# gave those 226 and 129 kernels a step for 129 and 64 of ours.) The package's own Triton kernels'
# names begin with an underscore, its CUDA kernels' with their return type.
GENERATED_PREFIXES = ("triton_", "cpp_fused_")


def family_of(name: str) -> str:
    if name.startswith(GENERATED_PREFIXES):
        return "other"
    return next(family for family, pieces in FAMILIES if any(piece in name for piece in pieces))


def cpu_op_times(events) -> dict[str, tuple[float, int]]:
    """op name -> (self time in us, count) over the profiler's averaged CPU events: the ops' own time
    (not their children's), so that nothing is counted twice."""
    times: dict[str, tuple[float, int]] = {}
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        time_us, count = times.get(event.key, (0.0, 0))
        times[event.key] = (time_us + event.self_cpu_time_total, count + event.count)
    return times


def kernel_intervals(events) -> list[tuple[str, float, float]]:
    """(name, start, end) in us of every GPU kernel (and copy) among the profiler's events."""
    return [(event.name, event.time_range.start, event.time_range.end) for event in events
            if event.device_type == DeviceType.CUDA]


def exclusive_times(intervals: list[tuple[str, float, float]]) -> dict[str, tuple[float, int]]:
    """name -> (time in us, count) of kernels given as (name, start, end) intervals, each kernel
    counted from its start or from the end of every kernel that started before it, whichever is
    later: the times partition the span the kernels cover. A programmatic dependent launch starts
    while the kernel before it still runs and waits for it (GPTFAST_CUDA_PDL, on by default for the
    CUDA int8 kernels); its own duration would count that wait, and the families' sum would pass
    the step."""
    times: dict[str, tuple[float, int]] = {}
    reached = float("-inf")
    for name, start, end in sorted(intervals, key=lambda interval: interval[1]):
        own = max(0.0, end - max(start, reached))
        reached = max(reached, end)
        time_us, count = times.get(name, (0.0, 0))
        times[name] = (time_us + own, count + 1)
    return times


def breakdown(times: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """family -> (time in us, count) of exclusive_times' or cpu_op_times' entries."""
    totals: dict[str, tuple[float, int]] = {family: (0.0, 0) for family, _ in FAMILIES}
    for name, (us, count) in times.items():
        family = family_of(name)
        time_us, calls = totals[family]
        totals[family] = (time_us + us, calls + count)
    return totals


def step_rows(h, model, name: str, rows: int, context: int, steps: int = STEPS) -> list[dict]:
    """The breakdown rows of ``steps`` decode steps of ``model`` (patched; named ``name`` in them) at
    batch ``rows`` after a ``context``-token prompt."""
    from gptfast_kernels import StaticKVCache
    from gptfast_kernels.generation.forward import step_function
    from gptfast_kernels.models.patch import forward_with_cache

    on_gpu = h.device.type == "cuda"
    config = model.config
    dtype = next(model.parameters()).dtype
    cache = StaticKVCache(config, rows, context + 4 * steps, device=h.device, dtype=dtype)
    prompt = torch.randint(0, config.vocab_size, (rows, context), device=h.device)
    with torch.no_grad():
        forward_with_cache(model, prompt, cache, logits_to_keep=1)
    step = step_function(model, compile=on_gpu)
    token = torch.randint(0, config.vocab_size, (rows, 1), device=h.device)
    real = torch.ones_like(token, dtype=torch.bool)

    def run(n):
        with torch.no_grad():
            for _ in range(n):
                step(token, real, cache)
        synchronize(h.device)

    run(3)  # compile and capture (the cache has room for them: 4 * steps slots past the prompt)
    start = time.perf_counter()
    run(steps)
    wall_us = (time.perf_counter() - start) / steps * 1e6
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as profile:
        run(steps)
    if on_gpu:  # kernels that overlap (programmatic launches) count once (exclusive_times)
        times = exclusive_times(kernel_intervals(profile.events()))
    else:
        times = cpu_op_times(profile.key_averages())
    totals = breakdown(times)
    case = {"op": "decode_step", "model": name,
            "batch": rows, "context": context, "dtype": str(dtype)[6:], "step_us": wall_us, **h.meta}
    out = []
    covered = 0.0
    for family, (time_us, count) in totals.items():
        per_step = time_us / steps
        covered += per_step
        out.append({**case, "impl": family + PDL_SUFFIX, "us_per_step": per_step, "calls_per_step": count / steps,
                    "share_of_step": per_step / wall_us})
    idle = max(wall_us - covered, 0.0)
    out.append({**case, "impl": "idle" + PDL_SUFFIX, "us_per_step": idle, "calls_per_step": 0.0,
                "share_of_step": idle / wall_us})
    # the TOP_KERNELS longest kernels (ops on the CPU) by name, each with its family, so that a run
    # says which kernels a family's time is in (names cut to NAME_CHARS: C++ templates run long)
    for name, (time_us, count) in sorted(times.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]:
        out.append({**case, "impl": "kernel" + PDL_SUFFIX, "kernel": name[:NAME_CHARS], "family": family_of(name),
                    "us_per_step": time_us / steps, "calls_per_step": count / steps,
                    "share_of_step": time_us / steps / wall_us})
    return out


def run(h) -> None:
    from gptfast_kernels import patch_model

    on_gpu = h.device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)
    with torch.device(h.device), default_dtype(dtype):
        model = patch_model(LlamaForCausalLM(LlamaConfig(**(GPU_CONFIG if on_gpu else CPU_CONFIG))).eval())
    for rows in ((1, 8) if on_gpu and not h.quick else (1,)):
        name = "llama-3-8B-shape random, int8" if on_gpu else "llama-125M-shape random, int8"
        for row in step_rows(h, model, name, rows, GPU_CONTEXT if on_gpu else CPU_CONTEXT):
            h.rows.append(row)
            what = f"{row['family']:<12} {row['kernel'][:90]}" if "kernel" in row else row["impl"]
            print(f"decode step B={rows}: {what:<16} {row['us_per_step']:9.1f} us "
                  f"({row['share_of_step']:6.1%}), {row['calls_per_step']:6.1f} calls")
