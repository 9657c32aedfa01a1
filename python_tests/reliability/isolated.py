"""Runs bad-input cases in a child process, so a segfault or abort fails a test instead of killing
pytest. A case is a module-level function that must raise; the child reports, for each case, the
exception type and message (or that nothing was raised, or an extra check failed). A case that
kills the child is reported as a crash and the remaining cases run in a fresh child."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

CHILD_TIMEOUT_S = 600
_MARK = "@@case "


def run_isolated(module: str, names: list[str]) -> dict[str, dict]:
    """{case name: {"status": "raised" | "no-error" | "crash", "type", "message"}}."""
    results: dict[str, dict] = {}
    pending = list(names)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    while pending:
        proc = subprocess.run([sys.executable, "-m", "python_tests.reliability.isolated", module, *pending],
                              capture_output=True, text=True, cwd=root, timeout=CHILD_TIMEOUT_S,
                              env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith(_MARK):
                continue
            record = json.loads(line[len(_MARK):])
            if record["status"] == "started":
                started = record["name"]
            else:
                results[record["name"]] = record
                started = None
        if started is not None:  # the child died inside this case
            results[started] = {"status": "crash", "type": f"exit code {proc.returncode}",
                                "message": proc.stderr[-2000:]}
        done = set(results)
        if not any(n in done for n in pending):  # the child died before any case: report all
            for n in pending:
                results[n] = {"status": "crash", "type": f"exit code {proc.returncode}",
                              "message": proc.stderr[-2000:]}
        pending = [n for n in pending if n not in results]
    return results


def _child(module: str, names: list[str]) -> None:
    cases = importlib.import_module(module).CASES
    for name in names:
        print(_MARK + json.dumps({"name": name, "status": "started"}), flush=True)
        try:
            cases[name].run()
            record = {"status": "no-error", "type": "", "message": ""}
        except Exception as exc:  # noqa: BLE001  (any exception is reported to the parent)
            record = {"status": "raised", "type": type(exc).__name__, "message": str(exc)}
        print(_MARK + json.dumps({"name": name, **record}), flush=True)


if __name__ == "__main__":
    if not os.environ.get("TRITON_INTERPRET"):
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    _child(sys.argv[1], sys.argv[2:])
