"""StaticKVCache: buffers and geometry per family, per-row lengths, planning positions, crop /
reset, a full cache refusing cleanly, use by an unpatched model, bad arguments."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, LinearAttentionLayer

from gptfast_kernels import StaticKVCache
from gptfast_kernels.modules.cache_layers import NoCacheLayer, StaticKVLayer
from python_tests.tiny_models import (ATTENTION_FREE, AUTO_CONFIGS, FAMILIES, HYBRID, KV_SHARING, LATENT,
                                     PARALLEL_HYBRID, patched_copy, tiny_config, tiny_model)

GEOMETRY = {"llama": (2, 2, 16), "mistral": (2, 2, 16), "qwen2": (2, 1, 8), "qwen3": (2, 2, 16),
            "gemma": (2, 1, 32), "gemma2": (2, 2, 16), "gemma3_text": (2, 2, 16), "olmo2": (2, 2, 16),
            "granite": (2, 2, 16), "phi3": (2, 2, 16),
            "cohere": (2, 2, 16), "olmo": (2, 2, 16), "helium": (2, 2, 16), "smollm3": (2, 2, 16),
            "glm": (2, 2, 32), "phi": (2, 4, 16), "starcoder2": (2, 2, 16),
            "gpt2": (2, 4, 16), "gpt_neox": (2, 4, 16), "mixtral": (2, 2, 16), "qwen2_moe": (2, 2, 8),
            "qwen3_moe": (2, 2, 16), "olmoe": (2, 2, 16), **{family: (2, 2, 16) for family in AUTO_CONFIGS},
            "opt": (2, 4, 16), "gpt_bigcode": (2, 1, 16), "persimmon": (2, 4, 16), "modernbert-decoder": (2, 4, 16),
            **{family: (2, 4, 16) for family in ("gptj", "codegen", "biogpt", "ctrl")}, "falcon": (2, 2, 16),
            "gpt_neo": (2, 4, 16), "xglm": (2, 4, 16), "bloom": (2, 12, 8), "mpt": (2, 12, 8),
            "nemotron_h": (4, 2, 16), **{family: (2, None, None) for family in ATTENTION_FREE},
            "zamba2": (4, 2, 32), "zamba": (4, 2, 32),
            "dory": (6, 2, 16),  # (its 4 layers, then the second run of its recurrent layers 1 and 2)
            "lfm3": (3, 2, 16), "lara_mini": (3, 2, 16), "dbrx": (2, 2, 16),
            **{family: (4, 2, 16) for family in KV_SHARING},
            # multi-head latent attention: one "kv head" of the latent (32) and rotary key (8), whose first
            # 32 numbers are the values (no value buffer)
            **{family: (2, 1, 40) for family in LATENT}}
VALUE_DIM = {family: 32 for family in LATENT}
# families whose layers differ: per layer (kv heads, head dim) of its buffers, None for a layer without
# (Gemma 4's global layer 1 has its own; its layers 2 and 3 attend over layers 0's and 1's buffers, as Gemma
# 3n's do)
LAYER_GEOMETRY = {**{family: [(2, 16), (1, 32), None, None] for family in KV_SHARING},
                  "gemma3n_text": [(2, 16), (2, 16), None, None],
                  # MiMo-V2-Flash: twice the kv heads on the local layer 0; values 16 wide, kept in buffers
                  # as wide as the keys (24)
                  "mimo_v2_flash": [(4, 24), (2, 24)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_buffers_follow_the_config(family):
    layers, kv_heads, head_dim = GEOMETRY[family]
    cache = StaticKVCache(tiny_config(family), 3, 20, dtype=torch.bfloat16)
    assert isinstance(cache, Cache) and len(cache.layers) == layers
    # a hybrid model's recurrent layers (layer 0 of the tiny Qwen3.5; every layer of Falcon-H1, which
    # also attends in each) hold transformers' state layer
    recurrent = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)]
    # (Zamba2's: Mamba-2 in every layer, attention beside it in 3 of 4; Zamba's likewise with Mamba)
    want = list(range(layers)) if family in PARALLEL_HYBRID + ATTENTION_FREE + ("zamba2", "zamba") else [0] \
        if family in HYBRID else []
    assert recurrent == want and cache.has_recurrent_layers == bool(recurrent)
    # Nemotron-H's MoE and MLP blocks are layers of their own (1 and 3 of its tiny config), with no cache
    cacheless = [i for i, layer in enumerate(cache.layers) if isinstance(layer, NoCacheLayer)]
    assert cacheless == ([1, 3] if family == "nemotron_h" else [2, 3] if family in KV_SHARING else [])
    both = len(recurrent) if family in PARALLEL_HYBRID else 3 if family in ("zamba2", "zamba") else 0
    assert len(cache.attention_layers) == layers - len(recurrent) - len(cacheless) + both
    geometry = LAYER_GEOMETRY.get(family, [(kv_heads, head_dim)] * layers)
    value_dim = VALUE_DIM.get(family)
    for layer, (kv_heads, head_dim) in zip(cache.attention_layers, [g for g in geometry if g is not None]):
        assert layer.keys.shape == (3, kv_heads, 20, head_dim)
        assert layer.values.shape == (3, kv_heads, 20, 0 if value_dim else head_dim)
        assert layer.value_dim == value_dim and layer.keys.dtype == torch.bfloat16
    # the geometry a patched model checks is the buffers' own
    assert cache.geometry == tuple(
        ((layer.keys.shape[1], layer.keys.shape[3]) + ((layer.value_dim,) if layer.value_dim else ()))
        if isinstance(layer, StaticKVLayer) else None for layer in cache.layers)
    assert cache.get_seq_length() == 0 and cache.get_max_length() == 20 and cache.batch_size == 3
    assert cache.is_compileable


def test_plan_step_positions_follow_lengths_and_padding():
    cache = StaticKVCache(tiny_config("llama"), 3, 12)
    cache.seq_lengths.copy_(torch.tensor([0, 4, 7]))
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 0, 0]])
    positions = cache.plan_step(3, mask)
    assert positions.tolist() == [[-1, 0, 1], [4, 5, 6], [7, -1, -1]]
    cache.commit_step()
    assert cache.seq_lengths.tolist() == [2, 7, 8]
    # HF-style [B, past + T] masks: the last T columns describe the new tokens
    assert cache.plan_step(1, torch.ones(3, 9)).tolist() == [[2], [7], [8]]
    cache.commit_step()
    assert cache.plan_step(2, None, torch.tensor([[0, 1]])).tolist() == [[0, 1]] * 3


def test_a_step_planned_with_hide_length_reports_no_past_until_it_ends():
    """Family.fused_length_zero (Falcon, BLOOM): inside such a fused step the model code sees length 0,
    as the step's mask sizes say (it sizes its ALiBi tensor by it); the real lengths come back when
    the step commits or is discarded, and other steps never hide them."""
    cache = StaticKVCache(tiny_config("llama"), 2, 12)
    cache.seq_lengths.copy_(torch.tensor([3, 5]))
    cache.plan_step(2, hide_length=True)
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(2) == (2, 0)
    cache.commit_step()
    assert cache.get_seq_length() == 7
    cache.plan_step(1, hide_length=True)
    cache.discard_step()
    assert cache.get_seq_length() == 7
    cache.plan_step(1)
    assert cache.get_seq_length() == 7
    cache.commit_step()
    cache.plan_step(1, hide_length=True, fused=False)  # an unpatched model's step: its masks need the length
    assert cache.get_seq_length() == 8
    cache.commit_step()
    cache.plan_step(1, hide_length=True)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache._hide_length


def test_full_cache_refuses_before_writing():
    model = tiny_model("llama")
    from gptfast_kernels import patch_model

    patch_model(model, int8=False)
    cache = StaticKVCache(model.config, 1, 5)
    with torch.no_grad():
        model(torch.tensor([[2, 3, 4, 5]]), past_key_values=cache)
        before = cache.layers[0].keys.clone()
        with pytest.raises(ValueError, match="full.*max_cache_len"):
            model(torch.tensor([[6, 7]]), past_key_values=cache)
    assert cache.seq_lengths.tolist() == [4] and torch.equal(cache.layers[0].keys, before)


def test_generation_caches_skip_the_position_check_only_when_sized_for_the_loop():
    """A user's cache keeps the eager position check (a GPU sync per forward); the caches that
    generate / speculative_generate allocate for exactly what they write turn it off."""
    from gptfast_kernels.generation.forward import cache_for

    model = tiny_model("llama")
    assert StaticKVCache(model.config, 1, 5).check_positions
    for reuse in (False, True):
        cache = cache_for(model, 2, 20, "cpu", torch.float32, reuse=reuse)
        assert not cache.check_positions and cache.max_cache_len >= 20
        cache.seq_lengths.fill_(cache.max_cache_len)
        cache.plan_step(1)  # past the end, not checked: the loop's own sizing is the guarantee
        cache.check_positions = True
        with pytest.raises(ValueError, match="full"):
            cache.plan_step(1)


@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek_v3", "gemma3n_text"])
def test_first_rows_are_views_of_the_cache(family):
    """first_rows(b): every buffer the first b rows of the cache's own, at its address (one view per
    size, handed out again), the lengths shared; a patched model's forward on the view writes the
    cache's rows as a forward on the cache writes them (ring buffers, latents, shared layers);
    refused for more rows than the cache has and for recurrent states."""
    model = patched_copy(tiny_model(family), int8=False)
    config = model.config
    cache = StaticKVCache(config, 3, 16, max_step_tokens=8)
    rows = cache.first_rows(2)
    assert rows.batch_size == 2 and cache.first_rows(2) is rows and cache.first_rows(3) is cache
    assert rows.max_cache_len == cache.max_cache_len and rows.geometry == cache.geometry
    assert [type(layer) for layer in rows.layers] == [type(layer) for layer in cache.layers]
    for own, view in zip(cache.attention_layers, rows.attention_layers):
        assert view.keys.data_ptr() == own.keys.data_ptr() and view.keys.shape[0] == 2
        assert view.values.data_ptr() == own.values.data_ptr() and view.values.shape[1:] == own.values.shape[1:]
        assert view.is_ring == own.is_ring and view.batch_size == 2 and own.batch_size == 3
    assert rows.seq_lengths.data_ptr() == cache.seq_lengths.data_ptr()
    assert rows.written_lengths.data_ptr() == cache.written_lengths.data_ptr()
    ids = torch.randint(2, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    alone = StaticKVCache(config, 2, 16, max_step_tokens=8)
    with torch.no_grad():
        want = model(ids, past_key_values=alone).logits
        got = model(ids, past_key_values=rows).logits
    torch.testing.assert_close(got, want)
    assert cache.seq_lengths.tolist() == [5, 5, 0]
    for own, other in zip(cache.attention_layers, alone.attention_layers):
        torch.testing.assert_close(own.keys[:2], other.keys)
        assert not own.keys[2].any()
    for bad in (4, 0):
        with pytest.raises(ValueError, match="batch_size"):
            cache.first_rows(bad)
    hybrid = StaticKVCache(tiny_config("qwen3_next"), 3, 16)
    with pytest.raises(ValueError, match="recurrent states"):
        hybrid.first_rows(2)


def test_a_kept_cache_serves_smaller_batches_from_its_rows():
    """cache_for with reuse: a smaller batch takes the kept cache's first rows (no allocation, the
    same addresses whenever that size comes again), a larger one allocates anew; a cache a holder
    took is not handed to another caller while the holder lives; a hybrid model's cache (recurrent
    states) is allocated anew for another batch size, and both sizes' caches are kept."""
    from gptfast_kernels.generation.forward import cache_for

    model = tiny_model("llama")
    big = cache_for(model, 3, 20, "cpu", torch.float32, reuse=True)
    small = cache_for(model, 2, 20, "cpu", torch.float32, reuse=True)
    assert small.batch_size == 2 and small.layers[0].keys.data_ptr() == big.layers[0].keys.data_ptr()
    assert cache_for(model, 3, 20, "cpu", torch.float32, reuse=True) is big
    assert cache_for(model, 2, 20, "cpu", torch.float32, reuse=True) is small
    larger = cache_for(model, 4, 20, "cpu", torch.float32, reuse=True)
    assert larger.batch_size == 4 and larger is not big

    class Holder:  # (a batcher: its rows live between its steps)
        pass

    holder = Holder()
    held = cache_for(model, 4, 20, "cpu", torch.float32, reuse=True, holder=holder)
    assert held is larger and cache_for(model, 4, 20, "cpu", torch.float32, reuse=True, holder=holder) is held
    del holder  # (gone: the cache is handed out again)
    assert cache_for(model, 4, 20, "cpu", torch.float32, reuse=True) is held
    holder = Holder()
    holder.itself = holder  # (garbage in a reference cycle, as a batcher may be, until the collector runs)
    assert cache_for(model, 4, 20, "cpu", torch.float32, reuse=True, holder=holder) is held
    del holder
    assert cache_for(model, 4, 20, "cpu", torch.float32, reuse=True) is held
    holder = Holder()
    assert cache_for(model, 4, 20, "cpu", torch.float32, reuse=True, holder=holder) is held
    other = cache_for(model, 2, 20, "cpu", torch.float32, reuse=True)  # a call meanwhile: a cache of its own
    assert other.layers[0].keys.data_ptr() != held.layers[0].keys.data_ptr()
    assert cache_for(model, 4, 20, "cpu", torch.float32, reuse=True, holder=Holder()) is not held
    hybrid = tiny_model("qwen3_next")
    first = cache_for(hybrid, 3, 20, "cpu", torch.float32, reuse=True)
    second = cache_for(hybrid, 2, 20, "cpu", torch.float32, reuse=True)
    assert second.batch_size == 2 and second is not first
    assert cache_for(hybrid, 3, 20, "cpu", torch.float32, reuse=True) is first
    assert cache_for(hybrid, 2, 20, "cpu", torch.float32, reuse=True) is second


