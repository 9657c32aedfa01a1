"""Holds the ops' backend="auto" rules against a GPU bench run: for every measured case, which of
the CUDA and Triton kernels was faster and which one ``auto_backend`` picks, so a GPU session can
see at once where a rule should move.

    python -m bench.check_auto bench/results/<device>_<date>_<commit>_...json

Kernel timings are taken from the "@graph" rows (CUDA-graph replays, as a compiled decode step
runs the kernels) where a run has them, else from the eager rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bench.bench_kv_cache_attention import HKV
from bench.harness import GRAPH_SUFFIX
from gptfast_kernels.ops.int8_linear import auto_backend as int8_auto
from gptfast_kernels.ops.kv_cache_attention import auto_backend as kv_auto

GPU_BACKENDS = ["cuda", "triton"]


@dataclass(frozen=True)
class Rule:
    """One op's case key, its CUDA / Triton candidates in the bench rows, and its auto rule."""
    op: str
    key: tuple[str, ...]
    impls: dict[str, str]  # backend -> impl name in the bench rows
    picks: Callable[[dict], str]
    optional: tuple[str, ...] = ()  # keys that tell cases apart where present (a sliding window, MLA's shape, ALiBi)


RULES = (
    Rule("int8_linear", ("M", "N", "K"), {"cuda": "ours_cuda", "triton": "ours_triton"},
         lambda case: int8_auto(GPU_BACKENDS, case["M"], case["K"], case["N"]), optional=("layers",)),
    Rule("kv_cache_attention", ("B", "T", "context", "S"), {"cuda": "ours_kernel", "triton": "ours_triton_kernel"},
         lambda case: kv_auto(GPU_BACKENDS, case["B"] * case.get("kv_heads", HKV), case["T"], case["S"],
                              case.get("head_dim", 128), graphed=case["graphed"]),
         optional=("window", "chunk", "kv_heads", "value_dim", "alibi", "head_dim", "layers")),
)


def _median_ms(rows: Iterable[dict], impl: str) -> float | None:
    """The impl's median, from its "@graph" row where there is one (the case is then judged by the
    rule for graphs: ``graphed`` in verdicts)."""
    by_impl = {row["impl"]: row["ms_median"] for row in rows if "ms_median" in row}
    return by_impl.get(impl + GRAPH_SUFFIX, by_impl.get(impl))


def verdicts(rows: list[dict]) -> list[dict]:
    """Per measured case of each rule's op: both kernels' medians, the faster, auto's pick and
    the time auto loses (0 when it picks the faster)."""
    out = []
    for rule in RULES:
        cases: dict[tuple, list[dict]] = {}
        for row in rows:
            if row.get("op") == rule.op and all(k in row for k in rule.key):
                cases.setdefault(tuple(row.get(k) for k in rule.key + rule.optional), []).append(row)
        for values, case_rows in cases.items():
            ms = {backend: _median_ms(case_rows, impl) for backend, impl in rule.impls.items()}
            if any(v is None for v in ms.values()):
                continue
            case = {k: v for k, v in zip(rule.key + rule.optional, values) if v is not None}
            timed = {row["impl"] for row in case_rows}
            case["graphed"] = all(impl + GRAPH_SUFFIX in timed for impl in rule.impls.values())
            faster = min(ms, key=ms.get)
            picked = rule.picks(case)
            out.append({"op": rule.op, **case, "cuda_ms": ms["cuda"],
                        "triton_ms": ms["triton"], "faster": faster, "auto": picked,
                        "lost_ms": ms[picked] - ms[faster]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench JSON files (bench/results/...)")
    args = parser.parse_args(argv)
    rows = [row for path in args.results for row in json.load(open(path))["rows"]]
    found = verdicts(rows)
    for v in found:
        case = "  ".join(f"{k}={v[k]}" for k in v if k not in ("op", "cuda_ms", "triton_ms", "faster", "auto",
                                                              "lost_ms"))
        flag = "" if v["lost_ms"] == 0 else f"   <- auto loses {v['lost_ms'] * 1e3:.1f} us"
        print(f"{v['op']:<19} {case:<36} cuda {v['cuda_ms'] * 1e3:9.1f} us  triton {v['triton_ms'] * 1e3:9.1f} us  "
              f"faster {v['faster']:<6} auto {v['auto']}{flag}")
    wrong = [v for v in found if v["lost_ms"] > 0]
    print(f"{len(found)} cases; auto picks the slower kernel in {len(wrong)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
