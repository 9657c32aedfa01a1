"""Dory (models/dory.py) on a tiny config: its recurrent section (layers 1 and 2 of 4) runs twice, in
both of transformers' cache modes: "per_loop" (the second run over cache layers of its own) and
"last_loop" (one cache layer per section layer, the last run's); and its int8 output head. The
family-wide tests (test_patch.py, generation/) cover the per_loop config; these cover both modes side
by side."""

import pytest
import torch
from transformers import DynamicCache

from gptfast_kernels import Int8Linear, StaticKVCache, generate, patch_model, speculative_generate
from gptfast_kernels.models.dory import Int8DoryLMHead
from python_tests.tiny_models import (dequantized_copy, hf_greedy, patched_copy, ragged_prompts, stepwise_logits,
                                     tiny_model)

TOL = dict(atol=2e-5, rtol=1e-4)
MODES = ("per_loop", "last_loop")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_prefill_and_decode_steps_equal_transformers(mode, fused):
    """A prompt, then decode steps past the sliding window (4), against transformers' own prompt and
    steps: every run of the section attends over the keys and values it should. In last_loop mode a
    step's earlier run sees the past as the last run left it, so steps differ from one forward over
    the whole sequence (transformers' too); in per_loop mode they do not."""
    model = tiny_model("dory", recurrent_kv_cache_mode=mode)
    patched = patched_copy(model, int8=False, fused_attention=fused)
    ids = torch.randint(2, 90, (2, 14), generator=torch.Generator().manual_seed(3))
    hf_cache = DynamicCache(config=model.config)  # (Dory's forward takes it as cache=, not past_key_values=)
    with torch.no_grad():
        want = torch.cat([model(ids[:, :5], cache=hf_cache).logits]
                         + [model(ids[:, t:t + 1], cache=hf_cache).logits for t in range(5, ids.shape[1])], dim=1)
    with torch.no_grad():
        whole = model(ids).logits
    assert torch.allclose(want, whole, **TOL) == (mode == "per_loop")
    cache = StaticKVCache(patched.config, 2, 16)
    torch.testing.assert_close(stepwise_logits(patched, ids, cache, 5), want, **TOL)
    # per_loop: 4 layers, then the second run's 2; last_loop: the 4 alone. Either way 6 attention calls a forward
    assert len(cache.layers) == (6 if mode == "per_loop" else 4) and cache.attention_modules == 6


@pytest.mark.parametrize("mode", MODES)
def test_greedy_and_speculative_equal_transformers(mode):
    """Ragged rows: generate equals transformers' greedy, compiled too; speculative decoding with another
    Dory as the draft (int8 target) equals generate on that target."""
    model = tiny_model("dory", recurrent_kv_cache_mode=mode)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    want = hf_greedy(model, ids, mask, 10, eos_token_id=None)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=10, eos_token_id=[]).sequences, want)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=10, eos_token_id=[], compile=True).sequences, want)
    target = patched_copy(model, int8=True)
    draft = patch_model(tiny_model("dory", recurrent_kv_cache_mode=mode, seed=1), int8=True)
    want = generate(target, ids, mask, max_new_tokens=10, eos_token_id=[]).sequences
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=10, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, want)


def test_int8_output_head_keeps_its_logit_scale():
    """With int8 the output head (DoryLMHead: x @ W.T times a learned per-token scale) becomes an
    Int8DoryLMHead: its logits equal transformers' head over the int8-rounded weight, the scale
    included (drawn here: a fresh model's makes it 1); int8_skip=("lm_head",) keeps it float."""
    model = tiny_model("dory")
    with torch.no_grad():
        model.lm_head.logit_scale.uniform_(0.05, 0.2)  # (times its factor 1 / 0.1: 0.5 to 2)
    patched = patched_copy(model, int8=True)
    head = patched.lm_head
    assert isinstance(head, Int8DoryLMHead)
    assert type(patched_copy(model, int8=True, int8_skip=("lm_head",)).lm_head).__name__ == "DoryLMHead"
    rounded = dequantized_copy(model).lm_head
    x = torch.randn(3, 5, model.config.hidden_size)
    with torch.no_grad():
        want = rounded(x)
        torch.testing.assert_close(head(x), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(Int8Linear.forward(head, x).float(), want, atol=1e-3)  # (the scale matters)
