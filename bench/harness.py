"""The one benchmark harness: timing, metadata and JSON output shared by every bench_<op>.py.

GPU: CUDA events around each call, after a read-only L2 flush (do_bench's method otherwise),
reporting the 20th / 50th / 80th percentile; the candidates a bench marks as capturable are also
timed as CUDA-graph replays ("<name>@graph" rows), which leave out the host's launch work.
CPU: a plain timer loop with warm-up and the caches flushed before every timed call, same
percentiles. Every row carries the device, torch version, commit and date, so results from
different machines never get mixed up.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

CPU_WARMUP = 3
CPU_MIN_REPEATS = 10
CPU_MIN_SECONDS = 0.5
CPU_MAX_REPEATS = 50  # each repeat also pays a cache flush
# Bytes written between timed CPU calls so that inputs do not stay cache-resident (as do_bench
# flushes the GPU's L2): twice the machine's largest cache, at least twice the 32 MiB L3 of the AVX2
# EPYC these benchmarks first ran on. Without it a 16 MB int8 weight matrix is read from L3 and
# "beats" DRAM copy bandwidth; the Sapphire Rapids VM's L3 is 260 MiB, past a fixed 64 MiB flush.
CPU_MIN_FLUSH_BYTES = 64 << 20
_cpu_flush_buffer: torch.Tensor | None = None


def largest_cpu_cache_bytes() -> int:
    """The largest cache of CPU 0 as Linux's sysfs lists it (0 where it cannot be read)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


CPU_FLUSH_BYTES = max(CPU_MIN_FLUSH_BYTES, 2 * largest_cpu_cache_bytes())
# GPU: as triton.testing.do_bench (25 ms of warm-up, about 100 ms of timed calls), but with a
# read-only L2 flush (see _flush_gpu_l2) of 256 MB, five times an H100's or H200's 50 MB L2.
GPU_WARMUP_MS, GPU_REP_MS = 25.0, 100.0
GPU_ESTIMATE_CALLS = 5
GPU_MIN_REPEATS, GPU_MAX_REPEATS = 10, 1000
GPU_FLUSH_BYTES = 256 << 20
GRAPH_WARMUP_CALLS = 3  # before a CUDA-graph capture (cuda_graph_replay)
# environment variables that pick kernels (recorded in every row's metadata when set)
KERNEL_CHOICE_VARIABLES = ("GPTFAST_INT8_CUDA_KERNEL", "GPTFAST_INT8_GEMV", "GPTFAST_CUDA_PDL",
                           "TORCHINDUCTOR_ENABLE_PDL")
# GPTFAST_CUDA_PDL (read once per process, as the kernels read it): unset, the CUDA int8 kernels
# launch as programmatic dependent launches and the Triton decode attention does not; 1, both do; 0,
# neither (csrc/cuda/cuda_common.cuh, gptfast_kernels.triton.programmatic_launch).
# TORCHINDUCTOR_ENABLE_PDL=1 (torch's own option) launches inductor's kernels so too, so that with
# GPTFAST_CUDA_PDL=1 every kernel of a compiled step is. bench/gpu_run.sh's pdl stages time these
# against the default, each in a process of its own whose rows carry pdl_suffix's suffix.
PDL_SUFFIXES = {"1": "_pdl", "0": "_nopdl"}  # GPTFAST_CUDA_PDL's value -> row and file suffix
INDUCTOR_PDL_SUFFIX = "_inductorpdl"  # TORCHINDUCTOR_ENABLE_PDL=1


def pdl_suffix(values) -> str:
    """The row and file suffix of the launch choices in ``values`` (the environment, or a run's
    metadata): "_pdl" / "_nopdl" for GPTFAST_CUDA_PDL=1 / 0, then "_inductorpdl" for
    TORCHINDUCTOR_ENABLE_PDL=1; "" for the defaults."""
    suffix = PDL_SUFFIXES.get(values.get("GPTFAST_CUDA_PDL", ""), "")
    return suffix + (INDUCTOR_PDL_SUFFIX if values.get("TORCHINDUCTOR_ENABLE_PDL") == "1" else "")