def test_calls_whose_shapes_take_turns_find_their_caches_kept():
    """A batch of short prompts and one long prompt in turn: neither cache serves the other call, so
    the model keeps both (KEPT_CACHES) and each call after the first two finds its own, at its
    addresses (on a GPU: its CUDA graphs replayed, not recorded again at every call). A new cache
    that serves every call a kept one served replaces it; past KEPT_CACHES the least recently used
    goes."""
    from gptfast_kernels.generation.forward import CACHE_LEN_QUANTUM as Q
    from gptfast_kernels.generation.forward import KEPT_CACHES, cache_for

    assert KEPT_CACHES == 2
    model = tiny_model("llama")
    made = []  # (every cache handed out stays alive here, so no address is used twice)

    def call(batch_size, needed):
        made.append(cache_for(model, batch_size, needed, "cpu", torch.float32, reuse=True))
        return made[-1].layers[0].keys.data_ptr()

    short_batch, one_long = call(3, 20), call(1, Q + 40)
    assert short_batch != one_long
    for _ in range(3):
        assert (call(3, 20), call(1, Q + 40)) == (short_batch, one_long)
    assert call(2, 20) == short_batch  # (the one that serves it, from its first rows)
    longer = call(2, 2 * Q + 1)  # it serves every call one_long served: one_long is dropped
    assert longer not in (short_batch, one_long)
    assert (call(1, Q + 40), call(3, 20)) == (longer, short_batch)
    longest = call(1, 3 * Q + 1)  # serves neither's calls, nor they its: the least recent (longer) goes
    assert longest not in (short_batch, longer) and call(3, 20) == short_batch
    assert call(2, 2 * Q + 1) not in (short_batch, one_long, longer, longest)
    every = call(4, 4 * Q)  # serves every call of both kept ones: they are dropped
    assert {call(3, 20), call(1, 3 * Q + 1), call(2, 2 * Q + 1)} == {every}
    assert [entry.cache for entry in model._gptfast_cache_kept] == [model._gptfast_cache]


