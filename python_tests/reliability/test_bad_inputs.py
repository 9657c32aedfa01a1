"""The bad-input battery: every case runs in a child process (a crash fails its test instead of
pytest) and must raise ValueError/TypeError whose message names the argument."""

import re

import pytest

from python_tests.reliability import generation_cases, op_cases
from python_tests.reliability.isolated import run_isolated

BATTERIES = {"python_tests.reliability.op_cases": op_cases.CASES,
             "python_tests.reliability.generation_cases": generation_cases.CASES}


@pytest.fixture(scope="module")
def outcomes():
    return {module: run_isolated(module, sorted(cases)) for module, cases in BATTERIES.items()}


@pytest.mark.parametrize("module, name", [(m, n) for m, cases in BATTERIES.items() for n in sorted(cases)])
def test_bad_input_raises_clear_error(outcomes, module, name):
    case = BATTERIES[module][name]
    result = outcomes[module][name]
    assert result["status"] != "crash", f"{name} crashed the process: {result['type']}\n{result['message']}"
    assert result["status"] == "raised", f"{name} returned instead of raising"
    expected = tuple(e.__name__ for e in case.errors)
    assert result["type"] in expected, f"{name} raised {result['type']}: {result['message']}"
    assert re.search(re.escape(case.needle), result["message"]), (
        f"{name}: message does not name {case.needle!r}: {result['message']}")


def test_isolation_reports_crashes_and_carries_on():
    results = run_isolated("python_tests.reliability.selftest_cases", ["a_aborts", "b_returns", "c_raises"])
    assert results["a_aborts"]["status"] == "crash"
    assert results["b_returns"]["status"] == "no-error"
    assert results["c_raises"] == {"name": "c_raises", "status": "raised", "type": "ValueError",
                                   "message": "bad x"}