PDL_SUFFIX = pdl_suffix(os.environ)
GRAPH_SUFFIX = "@graph"  # impl name of a candidate timed as a CUDA-graph replay
_gpu_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _flush_cpu_caches() -> None:
    global _cpu_flush_buffer
    if _cpu_flush_buffer is None:
        _cpu_flush_buffer = torch.empty(CPU_FLUSH_BYTES // 4, dtype=torch.float32)
    _cpu_flush_buffer.fill_(1.0)


def _commit() -> str:
    """The measured commit: git's, else GPTFAST_COMMIT (a copied tree without .git, e.g. the GPU machine)."""
    if os.environ.get("GPTFAST_COMMIT"):
        return os.environ["GPTFAST_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, CPU)"


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(samples, n=10)  # deciles: qs[1] = p20, qs[7] = p80
    return qs[1], statistics.median(samples), qs[7]


def _flush_gpu_l2(device: torch.device) -> None:
    """Evicts the timed call's inputs from L2 by *reading* a buffer several times its size.
    triton's do_bench flushes by writing one (zero_), which leaves L2 full of dirty lines: the
    timed kernel then pays for writing them back (up to 50 MB on an H100) as it streams its own
    inputs, which can halve the bandwidth a 16-60 MB weight read appears to get. A decode step
    reads cold weights, but with no such write-back in its way."""
    buffer = _gpu_flush_buffers.get(device)
    if buffer is None:
        buffer = _gpu_flush_buffers[device] = torch.ones(GPU_FLUSH_BYTES // 4, dtype=torch.float32,
                                                         device=device)
    buffer.amax()


def _time_gpu_ms(fn: Callable[[], object], device: torch.device) -> tuple[float, float, float]:
    """do_bench's method (warm-up, then about GPU_REP_MS of calls, each between its own pair of
    CUDA events) with a read-only L2 flush before every call."""
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GPU_ESTIMATE_CALLS):
            _flush_gpu_l2(device)
            fn()
        end.record()
        torch.cuda.synchronize()
        each_ms = max(start.elapsed_time(end) / GPU_ESTIMATE_CALLS, 1e-3)  # flush included
        for _ in range(max(1, int(GPU_WARMUP_MS / each_ms))):
            fn()
        reps = min(GPU_MAX_REPEATS, max(GPU_MIN_REPEATS, int(GPU_REP_MS / each_ms)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for begin, finish in zip(starts, ends):
            _flush_gpu_l2(device)
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize()
    return _percentiles([begin.elapsed_time(finish) for begin, finish in zip(starts, ends)])


def cuda_graph_replay(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """``fn`` captured once into a CUDA graph, after warm-up calls on a side stream (which also
    JIT-compile Triton kernels); returns the graph's replay: the same kernels without the host's
    launch work (Python, dispatch, Triton's launcher), as a compiled decode step runs them. Eager
    timings of a few-microsecond kernel can be mostly that work. ``fn`` must not synchronise with
    the host (a capture refuses it)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_CALLS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


def time_ms(fn: Callable[[], object], device: torch.device) -> tuple[float, float, float]:
    """(p20, median, p80) milliseconds of fn()."""
    if device.type == "cuda":
        return _time_gpu_ms(fn, device)
    for _ in range(CPU_WARMUP):
        fn()
    samples = []
    timed = 0.0
    while len(samples) < CPU_MIN_REPEATS or (timed < CPU_MIN_SECONDS and len(samples) < CPU_MAX_REPEATS):
        _flush_cpu_caches()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        timed += samples[-1] / 1e3
    return _percentiles(samples)


def checked(fn: Callable[[], torch.Tensor], want: torch.Tensor, max_relative_error: float):
    """``fn`` if its output is within ``max_relative_error`` of ``want`` (Frobenius norms), else the
    reason it must not be timed: its error, or the exception it raised (Triton's OutOfResources
    for a tile that does not fit, a compile error). For sweeps over launch configs."""
    try:
        got = fn()
    except Exception as error:  # noqa: BLE001  (recorded as the config's result)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    err = float((got.float() - want).norm() / want.norm())
    return fn if err <= max_relative_error else f"relative error {err:.2e}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    """(fastest of ``repeats`` timed calls in seconds, that call's result) after one warm-up call
    (which also compiles, where there is anything to compile). For whole generation runs, where
    time_ms's many repeats would take minutes."""
    seconds, _, out = best_seconds_and_host(fn, device, repeats)
    return seconds, out


def best_seconds_and_host(fn: Callable[[], object], device: torch.device,
                          repeats: int) -> tuple[float, float, object]:
    """As best_seconds, with the host's seconds of the fastest call: until ``fn`` returned, before
    the device was waited for. On a GPU, a run that queues its work without waiting for it (a
    compiled ``generate`` without eos ids) has host seconds well below the total where the GPU is
    what it waits on, and close to the total where the host is (its per-step Python, dispatch and
    launches), or where the launch queue filled. On a CPU the two are the same."""
    out = fn()
    best, best_host = float("inf"), float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        host = time.perf_counter() - start
        synchronize(device)
        seconds = time.perf_counter() - start
        if seconds < best:
            best, best_host = seconds, host
    return best, best_host, out


def tokens_digest(tokens: torch.Tensor) -> str:
    """A short digest of token ids (sha1 of their int64 bytes, 16 hex digits), so that runs in
    different processes (other launch choices) can show they generated the same tokens."""
    return hashlib.sha1(tokens.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Builds modules directly in ``dtype`` (an 8B-parameter model never exists in float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-memory copy bandwidth: bytes read + bytes written per second."""
    if device.type == "cpu":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    _, median_ms, _ = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (median_ms * 1e-3) / 1e9


def cpu_isa_of_row(device: torch.device) -> dict:
    """On a CPU, the instruction set the CPU kernels run (``_cpu_isa``), for the row."""
    if device.type != "cpu" or not hasattr(torch.ops.gptfast_kernels, "_cpu_isa"):
        return {}
    return {"cpu_isa": torch.ops.gptfast_kernels._cpu_isa()}


def add_cpu_isa_rows(candidates: dict, device: torch.device, name: str) -> None:
    """On a CPU, candidate ``name`` again under each other instruction set this CPU runs
    (``name``_avx2, ``name``_baseline: csrc/cpu_isa.cpp), side by side in speed."""
    if device.type != "cpu" or name not in candidates or not hasattr(torch.ops.gptfast_kernels, "_cpu_isas"):
        return
    select = torch.ops.gptfast_kernels._cpu_isa
    fn = candidates[name]
    for isa in torch.ops.gptfast_kernels._cpu_isas()[1:]:
        def with_isa(isa=isa):
            before = select(isa)
            try:
                return fn()
            finally:
                select(before)

        candidates[f"{name}_{isa}"] = with_isa


@dataclass
class Harness:
    device: torch.device
    quick: bool = False
    rows: list[dict] = field(default_factory=list)
    copy_gbps: float | None = None
    cases: frozenset[str] | None = None  # the cases to run (None: all); see wants()

    def __post_init__(self):
        self.meta = {
            "device": device_name(self.device),
            "torch": torch.__version__,
            "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        # a kernel choice made by the environment (csrc/cuda/int8_linear.cu) travels with every row
        for variable in KERNEL_CHOICE_VARIABLES:
            if os.environ.get(variable):
                self.meta[variable] = os.environ[variable]

    def wants(self, case: str) -> bool:
        """Whether to run the named case (``--cases``): lets a long benchmark be split over runs."""
        return self.cases is None or case in self.cases

    def measure_copy_bandwidth(self) -> float:
        if self.copy_gbps is None:
            self.copy_gbps = copy_bandwidth_gbps(self.device)
        return self.copy_gbps

    def compare(self, op: str, case: dict, candidates: dict[str, Callable[[], object]],
                baseline: str, nbytes: int | None = None, graphed: tuple[str, ...] = ()) -> list[dict]:
        """Times every candidate in the same run and records each as a row with its ratio
        (speed-up) over ``baseline`` and, when ``nbytes`` (minimum bytes moved) is given, its
        achieved GB/s and fraction of the measured copy bandwidth. On a GPU the candidates named in
        ``graphed`` (calls that never synchronise with the host) are also timed as CUDA-graph
        replays, rows "<name>@graph", whose ratio is over the baseline's replay when the baseline is
        graphed too: the kernels' own time, as in a compiled decode step."""
        timings, not_captured = {}, {}
        for name, fn in candidates.items():
            timings[name] = time_ms(fn, self.device)
            if name in graphed and self.device.type == "cuda":
                try:
                    replay = cuda_graph_replay(fn, self.device)
                except RuntimeError as error:  # e.g. a host synchronisation inside fn
                    not_captured[name + GRAPH_SUFFIX] = f"not capturable: {str(error).splitlines()[0][:160]}"
                else:
                    timings[name + GRAPH_SUFFIX] = time_ms(replay, self.device)
        self._record_not_timed(op, case, not_captured)
        new_rows = []
        for name, (p20, p50, p80) in timings.items():
            base = baseline + GRAPH_SUFFIX if name.endswith(GRAPH_SUFFIX) and baseline + GRAPH_SUFFIX in timings \
                else baseline
            row = {"op": op, **case, "impl": name, "baseline": base, "ms_p20": p20, "ms_median": p50,
                   "ms_p80": p80, "speedup_vs_baseline": timings[base][1] / p50, **self.meta}
            if nbytes is not None:
                gbps = nbytes / (p50 * 1e-3) / 1e9
                row["gbps"] = gbps
                if self.copy_gbps:
                    row["fraction_of_copy_bw"] = gbps / self.copy_gbps
            new_rows.append(row)
        self.rows.extend(new_rows)
        return new_rows

    def sweep(self, op: str, case: dict, fixed: dict[str, Callable[[], object]],
              configs: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor, max_relative_error: float,
              baseline: str, nbytes: int | None = None) -> tuple[dict[str, dict], str | None]:
        """``compare`` over the ``fixed`` candidates and every launch config in ``configs`` whose
        output passes ``checked`` against ``want``; a config that fails is recorded with the reason,
        not timed. On a GPU every candidate is also timed as a CUDA-graph replay (as a compiled step
        runs it: a Triton kernel's eager time is mostly its launcher on the host), and the replays
        decide. Returns the timed rows by name (a replay's under its own name, not "<name>@graph")
        and the fastest config's name (None if none ran)."""
        candidates, not_timed = dict(fixed), {}
        for name, fn in configs.items():
            result = checked(fn, want, max_relative_error)
            if callable(result):
                candidates[name] = result
            else:
                not_timed[name] = result
        rows = {row["impl"]: row for row in self.compare(op, case, candidates, baseline, nbytes,
                                                         graphed=tuple(candidates))}
        timed = {name: rows.get(name + GRAPH_SUFFIX, row) for name, row in rows.items()
                 if not name.endswith(GRAPH_SUFFIX)}
        self._record_not_timed(op, case, not_timed)
        best = min((name for name in configs if name in timed), key=lambda n: timed[n]["ms_median"], default=None)
        return timed, best

    def _record_not_timed(self, op: str, case: dict, reasons: dict[str, str]) -> None:
        """A row per candidate that was not timed, with the reason."""
        self.rows.extend({"op": op, **case, "impl": name, "not_timed": reason, **self.meta}
                         for name, reason in reasons.items())

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"meta": {**self.meta, "copy_gbps": self.copy_gbps}, "rows": self.rows}, f,
                      indent=1)

    def table(self) -> str:
        if not self.rows:
            return "(no rows)"
        skip = set(self.meta) | {"baseline", "ms_p20", "ms_p80"}
        keys = [k for k in self.rows[0] if k not in skip]
        for row in self.rows:
            keys += [k for k in row if k not in keys and k not in skip]

        def fmt(v):
            return f"{v:.3g}" if isinstance(v, float) else str(v)

        cells = [[fmt(r.get(k, "")) for k in keys] for r in self.rows]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
        lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
        return "\n".join(lines)