def test_crop_and_reset():
    cache = StaticKVCache(tiny_config("gpt2"), 3, 10)
    cache.seq_lengths.copy_(torch.tensor([5, 8, 2]))
    cache.crop(-2)
    assert cache.seq_lengths.tolist() == [3, 6, 0]
    cache.crop(0)  # transformers' "remove nothing"
    assert cache.seq_lengths.tolist() == [3, 6, 0]
    cache.crop(4)
    assert cache.seq_lengths.tolist() == [3, 4, 0]
    cache.crop(torch.tensor([1, 9, 0]))  # per row; a longer target leaves a row as it is
    assert cache.seq_lengths.tolist() == [1, 4, 0] and cache.get_seq_length() == 4
    cache.layers[1].keys.fill_(3.0)
    cache.reset()
    assert cache.get_seq_length() == 0 and torch.all(cache.layers[1].keys == 0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.crop(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="num_tokens"):
        cache.crop(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_tokens"):
        cache.crop("all")
    cache.seq_lengths.copy_(torch.tensor([5, 8, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        cache.crop(torch.tensor([-1, 3, 1]))
    assert cache.seq_lengths.tolist() == [5, 8, 2]  # refused before anything changed
    cache.crop(torch.tensor([4, 3, 1]), check=False)  # lengths valid by construction: no GPU sync
    assert cache.seq_lengths.tolist() == [4, 3, 1]


# (MiMo-V2-Flash: values narrower than the keys fill the first columns of their buffers)
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3_5_text", "falcon_h1", *KV_SHARING, "mimo_v2_flash"])
def test_unpatched_model_uses_it_like_a_static_cache(family):
    model = tiny_model(family)
    ids = torch.randint(2, 90, (2, 6))
    with torch.no_grad():
        cache = StaticKVCache(model.config, 2, 8)
        ours = torch.cat([model(ids[:, :4], past_key_values=cache).logits,
                          model(ids[:, 4:], past_key_values=cache).logits], dim=1)
        dynamic = DynamicCache(config=model.config)
        want = torch.cat([model(ids[:, :4], past_key_values=dynamic).logits,
                          model(ids[:, 4:], past_key_values=dynamic).logits], dim=1)
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
    assert cache.seq_lengths.tolist() == [6, 6]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch_size=0, max_cache_len=4), "batch_size"),
    (dict(batch_size=2, max_cache_len=-1), "max_cache_len"),
    (dict(batch_size=2.0, max_cache_len=4), "batch_size"),
    (dict(batch_size=2, max_cache_len=4, dtype=torch.int8), "dtype"),
])
def test_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StaticKVCache(tiny_config("llama"), **kwargs)


def test_caches_longer_than_the_sliding_window_and_unsupported_families():
    # sliding-window layers keep every slot (the kernel reads only the window): any length is fine
    cache = StaticKVCache(tiny_config("mistral", sliding_window=8), 1, 64)
    assert all(layer.keys.shape[2] == 64 for layer in cache.layers)
    from transformers import BertConfig

    with pytest.raises(ValueError, match="supported model families"):
        StaticKVCache(BertConfig(), 1, 8)


@pytest.mark.parametrize("family, shape", [("llama", "4-D"), ("gemma2", "dict"), ("qwen2", "dict")])
def test_transformers_generate_with_it_names_the_way_that_works(family, shape):
    """transformers' generate builds a 4-D mask for a static cache (a dict of them, one per layer
    type, for windowed models: an AttributeError before), which the per-row positions cannot be read
    from: a clear error pointing to gptfast_kernels.generate, not a wrong answer."""
    from python_tests.tiny_models import patched_copy

    patched = patched_copy(tiny_model(family), int8=False)
    ids = torch.randint(2, 90, (2, 6))
    with pytest.raises(ValueError, match=f"{shape} attention_mask.*gptfast_kernels.generate"):
        patched.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         past_key_values=StaticKVCache(patched.config, 2, 16))


