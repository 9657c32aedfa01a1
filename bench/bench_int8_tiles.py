"""Tile sweep of the Triton int8_linear tiled kernel for 2 to 64 rows (batched decode and
speculative verification), on a GPU only: each tile config against bf16 ``F.linear`` and against
the config the wrapper picks today, Llama-3-8B shapes. Every config's output is checked against
the reference before it is timed; a config that does not compile (shared memory) or is wrong is
recorded as such, not timed. The rows say which tiles ``_tile_config`` should pick.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from gptfast_kernels import _extension, ops
from gptfast_kernels.ops import reference

ROWS = (2, 4, 8, 16, 40, 64)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096))  # (N, K); the last: gate + up
QUICK_ROWS, QUICK_SHAPES = (4, 16), SHAPES[:2]
BLOCK_N = (32, 64, 128)
BLOCK_K = (128, 256)
STAGES = (3, 4)
WARPS = (4, 8)
MAX_RELATIVE_ERROR = 2e-2  # bf16 output of a float32 accumulation


def tile_configs(M: int):
    from gptfast_kernels.triton.int8_linear import TileConfig

    block_m = max(16, 1 << (M - 1).bit_length())
    for block_n, block_k, stages, warps in itertools.product(BLOCK_N, BLOCK_K, STAGES, WARPS):
        if warps == 8 and block_n < 64:  # too few columns for 8 warps' MMA tiles
            continue
        yield TileConfig(block_m, block_n, block_k, stages, warps)


def name_of(config) -> str:
    return "n{}_k{}_s{}_w{}".format(*config[1:])


def run(h) -> None:
    if h.device.type != "cuda" or "triton" not in _extension.usable_backends(h.device):
        print("int8_tiles: GPU with Triton only; skipped")
        return
    from gptfast_kernels.triton.int8_linear import _tile_config, tiled_int8_linear

    rows, shapes = (QUICK_ROWS, QUICK_SHAPES) if h.quick else (ROWS, SHAPES)
    for N, K in shapes:
        weight = torch.randn(N, K, device=h.device, dtype=torch.bfloat16) / K ** 0.5
        qweight, scales = ops.quantize_int8(weight)
        for M in rows:
            x = torch.randn(M, K, device=h.device, dtype=torch.bfloat16)
            current = _tile_config(M, x.dtype)
            fixed = {"F.linear_bfloat16": lambda: F.linear(x, weight),
                     "current": lambda: tiled_int8_linear(x, qweight, scales, current)}
            configs = {name_of(c): (lambda c=c: tiled_int8_linear(x, qweight, scales, c)) for c in tile_configs(M)}
            case = {"M": M, "N": N, "K": K, "dtype": "bfloat16", "current": name_of(current)}
            timed, best = h.sweep("int8_tiles", case, fixed, configs,
                                  reference.int8_linear(x.float(), qweight, scales, None), MAX_RELATIVE_ERROR,
                                  baseline="F.linear_bfloat16", nbytes=N * K + 4 * N + 2 * M * (K + N))
            us = {name: 1e3 * row["ms_median"] for name, row in timed.items()}
            best = best or "current"
            print(f"int8_tiles N={N} K={K} M={M}: F.linear {us['F.linear_bfloat16']:.1f} us, current "
                  f"{case['current']} {us['current']:.1f} us, best {best} {us[best]:.1f} us", flush=True)
