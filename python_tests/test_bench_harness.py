"""bench/harness.py's GPU timing loop, run here against a stand-in for torch.cuda's events (no
GPU on CI): every timed call comes right after a read-only L2 flush, the repeat count follows
the call's cost, and the percentiles are those of the per-call event times."""

import contextlib
import os
import signal
import time

import pytest
import torch

from bench import harness


class _Clock:
    def __init__(self):
        self.now_ms, self.log = 0.0, []


@pytest.fixture
def fake_cuda(monkeypatch):
    clock = _Clock()

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock.now_ms
            clock.log.append("event")

        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

    def flush(device):
        clock.now_ms += 0.09  # reading 256 MB
        clock.log.append("flush")

    monkeypatch.setattr(harness, "_flush_gpu_l2", flush)
    return clock


def test_gpu_timing_flushes_before_every_timed_call(fake_cuda):
    durations = iter([0.5] * 40 + [0.2, 0.3, 0.4, 0.5, 0.6] * 400)

    def fn():
        fake_cuda.now_ms += next(durations)
        fake_cuda.log.append("call")

    p20, p50, p80 = harness.time_ms(fn, torch.device("cuda"))
    log = fake_cuda.log
    # a timed call sits between its two events
    timed = [i for i in range(1, len(log) - 1) if log[i] == "call" and log[i - 1] == log[i + 1] == "event"]
    assert all(log[i - 2] == "flush" for i in timed)
    # about GPU_REP_MS of calls at ~0.6 ms each (flush included)
    assert 100 <= len(timed) <= 250
    assert (p20, p50, p80) == pytest.approx((0.2, 0.4, 0.6), abs=0.06)


def test_checked_times_only_correct_configs():
    want = torch.ones(4, 4)

    def right():
        return want + 1e-4

    def wrong():
        return want * 2

    def broken():
        raise RuntimeError("out of resource: shared memory")

    assert harness.checked(right, want, 1e-3) is right
    assert harness.checked(wrong, want, 1e-3).startswith("relative error 1.00e+00")
    assert harness.checked(broken, want, 1e-3) == "RuntimeError: out of resource: shared memory"


def test_a_stop_signal_during_a_config_stops_the_sweep():
    """`timeout` sends SIGTERM once: a sweep recording each failing config and going on must not
    take the stop for a config's failure (bench/run.py keeps the rows measured so far and ends)."""
    from bench import run

    def stopped_while_compiling():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises at the next bytecode: the sleep is interrupted)
        return torch.ones(4, 4)

    previous = signal.signal(signal.SIGTERM, run._stop)
    try:
        with pytest.raises(run.Stopped):
            harness.checked(stopped_while_compiling, torch.ones(4, 4), 1e-3)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sweep_times_the_fixed_candidates_and_the_correct_configs():
    h = harness.Harness(torch.device("cpu"))
    want = torch.ones(8)
    fixed = {"baseline": lambda: want.clone()}
    configs = {"right": lambda: want + 1e-5, "wrong": lambda: want * 3,
               "broken": lambda: (_ for _ in ()).throw(RuntimeError("no fit"))}
    timed, best = h.sweep("op", {"M": 1}, fixed, configs, want, 1e-3, baseline="baseline")
    assert set(timed) == {"baseline", "right"} and best == "right"
    not_timed = {row["impl"]: row["not_timed"] for row in h.rows if "not_timed" in row}
    assert not_timed == {"wrong": "relative error 2.00e+00", "broken": "RuntimeError: no fit"}