def test_an_unpatched_model_gets_clear_errors_where_it_would_read_wrong_rows():
    """An unpatched model's forward positions every row at the longest row's length and attends over
    the cache's buffers as they are: a cache of another batch size (a batch of 2 on a cache of 1
    read row 0's keys for row 1), rows of different lengths (after a per-row crop) or of another
    dtype (a crash inside SDPA) are refused, naming what to change."""
    model = tiny_model("llama")
    ids = torch.randint(2, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(ValueError, match="runs 2 rows but the cache holds batch_size = 1"):
            model(ids, past_key_values=StaticKVCache(model.config, 1, 8))
        cache = StaticKVCache(model.config, 2, 8)
        model(ids[:, :5], past_key_values=cache)
        cache.crop(torch.tensor([3, 5]))
        with pytest.raises(ValueError, match="different lengths"):
            model(ids[:, 5:], past_key_values=cache)
        with pytest.raises(ValueError, match="dtype=torch.float32"):
            model(ids, past_key_values=StaticKVCache(model.config, 2, 8, dtype=torch.bfloat16))


def test_reorder_cache_and_copy_prefix_check_their_arguments():
    """A beam_idx shorter than the batch broadcast one row over every row (keys, values and lengths),
    silently; out-of-range, float or list indices failed inside torch."""
    cache = StaticKVCache(tiny_config("llama"), 2, 8)
    cache.seq_lengths.copy_(torch.tensor([4, 7]))
    for bad, error, needle in ((torch.tensor([1]), ValueError, "one row index per cache row"),
                               (torch.tensor([0, 5]), ValueError, r"in \[0, 2\)"),
                               (torch.tensor([0.0, 1.0]), ValueError, "dtype"), ([1, 0], TypeError, "torch.Tensor")):
        with pytest.raises(error, match=needle) as raised:
            cache.reorder_cache(bad)
        assert "beam_idx" in str(raised.value)
    assert cache.seq_lengths.tolist() == [4, 7]
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.seq_lengths.tolist() == [7, 7]
    with pytest.raises(ValueError, match="source"):
        cache.copy_prefix(0.5, 1, 2)
    with pytest.raises(TypeError, match="config"):
        StaticKVCache(None, 1, 8)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_hybrid_reorder_and_reset_move_states_and_keys_together(family):
    """reorder_cache permutes the rows of every key / value buffer, recurrent state and length (a
    Falcon-H1 layer holds both kinds); reset empties them all."""
    from python_tests.tiny_models import patched_copy

    model = patched_copy(tiny_model(family), int8=False)
    cache = StaticKVCache(model.config, 2, 8)
    ids = torch.randint(2, 90, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]), past_key_values=cache)
    recurrent = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
    assert recurrent and (family != "falcon_h1" or all(layer in cache.attention_layers for layer in recurrent))

    def snapshot():
        states = [state for layer in recurrent for state in (*layer.conv_states.values(),
                                                             *layer.recurrent_states.values()) if state is not None]
        kv = [t for layer in cache.attention_layers for t in (layer.keys, layer.values)]
        return [t.clone() for t in (*states, *kv, cache.seq_lengths)]

    before = snapshot()
    assert cache.seq_lengths.tolist() == [4, 3] and all(bool(t[0].ne(t[1]).any()) for t in before)
    cache.reorder_cache(torch.tensor([1, 0]))
    for old, new in zip(before, snapshot(), strict=True):
        assert torch.equal(new, old.flip(0))
    cache.reset()
    assert all(not t.any() for t in snapshot())


