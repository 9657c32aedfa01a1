"""The decode-path CUDA kernels' registers and stack frames for an H100 / H200 (sm_90a), read from
the built extension by cuobjdump: no GPU needed. Their loops were shaped against their SASS (see
bench/results/NOTES-nvidia-h200_2026-11-28.md, stop 35); a change that makes one spill, or pushes the
one-row GEMV past the registers that keep five of its 256-thread blocks on an SM, fails here rather
than only in a GPU session's timings."""

from __future__ import annotations

import re
import subprocess

import pytest

from gptfast_kernels import _extension

# 65536 registers per SM / (5 blocks x 256 threads), rounded down to ptxas' allocation unit of 8
ONE_ROW_GEMV_MAX_REGISTERS = 48
# mangled-name pieces: int8_linear_gemv_kernel<T, ROWS 1, FEATURES 1, VECTORIZED, UNROLL 4, not PIPELINED,
# STAGED_X or not> (the default one-row shape, u4f1, and u4s: its 32 KiB of staged x at most leave
# room for five blocks too), and int8_linear_mma_kernel<T, MmaGemvTiling<1, RT>> (2 to 16 rows
# of fp16 / bf16 on tensor cores: features x rows tiles of 16 x 8 and 16 x 16, 8 warps splitting K)
ONE_ROW_GEMV = {f"{dtype}{'-staged' if staged else ''}":
                f"int8_linear_gemv_kernelIN3c10{dtype}ELi1ELi1ELb1ELi4ELb0ELb{staged}E"
                for dtype in ("8BFloat16", "4Half") for staged in (0, 1)}
MMA_GEMV = {f"{dtype}-rt{rt}": f"int8_linear_mma_kernelIN3c10{dtype}ENS0_9MmaTilingILi1ELi{rt}ELi1ELi1ELi8ELi2ELb1E"
            for dtype in ("8BFloat16", "4Half") for rt in (1, 2)}


def _cuobjdump(*options: str) -> str:
    """cuobjdump's output on the built extension (skips without its CUDA kernels or the tool)."""
    if not _extension.extension_loaded() or not _extension.has_kernel("int8_linear", "CUDA"):
        pytest.skip("requires the extension built with its CUDA kernels")
    try:
        import triton

        tool = triton.knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError, RuntimeError):
        pytest.skip("requires the cuobjdump bundled with Triton")
    from gptfast_kernels import _C

    return subprocess.run([tool, *options, _C.__file__], capture_output=True, text=True, timeout=300).stdout


@pytest.fixture(scope="module")
def sm90_resources() -> dict[str, tuple[int, int]]:
    """mangled kernel name -> (registers, stack bytes) of the extension's sm_90a code."""
    report = _cuobjdump("--dump-resource-usage")
    usage, arch, function = {}, None, None
    for line in report.splitlines():
        if match := re.search(r"arch = (sm_\w+)", line):
            arch = match[1]
        elif match := re.search(r"Function (\S+):", line):
            function = match[1]
        elif (match := re.search(r"REG:(\d+) STACK:(\d+)", line)) and function and arch == "sm_90a":
            usage[function] = (int(match[1]), int(match[2]))
    if not usage:
        pytest.skip("the extension was built without sm_90a code (TORCH_CUDA_ARCH_LIST)")
    return usage


def _find(usage: dict[str, tuple[int, int]], piece: str) -> tuple[int, int]:
    found = [value for name, value in usage.items() if piece in name]
    assert len(found) == 1, f"expected one sm_90a kernel named like {piece}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("dtype", list(ONE_ROW_GEMV))
def test_one_row_gemv_fits_five_blocks_per_sm_without_spilling(sm90_resources, dtype):
    registers, stack = _find(sm90_resources, ONE_ROW_GEMV[dtype])
    assert stack == 0, f"the one-row GEMV spills: a stack frame of {stack} bytes"
    assert registers <= ONE_ROW_GEMV_MAX_REGISTERS, \
        f"the one-row GEMV takes {registers} registers: fewer than five blocks per SM"


@pytest.mark.parametrize("tiling", list(MMA_GEMV))
def test_tensor_core_gemv_tilings_do_not_spill(sm90_resources, tiling):
    registers, stack = _find(sm90_resources, MMA_GEMV[tiling])
    assert stack == 0, f"{tiling}: a stack frame of {stack} bytes ({registers} registers)"


@pytest.fixture(scope="module")
def sm90_grid_dependency_order() -> dict[str, list[str]]:
    """mangled kernel name -> its griddepcontrol instructions in SASS order, for the sm_90a kernels
    that have any: ACQBULK (griddepcontrol.wait) and PREEXIT (griddepcontrol.launch_dependents)."""
    sass = _cuobjdump("-sass", "-arch", "sm_90a")
    order, function = {}, None
    for line in sass.splitlines():
        if match := re.search(r"Function : (\S+)", line):
            function = match[1]
        elif function and (match := re.search(r"\b(ACQBULK|PREEXIT)\b", line)):
            order.setdefault(function, []).append(match[1])
    if not order:
        pytest.skip("the extension was built without sm_90a code (TORCH_CUDA_ARCH_LIST)")
    return order


def test_programmatic_kernels_allow_dependents_only_after_their_wait(sm90_grid_dependency_order):
    """Every kernel that lets the next programmatic launch start does so after its own wait for the
    kernel before it (cuda_common.cuh): a dependent that starts early may then read what came before
    this kernel at once (inductor's programmatic kernels do). The int8 GEMVs and tensor-core kernels
    are among them."""
    for name, instructions in sm90_grid_dependency_order.items():
        assert "PREEXIT" not in instructions or instructions.index("ACQBULK") < instructions.index("PREEXIT"), \
            f"{name}: {instructions}"
    for piece in (*ONE_ROW_GEMV.values(), *MMA_GEMV.values()):
        assert any(piece in name and "PREEXIT" in instructions
                   for name, instructions in sm90_grid_dependency_order.items()), piece