def test_compare_times_graphed_candidates_as_replays_against_the_replayed_baseline(fake_cuda, monkeypatch):
    """On a GPU, candidates named in ``graphed`` get a second row, "<name>@graph", timed on the
    CUDA-graph replay (here a stand-in without the eager call's 0.3 ms of launch work), whose ratio
    is over the baseline's replay; the other rows keep the eager baseline."""
    monkeypatch.setattr(harness, "device_name", lambda device: "fake GPU")
    launch_ms, kernel_ms = {"base": 0.3, "ours": 0.3, "other": 0.3}, {"base": 0.4, "ours": 0.1, "other": 0.2}

    def call(name):
        def fn():
            fake_cuda.now_ms += launch_ms[name] + kernel_ms[name]
        fn.name = name
        return fn

    def replay_of(fn, device):
        def replay():
            fake_cuda.now_ms += kernel_ms[fn.name]
        return replay

    monkeypatch.setattr(harness, "cuda_graph_replay", replay_of)
    h = harness.Harness(torch.device("cuda"))
    rows = {row["impl"]: row for row in h.compare("op", {"M": 1}, {n: call(n) for n in ("base", "ours", "other")},
                                                 baseline="base", graphed=("base", "ours"))}
    assert set(rows) == {"base", "base@graph", "ours", "ours@graph", "other"}
    assert rows["ours@graph"]["baseline"] == "base@graph" and rows["ours"]["baseline"] == "base"
    assert rows["ours@graph"]["ms_median"] == pytest.approx(0.1)
    assert rows["ours@graph"]["speedup_vs_baseline"] == pytest.approx(4.0)
    assert rows["ours"]["speedup_vs_baseline"] == pytest.approx(0.7 / 0.4)
    assert rows["other"]["speedup_vs_baseline"] == pytest.approx(0.7 / 0.5)


