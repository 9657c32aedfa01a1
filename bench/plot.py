"""Plots a bench JSON: one panel per op, speed-up over the baseline per case and implementation.
Usage: python -m bench.plot bench/results/FILE.json [--out FILE.png]"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

CASE_KEYS_SKIPPED = {"op", "impl", "baseline", "ms_p20", "ms_median", "ms_p80", "speedup_vs_baseline",
                     "gbps", "fraction_of_copy_bw", "device", "torch", "commit", "date"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json_file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json_file) as f:
        data = json.load(f)
    by_op = defaultdict(list)
    for row in data["rows"]:
        if "speedup_vs_baseline" in row:
            by_op[row["op"]].append(row)
    fig, axes = plt.subplots(len(by_op), 1, figsize=(12, 3.5 * max(1, len(by_op))), squeeze=False)
    for ax, (op, rows) in zip(axes[:, 0], sorted(by_op.items())):
        cases = []
        impls = sorted({r["impl"] for r in rows})
        values = defaultdict(dict)
        for r in rows:
            case = ",".join(f"{k}={v}" for k, v in r.items() if k not in CASE_KEYS_SKIPPED)
            if case not in cases:
                cases.append(case)
            values[r["impl"]][case] = r["speedup_vs_baseline"]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [c + i * width for c in range(len(cases))]
            ax.bar(xs, [values[impl].get(case, 0) for case in cases], width, label=impl)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_ylabel("speed-up vs baseline")
        ax.set_title(f"{op} on {data['meta']['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or args.json_file.replace(".json", ".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
