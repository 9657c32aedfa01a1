"""XGLM's sinusoidal position table: transformers grows it by the cache's length, which a fused step
hides (Family.fused_length_zero); models/xglm.py grows it to the cache's length before each eager
forward instead. Past max_position_embeddings the tokens are transformers' own, eager and compiled."""

import pytest
import torch

from gptfast_kernels import generate
from python_tests.tiny_models import hf_greedy, patched_copy, ragged_prompts, tiny_model

POSITIONS = 12  # max_position_embeddings: 6 prompt columns + 20 new tokens go well past it


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_decoding_past_max_position_embeddings_equals_transformers(compile):
    model = tiny_model("xglm", max_position_embeddings=POSITIONS)
    patched = patched_copy(model, int8=False)
    table = patched.get_decoder().embed_positions
    assert table.weights.shape[0] == POSITIONS + table.offset
    ids, mask = ragged_prompts(3, 6, "left")
    got = generate(patched, ids, mask, max_new_tokens=20, eos_token_id=[], compile=compile).sequences
    assert table.weights.shape[0] >= 6 + 20 - 1 + table.offset  # (the last token is never cached)
    assert torch.equal(got, hf_greedy(model, ids, mask, 20, eos_token_id=None))
