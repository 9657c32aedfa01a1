"""bench/gpu_run.sh's own logic, run here with a stand-in for Python (no GPU, nothing built or
timed): the GPU machine's minutes are few, so a stage must not lose its other runs to one failing
run, must not start a process it has no time left for, and its files must come back (the device
tool returns 8 at most)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Records each run with the kernel choices it was given; `-m bench.run` writes a results file as
# bench/run.py names it (one per run) and fails for the benches in FAIL_OPS; `-` with arguments
# (the int8-gemv stage's merge) runs the real Python; the CUDA check fails with FAKE_NO_CUDA; anything else (the extension's check, the
# version line) succeeds.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$* | PDL=${GPTFAST_CUDA_PDL:-} KERNEL=${GPTFAST_INT8_CUDA_KERNEL:-} GEMV=${GPTFAST_INT8_GEMV:-}" >> "$FAKE_LOG"
case "$*" in *cuda.is_available*) [ -z "${FAKE_NO_CUDA:-}" ]; exit $? ;; esac
if [ "$1" = "-" ] && [ $# -gt 1 ]; then exec "$REAL_PYTHON" "$@"; fi
[ "$1 $2" = "-m bench.run" ] || exit 0
shift 2
ops="" out="" out_dir=""
while [ $# -gt 0 ]; do
  case "$1" in --ops) ops=$2; shift ;; --out) out=$2; shift ;; --out-dir) out_dir=$2; shift ;; esac
  shift
done
sleep "${FAKE_SECONDS:-0}"
n=$(wc -l < "$FAKE_LOG")
[ -n "$out" ] || out="$out_dir/fake_${ops//,/-}_${GPTFAST_CUDA_PDL:-default}_$n.json"
meta='"meta": {"device": "Fake GPU", "date": "2026-11-30T00:00:00", "commit": "abc1234"}'
echo "{$meta, \"rows\": [{\"ops\": \"$ops\"}]}" > "$out"
case ",${FAIL_OPS:-}," in *",$ops,"*) exit 1 ;; esac
exit 0
"""


def choices(run: str) -> dict:
    """A recorded run's kernel choices: {"PDL": .., "KERNEL": .., "GEMV": ..} ("" where unset)."""
    return dict(item.split("=", 1) for item in run.split(" | ")[1].split(" "))


def run_stages(tmp_path, *stages, budget=120, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log, out = tmp_path / "runs.log", tmp_path / "out"
    log.write_text("")
    environment = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "FAKE_LOG": str(log),
                   "BUDGET": str(budget), "GPTFAST_COMMIT": "abc1234", **env}
    for name in ("GPTFAST_CUDA_PDL", "GPTFAST_INT8_CUDA_KERNEL", "GPTFAST_INT8_GEMV"):
        environment.pop(name, None)
    start = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_run.sh"), str(out), *stages], env=environment,
                          capture_output=True, text=True, timeout=budget + 60)
    runs = [line for line in log.read_text().splitlines() if line.startswith("-m bench.run")]
    return proc, runs, out, time.monotonic() - start


def test_a_failing_run_does_not_skip_the_stage_s_others_and_the_results_come_back_packed(tmp_path):
    proc, runs, out, _ = run_stages(tmp_path, "pdl", "breakdown", "int8-gemv",
                                    FAIL_OPS="int8_linear,kv_cache_attention")
    assert proc.returncode == 1 and "FAILED stages: pdl int8-gemv" in proc.stdout, proc.stdout[-3000:]
    pdl = [run for run in runs if "int8_linear,kv_cache_attention" in run or "--ops generate" in run]
    # the layers at the default, without and with programmatic launches, then generate the same three ways
    assert [choices(run)["PDL"] for run in pdl] == ["", "0", "1", "", "0", "1"], pdl
    # the GEMV's shapes on the GEMV (one row of a K > N layer goes to tensor cores unless told fma),
    # the untimed shapes first
    gemv = [(choices(run)["KERNEL"], choices(run)["GEMV"]) for run in runs if "--cases layers,one_row" in run]
    assert gemv[:4] == [("fma", "u4s"), ("fma", "u4p"), ("fma", "u4f1"), ("tensor_core", "")], gemv
    assert len(gemv) == 8
    # 6 + 1 + 1 results and two logs: over the tool's 8 files, so the results travel as one archive
    files = sorted(os.listdir(out))
    assert files == ["bench.log", "gpu.txt", "results_json.tar.gz"], files
    with tarfile.open(out / "results_json.tar.gz") as archive:
        names = archive.getnames()
        merged = json.load(archive.extractfile("fake-gpu_2026-11-30_abc1234_int8_gemv.json"))
    assert len(names) == 8 and sum(name.startswith("fake_") for name in names) == 7, names
    assert len(merged["rows"]) == 8  # one row from each GEMV choice's process


def test_few_results_stay_as_they_are(tmp_path):
    proc, runs, out, _ = run_stages(tmp_path, "breakdown", "speculative")
    assert proc.returncode == 0, proc.stdout[-3000:]
    files = sorted(os.listdir(out))
    assert len(runs) == 2 and len(files) == 4 and files[0] == "bench.log" and files[3] == "gpu.txt", files
    assert files[1].startswith("fake_speculative_") and files[2].startswith("fake_step_breakdown_"), files


def test_a_machine_without_a_gpu_stops_before_any_stage(tmp_path):
    # (every stage "passed" there: the tests skipped, the benches measured the CPU or nothing)
    proc, runs, out, _ = run_stages(tmp_path, "speculative", "int8-gemv", FAKE_NO_CUDA="1")
    assert proc.returncode == 1 and "torch sees no CUDA device: stopping" in proc.stdout, proc.stdout[-3000:]
    assert runs == [] and "== build" not in proc.stdout


@pytest.mark.parametrize("stage", ["int8-gemv", "pdl"])
def test_no_run_starts_without_time_left(tmp_path, stage):
    """Each run gets the budget's time left, and none starts with under 20 s of it (`timeout 0`
    would not stop it at all)."""
    budget = 59  # (a stage starts with at least 30 s left past the 15 s time_left keeps)
    proc, runs, _, seconds = run_stages(tmp_path, stage, budget=budget, FAKE_SECONDS="5")
    assert seconds < budget, (seconds, proc.stdout[-3000:])
    assert proc.returncode == 1 and "no time left" in proc.stdout, proc.stdout[-3000:]
    assert 2 <= len(runs) <= 5, runs
