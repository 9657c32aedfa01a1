"""Hybrid models (Qwen3.5: linear-attention layers with a recurrent state between full-attention
layers): what the cache and the generators allow, and what they refuse. The family tests
(test_patch.py, test_generate.py, ...) run the tiny Qwen3.5 against transformers as well."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from gptfast_kernels import StaticKVCache, generate
from python_tests.tiny_models import HYBRID, hf_greedy, left_pad, patched_copy, ragged_prompts, tiny_model

FAMILY = HYBRID[0]


@pytest.fixture(scope="module")
def models():
    model = tiny_model(FAMILY)
    return model, patched_copy(model, int8=False)


def _states(cache):
    return [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
            for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]


def test_a_reused_cache_starts_from_empty_states(models):
    """generate empties the recurrent states along with the lengths: a second call on the same
    cache gives transformers' tokens again (a stale state would change them)."""
    model, patched = models
    ids, mask = ragged_prompts(3, 6, "left")
    cache = StaticKVCache(patched.config, 3, 16)
    want = hf_greedy(model, ids, mask, 5, eos_token_id=None)
    for _ in range(2):
        assert torch.equal(generate(patched, ids, mask, max_new_tokens=5, eos_token_id=[],
                                    past_key_values=cache).sequences, want)


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_recurrent_first_and_last_layers(patched):
    """Layers linear, full, linear: a forward is planned and committed around its one attention
    layer. An unpatched model (transformers' attention calling StaticKVCache.update) plans at the
    first attention layer and commits at the last, whatever the layers around them are."""
    model = tiny_model(FAMILY, layers=3)
    runner = patched_copy(model, int8=False) if patched else model
    ids = torch.randint(2, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = StaticKVCache(model.config, 2, 12)
    with torch.no_grad():
        got = torch.cat([runner(ids[:, :5], past_key_values=cache).logits,
                         runner(ids[:, 5:6], past_key_values=cache).logits,
                         runner(ids[:, 6:], past_key_values=cache).logits], dim=1)
        want = model(ids).logits
    assert cache.seq_lengths.tolist() == [7, 7]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_crop_empties_rows_or_refuses(models):
    _, patched = models
    cache = StaticKVCache(patched.config, 2, 8)
    with torch.no_grad():
        patched(torch.tensor([[3, 4, 5], [6, 7, 8]]), past_key_values=cache)
    before = _states(cache)
    assert before and all(conv.any() and state.any() for conv, state in before)
    for shortening in (-1, 2, torch.tensor([1, 3])):
        with pytest.raises(ValueError, match="recurrent state"):
            cache.crop(shortening)
    for keeping in (0, 3, torch.tensor([3, 5])):  # no row shorter: nothing to roll back
        cache.crop(keeping)
    assert cache.seq_lengths.tolist() == [3, 3]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, _states(cache)))
    cache.crop(torch.tensor([3, 0]))  # one row emptied: its states zeroed, the other's kept
    assert cache.seq_lengths.tolist() == [3, 0]
    assert all(torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][0], b[1][0]) and not b[0][1].any()
               and not b[1][1].any() for a, b in zip(before, _states(cache)))
    with pytest.raises(ValueError, match="recurrent state"):
        cache.crop(torch.tensor([2, 0]))
    cache.crop(torch.zeros(2, dtype=torch.int64))
    assert cache.seq_lengths.tolist() == [0, 0]
    assert not any(conv.any() or state.any() for conv, state in _states(cache))
    assert not any(layer.has_previous_state[0] for layer in cache.layers if isinstance(layer, LinearAttentionLayer))


def test_right_padding_goes_in_left_aligned(models):
    """Padding after a row's real tokens would still decay its recurrent state: a forward given
    such a mask raises, naming attention_mask, while generate moves each row's padding before its
    tokens, giving transformers' tokens for the same prompts left-padded (the prompt layout kept)."""
    model, patched = models
    ids, mask = ragged_prompts(3, 6, "right")
    cache = StaticKVCache(patched.config, 3, 8)
    with pytest.raises(ValueError, match="attention_mask.*left"), torch.no_grad():
        patched(ids, attention_mask=mask, past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0, 0, 0]
    got = generate(patched, ids, mask, max_new_tokens=5, eos_token_id=[]).sequences
    want = hf_greedy(model, *left_pad(ids, mask), 5, eos_token_id=None)
    assert torch.equal(got[:, :6], ids) and torch.equal(got[:, 6:], want[:, 6:])


def test_older_transformers_are_refused_by_name(monkeypatch):
    """Before transformers 5.17 some hybrid models read other state attributes of their cache, or
    restart a state on multi-token inputs: patching one there says which version it needs."""
    from gptfast_kernels import patch_model
    from gptfast_kernels.models import families

    model = tiny_model(FAMILY)
    # (the transformers module object families.py holds: transformers may replace its entry in sys.modules)
    monkeypatch.setattr(families.transformers, "__version__", "5.14.1")
    with pytest.raises(ValueError, match=f"{FAMILY} models from transformers {families.HYBRID_FROM} on"):
        patch_model(model)


def _greedy_alone(model, ids, mask, new: int) -> torch.Tensor:
    """Each row's real tokens alone, decoded greedily by transformers' forward over the whole sequence
    (no cache: transformers' generate fails on some of these configs) -> [B, new]."""
    rows = []
    for b in range(ids.shape[0]):
        sequence = ids[b:b + 1, mask[b] == 1]
        with torch.no_grad():
            for _ in range(new):
                step = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                sequence = torch.cat([sequence, step], dim=1)
        rows.append(sequence[0, -new:])
    return torch.stack(rows)


@pytest.mark.parametrize("family, overrides", [
    ("lfm3", dict(num_hidden_layers=2, layer_types=["conv", "conv"])),
    ("qwen3_5_text", dict(num_hidden_layers=2, layer_types=["linear_attention"] * 2)),
    ("bamba", dict(num_hidden_layers=2, attn_layer_indices=[])),
], ids=["lfm3", "qwen3_5_text", "bamba"])
def test_configs_whose_layers_are_all_recurrent_are_served(family, overrides):
    """A hybrid family's config may have no attention layer (patch_model refused it, saying the
    transformers release might be unsupported): it is served as the attention-free families are."""
    model = tiny_model(family, **overrides)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    got = generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[]).sequences
    assert torch.equal(got[:, 7:], _greedy_alone(model, ids, mask, 6))


def test_a_draft_of_a_hybrids_first_recurrent_layer():
    """speculative_generate with a draft cut from a hybrid's first layer, a recurrent one (Qwen3.5's:
    linear, full, linear): the draft has no attention layer."""
    from gptfast_kernels import speculative_generate
    from python_tests.tiny_models import draft_of

    target = tiny_model("qwen3_5_text", layers=3)
    patched, draft = patched_copy(target, int8=False), patched_copy(draft_of(target, 1), int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    want = generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[]).sequences
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=8, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, want) and int(out.num_proposed.sum()) > 0
