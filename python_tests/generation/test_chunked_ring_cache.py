"""Chunked-attention layers as ring buffers (Llama 4; StaticKVCache's max_step_tokens): which layers get
one and of what size, that their calls reach the kernel as ring=True with the chunk, that generation
through them (prompts in chunks, decode, speculative rounds that roll back) gives the tokens of
full-length caches and of transformers, and the crop limits."""

import inspect

import pytest
import torch

from gptfast_kernels import StaticKVCache, generate, speculative_generate
from gptfast_kernels.generation import forward
from gptfast_kernels.models import attention
from gptfast_kernels.modules.cache_layers import StaticKVLayer
from gptfast_kernels.modules.static_kv_cache import attention_chunks
from python_tests.tiny_models import (CHUNK, hf_greedy, patched_copy, ragged_prompts, record_caches, tiny_config,
                                      tiny_model)

FAMILY = "llama4_text"  # layers alternate: chunked (chunks of CHUNK), full
NEW = 12
TOL = dict(atol=2e-5, rtol=1e-4)


def _ring_layers(cache: StaticKVCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if layer.is_ring]


def _recording(monkeypatch):
    """Records (ring, chunk_size) of every kernel call the patched attention makes."""
    seen = []
    real = attention.run_kv_cache_attention

    def recording(*args):
        arguments = inspect.signature(real).bind(*args).arguments
        seen.append((arguments["ring"], arguments.get("chunk_size")))
        return real(*args)

    monkeypatch.setattr(attention, "run_kv_cache_attention", recording)
    return seen


def test_chunked_layers_get_rings_of_chunk_plus_step_slots():
    config = tiny_config(FAMILY, layers=4)  # chunked, full, chunked, full
    assert attention_chunks(config) == [CHUNK, None, CHUNK, None]
    cache = StaticKVCache(config, 2, 64, max_step_tokens=5)
    assert cache.has_ring_layers and _ring_layers(cache) == [0, 2]
    assert [layer.keys.shape[2] for layer in cache.layers] == [CHUNK + 4, 64, CHUNK + 4, 64]
    assert [layer.ring_chunk for layer in cache.layers] == [CHUNK, None, CHUNK, None]
    assert all(layer.ring_window is None for layer in cache.layers)
    assert "max_step_tokens=5 (2 ring-buffer layers)" in repr(cache)
    # no max_step_tokens, or a ring no shorter than the cache: every layer keeps max_cache_len slots
    for cache in (StaticKVCache(config, 2, 64), StaticKVCache(config, 2, CHUNK + 4, max_step_tokens=5)):
        assert not cache.has_ring_layers and {layer.keys.shape[2] for layer in cache.layers} == {cache.max_cache_len}
    # without layer types no layer passes a chunk, and the cache sizes none for one
    config.layer_types = None
    assert attention_chunks(config) == [None] * 4
    with pytest.raises(ValueError, match="ring_window 4, ring_chunk 4"):  # one rule bounds a ring, not two
        StaticKVLayer(1, 1, 8, 16, device=torch.device("cpu"), dtype=torch.float32, ring_window=4, ring_chunk=4)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("step", [1, 3])
