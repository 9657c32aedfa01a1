"""Cases that exercise the isolation harness itself (not the library)."""

import os

from python_tests.reliability.op_cases import Case


def _raise():
    raise ValueError("bad x")


CASES = {
    "a_aborts": Case(os.abort, "x"),
    "b_returns": Case(lambda: 1, "x"),
    "c_raises": Case(_raise, "x"),
}