def test_compare_records_a_candidate_that_cannot_be_captured(fake_cuda, monkeypatch):
    monkeypatch.setattr(harness, "device_name", lambda device: "fake GPU")

    def refuse(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(harness, "cuda_graph_replay", refuse)

    def fn():
        fake_cuda.now_ms += 0.1

    h = harness.Harness(torch.device("cuda"))
    timed = h.compare("op", {"M": 1}, {"base": fn, "syncs": fn}, baseline="base", graphed=("syncs",))
    assert [row["impl"] for row in timed] == ["base", "syncs"]
    assert [(row["impl"], row["not_timed"]) for row in h.rows if "not_timed" in row] == [
        ("syncs@graph", "not capturable: operation not permitted when stream is capturing")]


def test_cpu_flush_covers_the_largest_cache_sysfs_lists(tmp_path, monkeypatch):
    """The CPU flush is sized from the largest cache in sysfs ("266240K": the Sapphire Rapids VM's
    260 MiB L3), skipping entries it cannot read."""
    from bench import harness

    files = []
    for name, text in [("index0", "48K\n"), ("index2", "2048K\n"), ("index3", "266240K\n"), ("index4", "n/a\n")]:
        path = tmp_path / name
        path.write_text(text)
        files.append(str(path))
    monkeypatch.setattr(harness.glob, "glob", lambda pattern: files)
    assert harness.largest_cpu_cache_bytes() == 266240 << 10
    monkeypatch.setattr(harness.glob, "glob", lambda pattern: [])
    assert harness.largest_cpu_cache_bytes() == 0


def test_kernel_choices_travel_with_the_rows_and_name_the_file(monkeypatch, tmp_path):
    """A run with GPTFAST_CUDA_PDL=1 or 0 (or TORCHINDUCTOR_ENABLE_PDL=1) records it in its
    metadata and writes a file of its own beside the same benches' run at the default
    (bench/gpu_run.sh's pdl stages)."""
    from bench import run

    monkeypatch.delenv("GPTFAST_CUDA_PDL", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    plain = run.default_output(harness.Harness(torch.device("cpu"), cases=frozenset({"layers"})), str(tmp_path),
                               ["int8_linear"])
    monkeypatch.setenv("GPTFAST_CUDA_PDL", "1")
    h = harness.Harness(torch.device("cpu"), cases=frozenset({"layers"}))
    assert h.meta["GPTFAST_CUDA_PDL"] == "1"
    with_pdl = run.default_output(h, str(tmp_path), ["int8_linear"])
    monkeypatch.setenv("GPTFAST_CUDA_PDL", "0")
    h = harness.Harness(torch.device("cpu"), cases=frozenset({"layers"}))
    assert h.meta["GPTFAST_CUDA_PDL"] == "0"
    without = run.default_output(h, str(tmp_path), ["int8_linear"])
    assert plain.endswith("_int8_linear_layers.json") and with_pdl == plain[:-len(".json")] + "_pdl.json"
    assert without == plain[:-len(".json")] + "_nopdl.json"
    # inductor's kernels programmatic too (torch's own option; the pdl-inductor stage)
    monkeypatch.setenv("GPTFAST_CUDA_PDL", "1")
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")
    h = harness.Harness(torch.device("cpu"), cases=frozenset({"layers"}))
    assert h.meta["TORCHINDUCTOR_ENABLE_PDL"] == "1"
    assert run.default_output(h, str(tmp_path), ["int8_linear"]) == plain[:-len(".json")] + "_pdl_inductorpdl.json"
    assert harness.pdl_suffix({"TORCHINDUCTOR_ENABLE_PDL": "0"}) == ""


def test_tokens_digest_tells_token_sequences_apart():
    """bench_generate's rows carry a digest of the tokens they generated, so that runs with other
    launch choices, in other processes, can show they generated the same ones."""
    tokens = torch.tensor([[5, 7, 11], [13, 17, 19]])
    assert harness.tokens_digest(tokens) == harness.tokens_digest(tokens.clone().to(torch.int32))
    assert harness.tokens_digest(tokens) != harness.tokens_digest(tokens.flip(1))
    assert len(harness.tokens_digest(tokens)) == 16


def test_best_seconds_and_host_splits_the_host_from_the_wait_for_the_device(monkeypatch):
    """bench_generate's host_fraction: of the fastest run, the seconds until the call returned
    (queued work not yet done) apart from the total after waiting for the device; a run whose
    device work outlasts its host work shows a host share well below 1."""
    clock = {"now": 0.0, "pending": 0.0}
    # (host seconds, the device's seconds left when the call returns): the warm-up call first
    runs = iter([(0.010, 0.050), (0.012, 0.030), (0.011, 0.060)])

    def fn():
        host, left = next(runs)
        clock["now"] += host
        clock["pending"] = left
        return host

    def synchronize(device):
        clock["now"] += clock["pending"]
        clock["pending"] = 0.0

    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(harness, "synchronize", synchronize)
    seconds, host, out = harness.best_seconds_and_host(fn, torch.device("cuda"), repeats=2)
    assert seconds == pytest.approx(0.042) and host == pytest.approx(0.012)  # the faster of the two timed runs
    assert out == pytest.approx(0.011)  # the last call's result, as best_seconds returns


@pytest.mark.parametrize("name, family", [
    ("void gptfast_kernels::int8_linear_gemv_kernel<c10::BFloat16, 1, 1, true, 4, false, false>(...)", "int8_linear"),
    ("_int8_linear_tiled_kernel", "int8_linear"),
    ("_kv_cache_attention_decode_kernel", "attention"),
    ("void gptfast_kernels::kv_attention::(anonymous namespace)::decode_kernel<...>(...)", "attention"),
    # inductor's kernels, named after their nodes' origins (the first as inductor named it on the CPU)
    ("cpp_fused_add_int8_linear_mean_mul_pow_rsqrt_0", "other"),
    ("triton_red_fused__to_copy_add_int8_linear_mean_mul_pow_rsqrt_0", "other"),
    ("triton_poi_fused_cat_kv_cache_attention_mul_1", "other"),
    ("_sampling_kernel", "other"),
])
def test_step_breakdown_families(name, family):
    """A kernel counts for the family of the package's op it belongs to; a kernel inductor generated
    (a norm, rotary embedding or activation around the ops) is "other" even where its name, taken from
    its nodes' origins, holds an op's name."""
    from bench import bench_step_breakdown

    assert bench_step_breakdown.family_of(name) == family


def test_step_breakdown_accounts_for_the_whole_step():
    """bench_step_breakdown on a 2-layer Llama: one row per kernel family plus the idle time, the
    int8 projections and the attention among them (4 projections a layer, qkv and gate / up fused,
    plus the output head), and shares that add up to the step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench import bench_step_breakdown
    from gptfast_kernels import patch_model

    h = harness.Harness(torch.device("cpu"), quick=True)
    torch.manual_seed(0)
    model = patch_model(LlamaForCausalLM(LlamaConfig(**dict(bench_step_breakdown.CPU_CONFIG,
                                                             num_hidden_layers=2))).eval())
    rows = bench_step_breakdown.step_rows(h, model, "tiny", 1, 32, steps=3)
    families = [row for row in rows if row["impl"] != "kernel"]
    by_family = {row["impl"]: row for row in families}
    assert list(by_family) == ["int8_linear", "attention", "other", "idle"]
    assert by_family["int8_linear"]["calls_per_step"] == 2 * 4 + 1
    assert by_family["attention"]["calls_per_step"] == 2
    assert by_family["int8_linear"]["us_per_step"] > 0 and by_family["attention"]["us_per_step"] > 0
    assert sum(row["us_per_step"] for row in families) >= rows[0]["step_us"] * 0.999
    # the longest kernels (here ops) by name, longest first, each in its family's total
    kernels = rows[len(families):]
    assert 0 < len(kernels) <= bench_step_breakdown.TOP_KERNELS and all(r["impl"] == "kernel" for r in kernels)
    times = [r["us_per_step"] for r in kernels]
    assert times == sorted(times, reverse=True)
    for r in kernels:
        assert r["family"] == bench_step_breakdown.family_of(r["kernel"])
        assert r["us_per_step"] <= by_family[r["family"]]["us_per_step"] + 1e-9
    assert any(r["family"] == "int8_linear" for r in kernels)


def test_step_breakdown_counts_overlapping_kernels_once():
    """A programmatic launch starts while the kernel before it runs and waits for it: the breakdown
    counts the overlap for the kernel that started first, so the times partition the span the
    kernels cover (gaps are idle, not anyone's) and a kernel inside another's run counts nothing."""
    from bench import bench_step_breakdown

    intervals = [("gemv", 0.0, 10.0),
                 ("attention", 8.0, 15.0),  # starts 2 us early (programmatic), waits, runs 5 us
                 ("norm", 20.0, 22.0),  # after a 5 us gap
                 ("copy", 20.5, 21.0),  # inside the norm's run
                 ("gemv", 21.0, 30.0)]  # starts 1 us early
    times = bench_step_breakdown.exclusive_times(intervals[::-1])  # any order
    assert times == {"gemv": (10.0 + 8.0, 2), "attention": (5.0, 1), "norm": (2.0, 1), "copy": (0.0, 1)}
    assert sum(time_us for time_us, _ in times.values()) == 25.0  # 0-15 and 20-30


def test_step_breakdown_reads_the_gpu_kernels_of_a_profile():
    """kernel_intervals keeps the profiler's GPU events (kernels, copies) with their start and end."""
    import types

    from torch.autograd import DeviceType

    from bench import bench_step_breakdown

    def event(name, start, end, device_type):
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end),
                                     device_type=device_type)

    events = [event("cudaGraphLaunch", 0.0, 3.0, DeviceType.CPU), event("_kv_decode", 4.0, 9.0, DeviceType.CUDA),
              event("Memcpy HtoD", 9.5, 9.7, DeviceType.CUDA)]
    assert bench_step_breakdown.kernel_intervals(events) == [("_kv_decode", 4.0, 9.0), ("Memcpy HtoD", 9.5, 9.7)]
