"""Sliding-window layers as ring buffers (StaticKVCache's max_step_tokens): which layers get one, that
generation through them (prompts in chunks, decode, speculative rounds that roll back) gives
transformers' tokens on every windowed family, and that what a ring cannot serve is refused by name."""

import pytest
import torch

from gptfast_kernels import StaticKVCache, generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation import forward
from gptfast_kernels.models import attention
from gptfast_kernels.modules.static_kv_cache import sliding_windows
from python_tests.tiny_models import (WINDOW, WINDOWED, hf_greedy, patched_copy, ragged_prompts,
                                      record_caches, tiny_config, tiny_model)

NEW = 12
# (tiny_config skips a family this transformers lacks, or that gptfast_kernels supports only later)
RING_FAMILIES = WINDOWED
# a chunk of 3 prompt tokens: a ring of WINDOW + 2 slots, far shorter than the prompt + NEW positions
CHUNK = 3


def _ring_layers(cache: StaticKVCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if getattr(layer, "ring_window", None) is not None]


@pytest.mark.parametrize("family", RING_FAMILIES)
def test_windows_read_off_the_config_are_those_the_layers_attend_with(family, monkeypatch):
    """sliding_windows(config) sizes the rings: it must name the window each layer passes to the
    attention function at run time, layer by layer."""
    model = patched_copy(tiny_model(family, layers=4), int8=False)
    passed = {}
    cached_attention = attention._cached_attention

    def spy(module, *args, sliding_window=None, **kwargs):
        passed[module.layer_idx] = sliding_window
        return cached_attention(module, *args, sliding_window=sliding_window, **kwargs)

    monkeypatch.setattr(attention, "_cached_attention", spy)
    model(torch.tensor([[5, 6, 7]]), past_key_values=StaticKVCache(model.config, 1, 8))
    windows = sliding_windows(model.config)
    assert passed == {i: windows[i] for i in passed} and WINDOW in passed.values()


def test_ring_layers_and_their_sizes():
    config = tiny_config("gemma3_text", layers=4)  # sliding, full, sliding, full
    cache = StaticKVCache(config, 2, 64, max_step_tokens=5)
    assert cache.has_ring_layers and _ring_layers(cache) == [0, 2]
    assert [layer.keys.shape[2] for layer in cache.layers] == [WINDOW + 4, 64, WINDOW + 4, 64]
    assert [layer.ring_window for layer in cache.layers] == [WINDOW, None, WINDOW, None]
    assert "max_step_tokens=5 (2 ring-buffer layers)" in repr(cache)
    # no max_step_tokens, or a ring no shorter than the cache: every layer keeps max_cache_len slots
    for cache in (StaticKVCache(config, 2, 64), StaticKVCache(config, 2, WINDOW + 4, max_step_tokens=5)):
        assert not cache.has_ring_layers and {layer.keys.shape[2] for layer in cache.layers} == {cache.max_cache_len}
    assert not StaticKVCache(tiny_config("llama"), 1, 64, max_step_tokens=2).has_ring_layers  # no windows
    with pytest.raises(ValueError, match="max_step_tokens"):
        StaticKVCache(config, 2, 64, max_step_tokens=0)


@pytest.mark.parametrize("family", RING_FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_through_rings_equals_transformers(family, side):
    """The prompt (7 columns) goes in chunks of 3 through a cache whose sliding layers hold WINDOW + 2
    slots, wrapping several times by the 12th new token; the tokens are transformers' own."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, side)
    cache = StaticKVCache(patched.config, 3, 7 + NEW, max_step_tokens=CHUNK)
    assert _ring_layers(cache)
    forwards = []
    hook = patched.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], past_key_values=cache).sequences
    hook.remove()
    assert forwards[:3] == [3, 3, 1] and set(forwards[3:]) == {1}
    if side == "left":
        want = hf_greedy(model, ids, mask, NEW, eos_token_id=None)
    else:  # transformers continues from the last column: compare with its left-padded run
        want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences  # full-length cache
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "gpt_oss"])
def test_speculative_and_prompt_lookup_rounds_roll_back_inside_the_ring(family, monkeypatch):
    """speculative_generate / prompt_lookup_generate allocate rings of window + k slots (the chunk
    lowered to k + 1): every round writes k + 1 tokens and rolls back the rejected ones; greedy output
    stays the target's own greedy decoding."""
    model = tiny_model(family)
    target = patched_copy(model, int8=False)
    draft = patch_model(tiny_model(family, seed=1), int8=False)  # other weights: it is often rejected
    ids, mask = ragged_prompts(3, 7, "left")
    want = hf_greedy(model, ids, mask, NEW, eos_token_id=None)
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 1)
    caches = record_caches(monkeypatch, "gptfast_kernels.generation.speculative")
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert out.num_accepted.sum() < out.num_proposed.sum()  # rounds were rejected, so rolled back
    assert all(_ring_layers(cache) and cache.max_step_tokens == 4 for cache in caches) and len(caches) == 2
    real = ids[:, 4:]  # the columns where every row has real tokens, three times: n-grams to look up
    repeated = torch.cat([real, real, real], dim=1)
    repeated = repeated, torch.ones_like(repeated)
    lookup = prompt_lookup_generate(target, *repeated, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(lookup.sequences, hf_greedy(model, *repeated, NEW, eos_token_id=None))
    assert lookup.num_accepted.sum() > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_compiled_decode_through_rings(family, monkeypatch):
    patched = patched_copy(tiny_model(family), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    eager = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    monkeypatch.setattr(forward, "PREFILL_CHUNK", CHUNK)
    compiled = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True).sequences
    assert _ring_layers(patched._gptfast_cache)
    assert torch.equal(compiled, eager)


def test_what_a_ring_cannot_serve_is_refused():
    model = tiny_model("gemma3_text")
    patched = patched_copy(model, int8=False)
    cache = StaticKVCache(patched.config, 1, 32, max_step_tokens=CHUNK)
    with pytest.raises(ValueError, match="max_step_tokens = 3"):  # more tokens in one forward than the ring takes
        patched(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
    assert int(cache.seq_lengths[0]) == 0
    with pytest.raises(ValueError, match="patched model"):  # transformers' own attention reads buffers in order
        model(torch.tensor([[5, 6]]), past_key_values=cache)
    for _ in range(4):
        patched(torch.tensor([[5, 6, 7]]), past_key_values=cache)
    assert int(cache.seq_lengths[0]) == int(cache.written_lengths[0]) == 12
    cache.crop(-3)  # back by max_step_tokens: the window before it is still whole
    with pytest.raises(ValueError, match="row 0 would go back to length 8"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="row 0"):
        cache.crop(torch.tensor([5]))
    assert int(cache.seq_lengths[0]) == 9
    cache.crop(torch.tensor([0]))  # emptying a row always works, and it starts over
    assert int(cache.written_lengths[0]) == 0
    patched(torch.tensor([[5, 6, 7]]), past_key_values=cache)
    cache.crop(-1)


def test_a_window_other_than_the_one_the_ring_was_sized_for_is_refused():
    patched = patched_copy(tiny_model("mistral"), int8=False)
    config = tiny_config("mistral", sliding_window=WINDOW + 1)
    cache = StaticKVCache(config, 1, 32, max_step_tokens=CHUNK)
    with pytest.raises(ValueError, match=f"sized for a sliding window of {WINDOW + 1}.*window {WINDOW}"):
        patched(torch.tensor([[5, 6]]), past_key_values=cache)
