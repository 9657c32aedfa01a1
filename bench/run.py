"""Runs the kernel microbenchmarks: ``python -m bench.run [--ops a,b] [--quick] [--out FILE]``
(also ``python -m gptfast_kernels bench``). Each bench/bench_<op>.py defines run(harness)."""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib
import os
import re
import signal
import traceback

import torch

from bench import cuda_graph_records
from bench.harness import Harness, pdl_suffix

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def available_benches() -> list[str]:
    names = [os.path.basename(p)[len("bench_"):-len(".py")]
             for p in glob.glob(os.path.join(BENCH_DIR, "bench_*.py"))]
    return sorted(names)


def default_output(harness: Harness, out_dir: str, names: list[str]) -> str:
    """<out_dir>/<device>_<date>_<commit>[_<benches>][_pdl|_nopdl][_inductorpdl].json (the benches
    named when not all ran; _pdl: the Triton decode attention's launches programmatic too,
    GPTFAST_CUDA_PDL=1; _nopdl: no launch programmatic, GPTFAST_CUDA_PDL=0; _inductorpdl:
    inductor's too, TORCHINDUCTOR_ENABLE_PDL=1)."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", harness.meta["device"]).strip("-").lower()
    date = datetime.date.today().isoformat()
    subset = "" if sorted(names) == available_benches() else "_" + "-".join(names)
    if harness.cases is not None:
        subset += "_" + "-".join(sorted(harness.cases))
    # beside the same benches at the default
    subset += pdl_suffix(harness.meta)
    return os.path.join(out_dir, f"{device}_{date}_{harness.meta['commit']}{subset}.json")


class Stopped(BaseException):
    """SIGTERM arrived (e.g. from `timeout`) while a benchmark ran. Not an Exception: the handlers
    that record a failing config and go on (harness.checked, a sweep's) must not swallow it, since
    `timeout` sends its signal once."""


def _stop(signum, frame):
    raise Stopped()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gptfast_kernels bench", description=__doc__)
    parser.add_argument("--ops", default=",".join(available_benches()),
                        help=f"comma-separated subset of {available_benches()}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--cases", default=None,
                        help="comma-separated cases of long benchmarks to run (default: all), e.g. "
                             "batch1,batch8,batch32 (generate), demo,rounds (speculative)")
    parser.add_argument("--out", default=None, help="JSON output path (default: one named by device, date, "
                                                     "commit and benches in --out-dir)")
    parser.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    args = parser.parse_args(argv)

    cases = frozenset(args.cases.split(",")) if args.cases else None
    harness = Harness(torch.device(args.device), quick=args.quick, cases=cases)
    if harness.device.type == "cuda":  # (the benches' rows say how often a CUDA graph was recorded again)
        cuda_graph_records.install()
    signal.signal(signal.SIGTERM, _stop)  # `timeout` stops a run: keep the rows measured so far
    print(f"copy bandwidth on {harness.meta['device']}: {harness.measure_copy_bandwidth():.1f} GB/s")
    names = args.ops.split(",")
    for name in names:
        if name not in available_benches():
            parser.error(f"--ops: unknown benchmark {name!r}; choose from {available_benches()}")
    failed = []
    for name in names:  # one failing benchmark must not lose the others' rows
        try:
            importlib.import_module(f"bench.bench_{name}").run(harness)
        except Stopped:
            failed.append(name)
            harness.rows.append({"op": name, "error": "stopped (SIGTERM) before it finished", **harness.meta})
            break
        except Exception:  # noqa: BLE001  (reported, recorded, and the exit code says so)
            traceback.print_exc()
            failed.append(name)
            harness.rows.append({"op": name, "error": traceback.format_exc(limit=3), **harness.meta})
    print(harness.table())
    for reason in cuda_graph_records.reasons_again():  # (the rows count them; here, whose they were)
        print(f"CUDA graph recorded again: {reason}")
    out = args.out or default_output(harness, args.out_dir, names)
    harness.write_json(out)
    print(f"wrote {out}")
    if failed:
        print(f"FAILED benchmarks: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
