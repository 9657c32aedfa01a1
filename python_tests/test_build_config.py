"""setup.py's build-time checks (read from the file: importing setup.py would run the build)."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

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


def test_the_source_distribution_carries_every_csrc_file(tmp_path):
    """An sdist must build the extension: every tracked file under csrc/, headers included (setuptools
    adds only the .cpp / .cu files setup.py lists; MANIFEST.in adds the rest). Built from a copy of
    the tracked files: setuptools would also pack whatever an old egg-info's SOURCES.txt lists."""
    root = SETUP.parent
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout.strip():
        pytest.skip("not a git checkout: the tracked files are unknown")
    tracked = [name for name in listed.stdout.splitlines() if (root / name).is_file()]
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, source / name)
    built = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--formats=gztar", "--dist-dir",
                            str(tmp_path / "dist")], cwd=source, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    [archive] = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        packed = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(name for name in tracked if name.startswith("csrc/") and name not in packed)
    assert not missing, f"the sdist lacks {missing}"
    assert {"setup.py", "pyproject.toml", "README.md"} <= packed


def test_the_extension_formats_numbers_in_its_error_messages():
    """The extension uses the libstdc++ that torch loads. Linked with a static copy (a compiler set
    up with -static-libstdc++: setup.py's _link_args names the shared one first), its streams' locale
    was never initialised: the numbers of a TORCH_CHECK message came out empty on this machine and
    the process segfaulted on an H200's image."""
    import torch

    from gptfast_kernels import _extension

    if not _extension.has_kernel("int8_expert_linear", "CPU"):
        pytest.skip("extension not built")
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=re.escape("experts must be [P] = [2], got [1]")):
        torch.ops.gptfast_kernels.int8_expert_linear(x, torch.zeros(3, 8, 16, dtype=torch.int8), torch.ones(3, 8),
                                                     torch.tensor([0]), None)



def test_the_build_stamp_names_every_input_of_the_build(tmp_path):
    """scripts/setup.sh skips the build when scripts/build_stamp.sh prints what it printed after the
    last checked build: the line must change with the sources, pyproject.toml and the build switches."""
    root = SETUP.parent
    for name in ("csrc", "scripts"):
        shutil.copytree(root / name, tmp_path / name)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(root / name, tmp_path / name)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "CUDA_HOME": str(tmp_path / "no-cuda")}

    def stamp(**switches) -> str:
        return subprocess.run(["bash", str(tmp_path / "scripts" / "build_stamp.sh")], env={**env, **switches},
                              capture_output=True, text=True, check=True).stdout.strip()

    first = stamp()
    assert first == stamp() and f"torch={__import__('torch').__version__}" in first and "nvcc=none" in first
    changed = {"GPTFAST_KERNELS_REQUIRE_CUDA": "1"}, {"GPTFAST_KERNELS_SKIP_CUDA": "1"}, {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    assert len({first, *(stamp(**switch) for switch in changed)}) == 4
    header = next((tmp_path / "csrc").rglob("*.h"))
    header.write_text(header.read_text() + "\n// one more line\n")
    after_source = stamp()
    (tmp_path / "pyproject.toml").write_text((tmp_path / "pyproject.toml").read_text() + "\n")
    assert len({first, after_source, stamp()}) == 3