def test_kept_caches_give_way_when_a_new_one_does_not_fit(monkeypatch):
    """Out of device memory for a new cache, the kept ones no holder needs are dropped and the
    allocation tried once more; a held one stays kept (its holder still writes to it)."""
    import gc
    import weakref

    from gptfast_kernels.generation import forward

    model = tiny_model("llama")

    class Holder:  # (a batcher)
        pass

    holder = Holder()
    Q = forward.CACHE_LEN_QUANTUM  # (no cache below serves every call another one serves)
    held = forward.cache_for(model, 2, Q + 1, "cpu", torch.float32, reuse=True, holder=holder)
    free = weakref.ref(forward.cache_for(model, 1, 2 * Q + 1, "cpu", torch.float32, reuse=True))
    assert free() is not None
    made, failures = forward.StaticKVCache, []

    def short_of_memory(*args, **kwargs):
        if not failures:
            failures.append(args)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return made(*args, **kwargs)

    monkeypatch.setattr(forward, "StaticKVCache", short_of_memory)
    new = forward.cache_for(model, 3, 20, "cpu", torch.float32, reuse=True)
    gc.collect()
    assert len(failures) == 1 and new.batch_size == 3 and free() is None
    assert [entry.cache for entry in model._gptfast_cache_kept] == [new, held]
