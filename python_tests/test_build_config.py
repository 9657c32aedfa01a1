"""setup.py's build-time checks (read from the file: importing setup.py would run the build)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SETUP = pathlib.Path(__file__).resolve().parent.parent / "setup.py"


def _setup_function(name: str):
    tree = ast.parse(SETUP.read_text())
    [node] = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(SETUP), "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("arch_list", ["8.0;9.0a", "9.0a", "8.6+PTX", "8.0 9.0", "10.0f;12.0", "Ampere;Hopper", ""])
def test_sm80_and_newer_build(arch_list):
    _setup_function("_check_cuda_archs")(arch_list)


@pytest.mark.parametrize("arch_list, culprit", [("7.5;8.0", "7.5"), ("7.0+PTX", "7.0+PTX"), ("8.0,6.1", "6.1"),
                                                ("Turing", "Turing")])
def test_older_architectures_are_refused_by_name(arch_list, culprit):
    with pytest.raises(RuntimeError, match=f"TORCH_CUDA_ARCH_LIST.*8.0 or newer.*{re.escape(culprit)}"):
        _setup_function("_check_cuda_archs")(arch_list)