def test_generate_through_chunked_rings_equals_full_caches(side, step, monkeypatch):
    """The prompt (7 columns) goes in chunks of ``step`` through a cache whose chunked layer holds
    CHUNK + step - 1 slots (step 1: exactly a chunk, no longer than it, yet the chunk must reach the
    kernel), wrapping several times by the 12th new token: the tokens of a full-length cache."""
    model = tiny_model(FAMILY)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, side)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences  # full-length caches
    seen = _recording(monkeypatch)
    cache = StaticKVCache(patched.config, 3, 7 + NEW, max_step_tokens=step)
    assert _ring_layers(cache) == [0] and cache.layers[0].keys.shape[2] == CHUNK + step - 1
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], past_key_values=cache).sequences
    assert torch.equal(got, want)
    assert set(seen) == {(True, CHUNK), (False, None)} and seen[::2] == [(True, CHUNK)] * (len(seen) // 2)


def test_generate_through_chunked_rings_equals_transformers(monkeypatch):
    """Unpadded rows (transformers scales Llama 4's NoPE queries by batch index, which padding moves):
    the caches generate allocates with a prefill chunk of 3 give transformers' own greedy tokens."""
    model = tiny_model(FAMILY)
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (2, 9), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    caches = record_caches(monkeypatch, "gptfast_kernels.generation.generate")
    got = generate(patched, ids, max_new_tokens=NEW, eos_token_id=[]).sequences
    assert [_ring_layers(cache) for cache in caches] == [[0]]
    assert torch.equal(got, hf_greedy(model, ids, torch.ones_like(ids), NEW, eos_token_id=None))


def test_speculative_rounds_roll_back_inside_chunked_rings(monkeypatch):
    """speculative_generate allocates rings of CHUNK + k slots (the prefill chunk lowered to k + 1):
    every round writes k + 1 tokens and rolls back the rejected ones; greedy output stays the target's
    own greedy decoding through full-length caches."""
    target = patched_copy(tiny_model(FAMILY), int8=False)
    draft = patched_copy(tiny_model(FAMILY, seed=1), int8=False)  # other weights: it is often rejected
    ids, mask = ragged_prompts(3, 7, "left")
    want = generate(target, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 1)
    caches = record_caches(monkeypatch, "gptfast_kernels.generation.speculative")
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert out.num_accepted.sum() < out.num_proposed.sum()  # rounds were rejected, so rolled back
    assert len(caches) == 2 and all(_ring_layers(cache) == [0] and cache.max_step_tokens == 4 for cache in caches)
    assert all(cache.layers[0].keys.shape[2] == CHUNK + 3 for cache in caches)


def test_crop_limits_and_a_rewrite_after_rolling_back():
    """Four forwards of 3 tokens (12 positions through a ring of CHUNK + 2 slots), a crop back by
    max_step_tokens, then 3 other tokens: the logits of transformers over the rewritten sequence. Further
    back than max_step_tokens is refused, but for emptying a row."""
    model = tiny_model(FAMILY)
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (1, 15), generator=torch.Generator().manual_seed(6))
    cache = StaticKVCache(patched.config, 1, 32, max_step_tokens=3)
    with pytest.raises(ValueError, match="max_step_tokens = 3"):  # more tokens in one forward than the ring takes
        patched(ids[:, :4], past_key_values=cache)
    with pytest.raises(ValueError, match="patched model"):  # transformers' own attention reads buffers in order
        model(ids[:, :2], past_key_values=cache)
    assert int(cache.seq_lengths[0]) == 0
    with torch.no_grad():
        for start in range(0, 12, 3):
            patched(ids[:, start:start + 3], past_key_values=cache)
        assert int(cache.seq_lengths[0]) == int(cache.written_lengths[0]) == 12
        cache.crop(-3)  # back by max_step_tokens: the chunk of every later query is still whole
        with pytest.raises(ValueError, match="row 0 would go back to length 8"):
            cache.crop(-1)
        with pytest.raises(ValueError, match="row 0"):
            cache.crop(torch.tensor([5]))
        assert int(cache.seq_lengths[0]) == 9
        rewritten = torch.cat([ids[:, :9], ids[:, 12:15]], dim=1)
        got = patched(rewritten[:, 9:], past_key_values=cache).logits
        torch.testing.assert_close(got, model(rewritten).logits[:, 9:], **TOL)
        cache.crop(torch.tensor([0]))  # emptying a row always works, and it starts over
        assert int(cache.written_lengths[0]) == 0
        torch.testing.assert_close(patched(ids[:, :3], past_key_values=cache).logits, model(ids[:, :3]).logits, **TOL)


def test_a_chunk_other_than_the_one_the_ring_was_sized_for_is_refused():
    patched = patched_copy(tiny_model(FAMILY), int8=False)
    cache = StaticKVCache(tiny_config(FAMILY, attention_chunk_size=CHUNK + 1), 1, 32, max_step_tokens=3)
    with pytest.raises(ValueError, match=f"sized for an attention chunk of {CHUNK + 1}.*attention_chunk_size {CHUNK}"):
        patched(torch.tensor([[5, 6]]), past_key_values=cache)


def test_compiled_decode_through_chunked_rings(monkeypatch):
    patched = patched_copy(tiny_model(FAMILY), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    eager = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    compiled = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True).sequences
    assert _ring_layers(patched._gptfast_cache) == [0]
    assert torch.equal(compiled, eager)
