"""The read floor: what a kernel that does nothing but read a set of bytes costs, launched as the
kernels it stands beside are (back to back in a CUDA graph, one launch per layer).

The issue's bandwidth targets are fractions of the copy bandwidth, which harness.py measures on a
1 GiB copy, where a launch and the first loads' latency vanish. A decode layer reads 16-60 MB
(int8 weights) or a few MB per row (a kv cache): there the fixed cost of any one launch is a large
share of the call. This kernel reads exactly the bytes an op must read, with 16-byte loads and no
arithmetic worth the name (an xor of every 32-bit word per program, stored so that nothing can be
left out), so its time per layer is the floor for any kernel over those bytes: a row "read_floor"
at 70 % of copy bandwidth says a target of 85 % for that shape cannot be met by any single kernel,
and "ours" against it says how far our kernel is from the floor rather than from the copy.

Each source is a 2-D view [rows, row_bytes] whose rows are contiguous (a weight matrix is one row;
a kv cache's filled slots are B x Hkv rows, S x D apart). Several program sizes are timed, as the
fastest read of a given size is not known in advance; the lowest row is the floor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 4  # bytes: the kernel reads 32-bit words
# Words per program (x 4 bytes): 8 KiB to 64 KiB per program, each a candidate "read_floor_<words>";
# 4 warps for the smallest (four 16-byte loads a thread), 8 for the others (8 and 16)
BLOCKS = (2048, 8192, 16384)


@triton.jit
def _read_rows_kernel(src_ptr, out_ptr, row_words, row_stride, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src_ptr + row * row_stride + offs, mask=offs < row_words, other=0)
    tl.store(out_ptr + row * tl.num_programs(0) + chunk, tl.xor_sum(words, axis=0))


def as_words(src: torch.Tensor) -> torch.Tensor:
    """``src`` [rows, n] (any dtype, rows contiguous, any row stride) as int32 words [rows, n * size / 4]
    over the same memory."""
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be 2-D with contiguous rows, got shape {tuple(src.shape)} and strides "
                         f"{src.stride()}")
    try:
        return src.view(torch.int32)
    except RuntimeError as error:
        raise ValueError(f"src's rows must be whole, aligned 32-bit words: {error}") from None


class RowReader:
    """Reads every byte of ``src`` [rows, n] in one launch of BLOCK words per program; ``out`` holds the
    xor of each program's words (allocated once, so a call allocates nothing and can be captured)."""

    def __init__(self, src: torch.Tensor, block: int):
        self.words = as_words(src)
        self.block = block
        self.num_warps = 4 if block <= 2048 else 8
        self.grid = (triton.cdiv(self.words.shape[1], block), self.words.shape[0])
        self.out = torch.empty(self.grid[1], self.grid[0], dtype=torch.int32, device=src.device)

    def __call__(self) -> torch.Tensor:
        words = self.words
        _read_rows_kernel[self.grid](words, self.out, words.shape[1], words.stride(0), BLOCK=self.block,
                                    num_warps=self.num_warps)
        return self.out


def read_floor_candidates(sources: list[torch.Tensor], blocks=BLOCKS) -> dict:
    """Candidates "read_floor_<block>" for harness.compare: each reads every source of ``sources`` (one
    per layer) with one launch apiece, BLOCK words per program."""
    candidates = {}
    for block in blocks:
        readers = [RowReader(src, block) for src in sources]
        candidates[f"read_floor_{block}"] = lambda readers=readers: [reader() for reader in readers]
    return candidates
