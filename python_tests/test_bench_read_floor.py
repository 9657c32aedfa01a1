"""bench/read_floor.py's read-only kernel (under the Triton interpreter here): it reads every byte of
its source's rows and none past them, so its time is a floor for the ops whose bytes it reads."""

import numpy as np
import pytest
import torch

from bench.read_floor import RowReader, as_words, read_floor_candidates


def _xor_of_words(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.contiguous().view(torch.int32).reshape(-1).numpy()))


def _xor_of_programs(out: torch.Tensor) -> list[int]:
    return [int(np.bitwise_xor.reduce(row.numpy())) for row in out]


@pytest.mark.parametrize("block", [64, 256, 1024])
def test_reads_every_word_of_a_weight_matrix(block):
    weight = torch.randint(-127, 128, (48, 200), dtype=torch.int8)  # 2400 words: no block divides it
    out = RowReader(weight.view(1, -1), block)()
    assert out.shape == (1, -(-2400 // block))
    assert _xor_of_programs(out) == [_xor_of_words(weight)]


def test_reads_a_caches_filled_slots_and_nothing_past_them():
    B, H, S, D, filled = 2, 3, 40, 8, 17
    cache = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    rows = cache.view(B * H, S * D)[:, :filled * D]
    out = RowReader(rows, 32)()
    assert _xor_of_programs(out) == [_xor_of_words(cache[b, h, :filled]) for b in range(B) for h in range(H)]
    # the slots past `filled` change what a read of the whole rows gives, not this one's result
    cache[:, :, filled:] = 0
    assert _xor_of_programs(RowReader(rows, 32)()) == _xor_of_programs(out)


def test_candidates_read_every_source_once_per_block_size():
    sources = [torch.randint(-127, 128, (1, 512), dtype=torch.int8) for _ in range(3)]
    candidates = read_floor_candidates(sources, blocks=(16, 64))
    assert sorted(candidates) == ["read_floor_16", "read_floor_64"]
    for fn in candidates.values():
        outs = fn()
        assert [_xor_of_programs(out) for out in outs] == [[_xor_of_words(src)] for src in sources]


@pytest.mark.parametrize("src, message", [
    (torch.zeros(4, 8, dtype=torch.int8).t(), "contiguous rows"),
    (torch.zeros(8, dtype=torch.int8), "2-D"),
    (torch.zeros(2, 6, dtype=torch.int8), "32-bit words"),  # 6 bytes a row
    (torch.zeros(2, 9, dtype=torch.int8)[:, 1:], "32-bit words"),  # 8 bytes a row, 9 apart
])
def test_rows_that_are_not_whole_words_are_refused(src, message):
    with pytest.raises(ValueError, match=message) as error:
        as_words(src)
    assert "src" in str(error.value)
