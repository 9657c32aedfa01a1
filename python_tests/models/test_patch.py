"""patch_model on every supported family (tiny models from configs): logits with a StaticKVCache
match the unpatched model, prefill + decode steps equal one full forward, ragged rows, one
kv_cache_attention call per layer per forward, int8 within quantization error, clear errors."""

import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, DynamicCache, Gemma3Config

import gptfast_kernels.models.attention as attention
from gptfast_kernels.models.families import (FAMILIES as FAMILY_TABLE, PARALLEL, SLIDING, family_of, recurrent_loop,
                                             transformers_before)
from gptfast_kernels import Int8Linear, StaticKVCache, ops, patch_model
from gptfast_kernels.models.mamba import Int8OutputHead
from python_tests.tiny_models import (ATTENTION_FREE, ATTENTION_SOFTCAP, FAMILIES, HYBRID, INDEX_POSITIONED, KV_SHARING,
                                     MOE, PARALLEL_HYBRID, SOFTCAPPED, WINDOW, WINDOWED, WITH_SINKS, dequantized_copy,
                                     experts_per_token, patched_copy, ragged_prompts, stepwise_logits, tiny_config,
                                     tiny_model)

TOL = dict(atol=2e-5, rtol=1e-4)


# Jamba's, Mamba's, Falcon-Mamba's and Zamba's Mamba layers start from a fresh state on every multi-token input,
# cache or not (transformers' own model does; a prompt in one piece and then single tokens, as generate runs, is
# unaffected)
CHUNKS_RESTART_STATE = ("jamba", "mamba", "falcon_mamba", "zamba")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_patched_logits_match_unpatched(family, fused):
    model = tiny_model(family)
    patched = patched_copy(model, int8=False, fused_attention=fused)
    ids, _ = ragged_prompts(2, 9, "left")
    chunks = (slice(0, 6), slice(6, 8), slice(8, None))
    with torch.no_grad():
        want = whole = model(ids).logits
        if family in CHUNKS_RESTART_STATE:  # transformers' own model gives these logits in chunks
            hf_cache = {attention.cache_keyword(model): DynamicCache(config=model.config)}  # (Mamba's: cache)
            want = torch.cat([model(ids[:, c], **hf_cache, use_cache=True).logits for c in chunks], dim=1)
            assert not torch.allclose(want, whole, **TOL)
        cache = StaticKVCache(patched.config, 2, 16)
        got = torch.cat([patched(ids[:, c], past_key_values=cache).logits for c in chunks], dim=1)
    torch.testing.assert_close(got, want, **TOL)
    assert cache.seq_lengths.tolist() == [9, 9]
    # without a StaticKVCache the patched model is transformers' SDPA model, unchanged
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, whole, **TOL)
        torch.testing.assert_close(patched(ids, past_key_values=DynamicCache(config=patched.config)).logits,
                                   whole, **TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "llama4_text"])
def test_ragged_rows_match_each_row_alone(family):
    """Left- and right-padded rows in one batch: each row's logits equal the row run alone (Llama 4:
    chunk boundaries and query temperature at each row's own positions, which transformers' own
    padded batch does not give)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    for side in ("left", "right"):
        ids, mask = ragged_prompts(3, 7, side)
        with torch.no_grad():
            cache = StaticKVCache(patched.config, 3, 12)
            logits = patched(ids, attention_mask=mask, past_key_values=cache).logits
            step = patched(torch.tensor([[5], [6], [7]]), past_key_values=cache).logits
            assert cache.seq_lengths.tolist() == (mask.sum(1) + 1).tolist()
            for b in range(3):
                real = ids[b][mask[b] == 1][None]
                alone = model(torch.cat([real, torch.tensor([[5 + b]])], dim=1)).logits[0]
                torch.testing.assert_close(logits[b][mask[b] == 1], alone[:-1], **TOL)
                torch.testing.assert_close(step[b, 0], alone[-1], **TOL)


def test_explicit_position_ids_and_padding_rows():
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (2, 4))
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 2, 10)
        patched(ids[:, :3], past_key_values=cache)
        # row 1 sits this step out (mask 0): nothing written, its length stays
        patched(ids[:, 3:], attention_mask=torch.tensor([[1], [0]]), past_key_values=cache)
        assert cache.seq_lengths.tolist() == [4, 3]
        # rewrite row 0's slot 3 explicitly through position_ids (a rollback without crop)
        out = patched(ids[:, 3:], position_ids=torch.tensor([[3], [3]]), past_key_values=cache).logits
        assert cache.seq_lengths.tolist() == [4, 4]
        torch.testing.assert_close(out[:, 0], model(ids).logits[:, 3], **TOL)


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in ATTENTION_FREE])
def test_the_cache_reads_head_dim_as_the_model_code_does(family):
    """A config.json may set a ``head_dim`` that its config class does not declare (a pruned model's);
    many families' transformers code then takes it over hidden / heads (Phi-3, OLMo 2, Granite, ...),
    others ignore it (GPT-2). The cache's head size must be the model's either way."""
    config = tiny_config(family)
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if heads is None or hidden is None:
        pytest.skip(f"{family}'s config has no num_attention_heads / hidden_size")
    try:
        model = tiny_model(family, head_dim=(getattr(config, "head_dim", None) or hidden // heads) + 8)
        ids = torch.randint(2, 90, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = model(ids).logits
    except (RuntimeError, AttributeError, ValueError) as error:  # (transformers' own model, not ours)
        pytest.skip(f"transformers' {family} model does not run with another head_dim: {error}")
    patched = patched_copy(model, int8=False)
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 2, 10)
        got = torch.cat([patched(ids[:, c], past_key_values=cache).logits
                         for c in (slice(0, 5), slice(5, 6), slice(6, None))], dim=1)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in ATTENTION_FREE])
def test_one_kernel_call_per_layer_per_forward(family, monkeypatch):
    calls = []
    real = attention.run_kv_cache_attention  # what eager attention calls, once its inputs are checked

    def counting(chosen, *args, **kwargs):
        calls.append(chosen)
        return real(chosen, *args, **kwargs)

    monkeypatch.setattr(attention, "run_kv_cache_attention", counting)
    patched = patched_copy(tiny_model(family, layers=3), int8=False)
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 1, 8)
        layers = cache.attention_modules  # all 3, but for a hybrid model's recurrent layers
        # the tiny hybrids: recurrent, full, recurrent (LFM3: conv, sliding, full; LaraMini: gated delta net,
        # sliding, full; Falcon-H1: both in each; Zamba2 and Zamba: 4 layers, both in 3 of them); Gemma 4's has 4
        # layers, of which the last 2 attend over the first 2's keys and values; Dory's 4 make 6 calls (its layers
        # 1 and 2 run twice, the second time over cache layers of their own)
        assert layers == (4 if family in KV_SHARING else 6 if family == "dory" else 3 if family not in HYBRID
                          or family in PARALLEL_HYBRID or family in ("zamba2", "zamba")
                          else 2 if family in ("lfm3", "lara_mini") else 1)
        assert len(cache.attention_layers) == (2 if family in KV_SHARING else layers)
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
        assert len(calls) == layers
        patched(torch.tensor([[6]]), past_key_values=cache)
        assert len(calls) == 2 * layers and set(calls) == {"cpu"}  # "auto"'s pick on a CPU


@pytest.mark.parametrize("family", ATTENTION_FREE)
def test_attention_free_models_advance_the_cache_without_attention(family, monkeypatch):
    """Mamba's cache holds its recurrent states alone: a patched forward calls no attention kernel, plans
    each row's positions and advances its length; transformers' unpatched model is refused the cache
    (nothing would advance the lengths)."""
    calls = []
    monkeypatch.setattr(attention, "run_kv_cache_attention", lambda *args, **kwargs: calls.append(args))
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 2, 12)
        assert cache.attention_layers == [] and cache.attention_modules == 0 and cache.has_recurrent_layers
        patched(ids, attention_mask=mask, past_key_values=cache)
        assert cache.seq_lengths.tolist() == mask.sum(1).tolist()
        patched(torch.tensor([[5], [6]]), past_key_values=cache)
        assert cache.seq_lengths.tolist() == (mask.sum(1) + 1).tolist() and calls == []
        with pytest.raises(ValueError, match="attention-free model .* only once patched"):
            model(ids, **{attention.cache_keyword(model): StaticKVCache(model.config, 2, 12)})


@pytest.mark.parametrize("family", ATTENTION_FREE)
def test_attention_free_output_heads_are_int8_and_say_the_float_dtype(family):
    """Mamba's code casts the hidden states to lm_head.weight's dtype: the int8 head (models/mamba.py) has a
    zero-size weight of the model's dtype for it, and bfloat16 logits equal the int8-rounded model's."""
    model = tiny_model(family).to(torch.bfloat16)
    patched = patched_copy(model, int8=True)
    head = patched.get_output_embeddings()
    assert isinstance(head, Int8OutputHead) and head.weight.dtype == torch.bfloat16 and head.weight.numel() == 0
    assert "weight" not in head.state_dict()
    ids = torch.randint(2, 90, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dequantized_copy(model)(ids).logits
        got = patched(ids, past_key_values=StaticKVCache(patched.config, 2, 8)).logits
    # (the same products, rounded to bfloat16 in other places: 0.5 to 1% of the largest logit here, where
    # transformers' own bfloat16 logits are 0.3 to 2% from its float32 ones)
    torch.testing.assert_close(got, want, atol=0.03 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("family", ["llama", "gptj", "stablelm", "qwen3_5_text", "deepseek_v3", "llama4_text"])
def test_the_cache_reaches_the_kernel_by_either_keyword(family, monkeypatch):
    """transformers 5.24 renamed a forward's ``past_key_values`` to ``cache`` (the old name deprecated):
    a StaticKVCache passed by either name (also the other name beside an explicit None for the model's
    own, which transformers would prefer) takes the fused path: one kernel call per attention layer,
    the same logits (a hybrid's recurrent layers too) and lengths; patch_model records the model's name."""
    calls = []
    real = attention.run_kv_cache_attention
    monkeypatch.setattr(attention, "run_kv_cache_attention",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    patched = patched_copy(tiny_model(family), int8=False)
    keyword = attention.cache_keyword(patched)
    assert patched._gptfast_cache_keyword == keyword
    assert keyword == ("past_key_values" if transformers_before("5.24") else "cache")
    other = "past_key_values" if keyword == "cache" else "cache"
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    logits = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values, deprecated from transformers 5.24
        for way in ("own", "other", "other beside None"):
            cache = StaticKVCache(patched.config, 2, 8)
            passed = {"own": {keyword: cache}, "other": {other: cache},
                      "other beside None": {other: cache, keyword: None}}[way]
            calls.clear()
            logits[way] = torch.cat([patched(ids[:, :3], **passed).logits, patched(ids[:, 3:], **passed).logits],
                                    dim=1)
            assert len(calls) == 2 * cache.attention_modules and cache.seq_lengths.tolist() == [4, 4], way
    torch.testing.assert_close(logits["other"], logits["own"], atol=0, rtol=0)
    torch.testing.assert_close(logits["other beside None"], logits["own"], atol=0, rtol=0)


def test_generation_passes_the_cache_by_the_models_own_keyword():
    """generate, speculative_generate and the GPTFast API call the model with its own cache keyword:
    no deprecation warning about ``past_key_values`` from transformers 5.24 on."""
    from gptfast_kernels import generate, speculative_generate
    from gptfast_kernels.compat import add_kv_cache
    target = patched_copy(tiny_model("llama", layers=2), int8=False)
    draft = patched_copy(tiny_model("llama", layers=1), int8=False)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(target, ids, max_new_tokens=3, eos_token_id=[])
        speculative_generate(target, draft, ids, max_new_tokens=3, speculate_k=2, eos_token_id=[])
        kv_model = add_kv_cache(target)
        kv_model.prefill(ids)
        kv_model(torch.cat([ids, ids[:, :1]], dim=1))
    assert not [w for w in caught if "past_key_values" in str(w.message)]


# Dense families only: a MoE router's top-k is discontinuous, so int8 noise upstream may send a token
# to other experts (it does in the tiny GLM-4-MoE); the MoE families' int8 is held to the exact
# standard below (the model running the rounded weights) instead. The bound is 5% of the largest
# logit; BitNet normalises inside attention and MLP (before o_proj and down_proj), and the hybrid
# families' linear-attention layers their output (before out_proj), which rescales the int8 noise of the
# small products they normalise, so 10% there (BitNet's trained ternary weights would round to
# int8 exactly).
INT8_TOLERANCE = {"bitnet": 0.1, **{family: 0.1 for family in HYBRID}}


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in MOE])
def test_int8_logits_within_quantization_error(family):
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    assert any(isinstance(m, Int8Linear) for m in patched.modules())
    # lm_head too, unless skipped (or read as a float weight by the family's code: Mamba's)
    assert isinstance(patched.get_output_embeddings(), Int8Linear) != ("lm_head" in FAMILY_TABLE[family].float_linears)
    kept = patched_copy(model, int8=True, int8_skip=("lm_head",))
    assert not isinstance(kept.get_output_embeddings(), Int8Linear)
    ids, mask = ragged_prompts(2, 8, "left")
    with torch.no_grad():
        # the cache puts each row's first real token at position 0 (as transformers' generate does)
        want = model(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        got = patched(ids, attention_mask=mask, past_key_values=StaticKVCache(patched.config, 2, 8)).logits
    real = mask.bool()
    error = (got[real] - want[real]).abs().max()
    assert error < INT8_TOLERANCE.get(family, 0.05) * want[real].abs().max(), f"int8 error {error:.3g}"


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_layers_reach_the_kernel_and_decode_past_the_window(family, monkeypatch):
    """Each layer's sliding window (or none, for global layers), Gemma 2's softcap and the sinks of
    GPT-OSS's layers (MiMo-V2-Flash's local ones) reach kv_cache_attention; 12 decode steps past the
    window give the unpatched model's logits."""
    seen = []
    real = attention.run_kv_cache_attention  # what eager attention calls, once its inputs are checked

    def recording(chosen, q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, *args):
        seen.append((window, softcap, sinks is not None))
        return real(chosen, q, k, v, k_cache, v_cache, positions, scale, window, softcap, sinks, *args)

    monkeypatch.setattr(attention, "run_kv_cache_attention", recording)
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(stepwise_logits(patched, ids, StaticKVCache(patched.config, 2, 24), 6), want, **TOL)
    layer_types = getattr(model.config, "layer_types", None) or (
        [{"local": "sliding_attention", "global": "full_attention"}[kind] for kind in model.config.attention_layers]
        if family == "gpt_neo" else ["sliding_attention"] * 2)
    softcap = ATTENTION_SOFTCAP if family in SOFTCAPPED else None
    attention_class = family_of(model.config).attention_class
    sinks = [isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()
             if type(m).__name__ == attention_class]
    assert any(sinks) == (family in WITH_SINKS)
    # (LFM3's convolution layers make no call; ZAYA1's layers attend beside their convolution: "hybrid", windowed
    # "hybrid_sliding")
    attending = [kind for kind in layer_types if kind in (*SLIDING, "full_attention", *PARALLEL)]
    assert len(attending) == len(sinks)
    want_calls = [(WINDOW if kind in SLIDING else None, softcap, layer_sinks)
                  for kind, layer_sinks in zip(attending, sinks)]
    section, extra_runs, _ = recurrent_loop(model.config)  # (Dory runs its layers 1 and 2 twice: 1 2 1 2)
    if section:
        want_calls = want_calls[:section[0]] + want_calls[section[0]:section[-1] + 1] * (extra_runs + 1) + \
            want_calls[section[-1] + 1:]
    assert seen[:len(want_calls)] == want_calls and len(seen) == 13 * len(want_calls)


@pytest.mark.parametrize("family, layer_types",
                         [("phimoe", None), ("qwen2_moe", ["sliding_attention", "full_attention"])])
@pytest.mark.parametrize("max_step_tokens", [None, 6], ids=["full", "ring"])
def test_windows_in_the_mask_alone_reach_the_kernel(family, layer_types, max_step_tokens):
    """PhiMoE and Qwen2-MoE window their layers through the attention mask and pass their attention no
    sliding_window (Family.window_in_mask): past the window, the fused attention must still drop the
    positions the mask drops (it gave full attention: silently other logits; with a ring, an error)."""
    model = tiny_model(family, sliding_window=WINDOW, **({} if layer_types is None else {"layer_types": layer_types}))
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
        assert not torch.allclose(tiny_model(family)(ids).logits, want, **TOL)  # (the window changes them)
    cache = StaticKVCache(patched.config, 2, 24, max_step_tokens=max_step_tokens)
    assert cache.has_ring_layers == (max_step_tokens is not None)
    torch.testing.assert_close(stepwise_logits(patched, ids, cache, 6), want, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_logits_equal_the_model_with_dequantized_weights(family):
    """int8 changes the weights and nothing else: the patched model's logits equal transformers'
    model running the int8-rounded weights in float (mixture-of-experts routing included)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    rounded = dequantized_copy(model)
    ids, mask = ragged_prompts(2, 8, "right" if family in INDEX_POSITIONED else "left")
    with torch.no_grad():
        want = rounded(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        cache = StaticKVCache(patched.config, 2, 12)
        got = patched(ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_zaya_tokens_routed_to_the_skip_expert_get_no_expert_output():
    """ZAYA1's router may pick an extra "skip" class, which transformers passes to the experts as expert 0
    with weight 0: with int8 such tokens still get no expert output (logits as the int8-rounded model's)."""
    model = tiny_model("zaya")
    for module in model.modules():
        if hasattr(module, "balancing_biases"):  # transformers starts the skip class at -1: never picked in
            # the tiny model, whose router probabilities are all about 0.2; 0.005 makes some tokens pick it
            module.balancing_biases[-1] = 0.005
    skipped = []  # per router call: which tokens got the skip class (their weight is masked to 0)
    hooks = [m.register_forward_hook(lambda module, args, out: skipped.append(out[1] == 0))
             for m in model.modules() if type(m).__name__ == "ZayaRouter"]
    ids, mask = ragged_prompts(2, 8, "left")
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions)
    for hook in hooks:
        hook.remove()
    skipped = torch.cat(skipped)
    assert 0 < int(skipped.sum()) < skipped.numel()  # some tokens skip the experts, not all
    with torch.no_grad():
        want = dequantized_copy(model)(ids, attention_mask=mask, position_ids=positions).logits
    patched = patched_copy(model, int8=True)
    router = patched.model.layers[0].mlp.gate  # its projections stay float (the family's float_linears)
    assert type(router.down_proj) is torch.nn.Linear and type(router.router_mlp.out_proj) is torch.nn.Linear
    with torch.no_grad():
        got = patched(ids, attention_mask=mask, past_key_values=StaticKVCache(patched.config, 2, 12)).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_kv_sharing_modes_of_configs_before_transformers_5_23():
    """Before 5.23 Gemma 4 configs have no kv_sharing_modes: ours, from num_kv_shared_layers, equal
    the property's (where the installed transformers has it)."""
    from gptfast_kernels.models.families import kv_sharing_modes, kv_sources

    sliding, full = "sliding_attention", "full_attention"
    for types, shared in [([sliding, full] * 3, 2), ([sliding] * 3 + [full, sliding, full], 2),
                          ([sliding, sliding, full] * 3, 4), ([sliding, full], 0)]:
        config = AutoConfig.for_model("gemma4_text", num_hidden_layers=len(types), layer_types=types,
                                      num_kv_shared_layers=shared)
        if not hasattr(config, "kv_sharing_modes"):
            pytest.skip(f"transformers {transformers.__version__}'s Gemma 4 configs have no kv_sharing_modes")
        plain = SimpleNamespace(num_hidden_layers=len(types), layer_types=types, num_kv_shared_layers=shared)
        # the layers that reuse others' keys and values, and whose (transformers 5.24 also marks every layer
        # "store" in a config without sharing, where 5.23 and ours mark none: the same caches)
        assert [mode == "reuse" for mode in kv_sharing_modes(plain)] == [mode == "reuse" for mode in
                                                                          config.kv_sharing_modes]
        assert kv_sources(plain) == kv_sources(config)


@pytest.mark.parametrize("family", KV_SHARING)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_kv_sharing_layers_attend_over_their_source_layers_buffers(family, fused, monkeypatch):
    """Gemma 4's last layers reuse the keys and values of the last earlier layer of their type: the
    cache keeps no buffers for them, every one of their attention calls reads and writes its source
    layer's buffers, and logits match transformers, also where transformers runs those layers for the
    kept queries alone (logits_to_keep=1 on a prompt) and then decodes from the cache."""
    kernel_caches = []
    real = attention.run_kv_cache_attention  # what eager attention calls, once its inputs are checked

    def recording(chosen, q, k, v, k_cache, *args):
        kernel_caches.append((q.shape[2], k_cache))
        return real(chosen, q, k, v, k_cache, *args)

    monkeypatch.setattr(attention, "run_kv_cache_attention", recording)
    model = tiny_model(family, layers=4)
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    patched = patched_copy(model, int8=False, fused_attention=fused)
    ids, mask = ragged_prompts(2, 9, "left")
    with torch.no_grad():
        hf_cache = DynamicCache(config=model.config)
        want = [model(ids[:, :7], attention_mask=mask[:, :7], past_key_values=hf_cache, logits_to_keep=1).logits]
        want += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=hf_cache).logits
                 for t in (7, 8)]
        cache = StaticKVCache(patched.config, 2, 12)
        got = [patched(ids[:, :7], attention_mask=mask[:, :7], past_key_values=cache, logits_to_keep=1).logits]
        got += [patched(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
                for t in (7, 8)]
    assert cache.kv_sources == [0, 1, 0, 1] and cache.attention_modules == 4
    assert [type(layer).__name__ for layer in cache.layers[2:]] == ["NoCacheLayer"] * 2
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(torch.cat(got[1:], dim=1), torch.cat(want[1:], dim=1), **TOL)
    # per forward, layers 0 to 3, each on the buffers of layer 0 (sliding) or 1 (global); from transformers
    # 5.23 on the prompt's shared layers run its last query alone
    kept = 1 if hasattr(model.model, "_maybe_slice_kv_shared_inputs") else 7
    assert [T for T, _ in kernel_caches] == [7, 7, kept, kept] + [1] * 8
    buffers = [layer.keys for layer in cache.layers[:2]]
    assert all(k_cache is buffers[i % 2] for i, (_, k_cache) in enumerate(kernel_caches))


@pytest.mark.parametrize("family", MOE)
def test_moe_experts_become_int8_and_decode_steps_match(family):
    """Experts become Int8Experts, routers stay float; prefill (above GROUPED_MIN_ROWS rows: the op's
    own grouping by expert on the CPU) and decode steps (one int8_expert_linear row per chosen expert)
    both give the rounded model's logits."""
    from gptfast_kernels.modules.int8_experts import GROUPED_MIN_ROWS, Int8Experts

    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    names = family_of(model.config).experts_classes
    # GraniteMoE's experts in transformers 5.8 have another class, Aria's there another layout (Llama 4's
    # experts are Int8Experts of models/llama4.py's own MoE block)
    if not any(isinstance(m, Int8Experts) for m in patched.modules()):
        pytest.skip(f"{family}'s experts have a layout Int8Experts does not reproduce in this transformers version "
                    "(patch_model warns and keeps them float)")
    experts = [m for m in patched.modules() if isinstance(m, Int8Experts)]
    assert len(experts) == sum(1 for m in model.modules() if type(m).__name__ in names)
    assert not any(type(m).__name__ in names for m in patched.modules())
    # routers (Mixtral's TopKRouter, AFMoE's router around an nn.Linear, HunYuan's Gate): float and unchanged
    # (not Kimi Linear's forget gates: linear-attention projections, int8 like the others)
    routers = [(name, m) for name, m in patched.named_modules()
               if (type(m).__name__.lower().endswith(("router", "gate")) or name.endswith((".router", ".gate")))
               and not name.endswith("forget_gate")]
    assert routers
    for name, router in routers:
        original = dict(model.get_submodule(name).named_parameters())
        assert not any(isinstance(m, Int8Linear) for m in router.modules()), name
        assert original and all(torch.equal(p, original[n]) for n, p in router.named_parameters()), name
    rounded = dequantized_copy(model)
    length = GROUPED_MIN_ROWS // experts_per_token(model.config) + 3  # prompt rows > GROUPED_MIN_ROWS
    ids = torch.randint(2, 90, (1, length + 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = rounded(ids).logits
    got = stepwise_logits(patched, ids, StaticKVCache(patched.config, 1, length + 4), length)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prompt_path_equals_the_op_to_the_bit(dtype):
    """Int8Experts._grouped (the GPU's eager prompt path: a Python loop of int8_linear per expert) and
    the CPU op's own grouping give each row int8_linear's bits for its expert's rows, so on the CPU the
    two agree exactly: experts with a few rows (the GEMV) and with many (the packed GEMM), one unused."""
    from gptfast_kernels.modules.int8_experts import GROUPED_MIN_ROWS, Int8Experts

    experts = next(m for m in patched_copy(tiny_model("mixtral"), int8=True).modules() if isinstance(m, Int8Experts))
    g = torch.Generator().manual_seed(9)
    ids = torch.cat([torch.zeros(GROUPED_MIN_ROWS, dtype=torch.long), torch.full((3,), 1), torch.full((20,), 2)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    rows = torch.randn(ids.numel(), experts.gate_up_qweight.shape[2], generator=g).to(dtype)
    assert experts.num_experts > 3
    with torch.no_grad():
        assert torch.equal(experts._grouped(rows, ids), experts.run(rows, ids))


def test_experts_warning_only_for_experts_kept_float():
    """patch_model warns when a MoE family's experts stay float (a layout Int8Experts does not
    reproduce), not when a model of such a family has no experts at all (every layer dense)."""
    dense = tiny_model("deepseek_v3", first_k_dense_replace=2)
    assert not any(type(m).__name__ == "DeepseekV3Experts" for m in dense.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(dense)
    moe = tiny_model("deepseek_v3")
    with pytest.warns(UserWarning, match="experts keep their float weights"), \
            mock.patch("gptfast_kernels.models.patch.quantize_experts_", return_value=0):
        patch_model(moe)


# per family with tied blocks: the layers holding a block and the groups among them that share one, the
# attribute holding a layer's block, and paths inside a block to int8 modules that must be shared
TIED_BLOCKS = {"zamba2": ({1, 3}, {2}), "zamba": ({0, 1, 3},)}
TIED_PATHS = {"zamba2": ("shared_transformer", ("self_attn.qkv_proj", "self_attn.o_proj", "feed_forward.gate_up_proj",
                                                "feed_forward.down_proj")),
              "zamba": ("shared_transf", ("self_attn.qkv_proj", "self_attn.o_proj", "feed_forward"))}


@pytest.mark.parametrize("family", TIED_BLOCKS)
def test_tied_blocks_keep_one_copy_of_their_int8_weights(family):
    """Zamba2's hybrid layers 1 and 3 use block A, layer 2 block B (Zamba's 0, 1 and 3 its one block), as
    distinct modules over tied weights: int8 keeps them tied (one Int8Linear, one q / k / v fusion, one fused
    MLP per block), and each use has its own cache layer (and Zamba2's its own adapters)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    attribute, paths = TIED_PATHS[family]
    groups = TIED_BLOCKS[family]
    blocks = {i: getattr(patched.model.layers[i], attribute) for group in groups for i in group}
    for path in paths:
        modules = {i: block.get_submodule(path) for i, block in blocks.items()}
        assert len({id(m) for m in modules.values()}) == len(groups), path
        for group in groups:
            assert len({id(modules[i]) for i in group}) == 1, path
    assert isinstance(blocks[min(blocks)].self_attn.o_proj, Int8Linear)
    assert [block.self_attn.layer_idx for _, block in sorted(blocks.items())] == sorted(blocks)
    # the int8 model stores each block's weights once, as the float one did
    unique = {id(t): t for t in patched.buffers()}
    assert sum(t.numel() for t in unique.values()) < sum(t.numel() for _, t in patched.named_buffers(
        remove_duplicate=False))
    first, *others = (getattr(model.model.layers[i], attribute).self_attn for i in sorted(groups[0]))
    assert all(first.q_proj.weight is other.q_proj.weight for other in others)  # (transformers' tie)


def test_patch_is_idempotent_and_switchable():
    model = tiny_model("llama")
    patched = patch_model(patch_model(model, int8=False), int8=False, fused_attention=False)
    assert len(patched._forward_pre_hooks) == 1 and patched.config._attn_implementation == attention.UNFUSED
    patch_model(patched, int8=False)
    assert patched.config._attn_implementation == attention.FUSED


@pytest.mark.parametrize("family", ["gemma2", "vaultgemma"])
def test_soft_capped_attention_without_a_cache_takes_left_padding(family):
    """Without a StaticKVCache a soft-capped model attends in plain PyTorch: a left-padded row's
    padding queries, which may attend to nothing, got NaN, which the next layer carried into the
    row's real tokens (transformers' own gave finite logits; its generate on the patched model other
    tokens). Masked scores are now float32's lowest, as transformers' eager attention has them."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    with torch.no_grad():
        want, got = model(ids, attention_mask=mask).logits, patched(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (mask == 0).any() and got[real].isfinite().all()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_a_backward_through_the_cached_attention_is_a_clear_error():
    """With a StaticKVCache the attention is the fused op, which has no gradient: a backward raises
    (q / k / v projections silently got none). Without a cache the patched model trains as
    transformers' own (its attention is transformers'; int8 layers pass gradients on)."""
    model = patch_model(tiny_model("llama"), int8=False)
    ids = torch.randint(2, 90, (1, 5))
    with pytest.raises(RuntimeError, match="no gradient"):
        model(ids, past_key_values=StaticKVCache(model.config, 1, 8)).logits.sum().backward()
    model.zero_grad()
    model(ids).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_patching_again_keeps_the_record_true_to_the_int8_layers():
    """A second patch_model may quantize more (int8_skip narrowed, or int8 after int8=False) and switch
    the attention, but cannot make int8 layers float: int8=False, or an int8_skip naming more layers,
    after int8 is refused (it recorded options the model did not have, so save_patched wrote a
    directory load_patched refused). int8_skip must hold strings."""
    from gptfast_kernels.modules.int8_linear import Int8Linear

    model = patch_model(tiny_model("llama"), int8_skip=("lm_head",))
    for options in (dict(int8=False), dict(int8_skip=("lm_head", "o_proj"))):
        with pytest.raises(ValueError, match="already patched with int8=True"):
            patch_model(model, **options)
    patch_model(model, fused_attention=False, int8_skip="lm_head")
    assert not isinstance(model.lm_head, Int8Linear)
    patch_model(model)  # lm_head quantized too now, and recorded so
    assert isinstance(model.lm_head, Int8Linear) and model._gptfast_patch_options["int8_skip"] == []
    for bad in (None, [1], ("lm_head", 2)):
        with pytest.raises(TypeError, match="int8_skip"):
            patch_model(tiny_model("llama"), int8_skip=bad)


def test_unsupported_model_names_supported_families():
    model = AutoModelForCausalLM.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                        intermediate_size=64, vocab_size=50, is_decoder=True))
    with pytest.raises(ValueError, match="llama.*mistral|gpt2"):
        patch_model(model)
    # bidirectional attention (Gemma 3 used as an encoder) is not causal decoding: refused, not wrong
    bidirectional = tiny_model("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        patch_model(bidirectional)
    # Gemma 4's: "all" refused, "vision" (both ways among image tokens, which a text model has none of) not
    for family in ("gemma4_text", "gemma4_unified_text"):
        with pytest.raises(ValueError, match=f"{family} models with use_bidirectional_attention='all'"):
            family_of(tiny_config(family, use_bidirectional_attention="all"))
        assert family_of(tiny_config(family, use_bidirectional_attention="vision")).model_type == family
    # a multimodal wrapper of a supported text model (its image tokens attend both ways)
    with pytest.raises(ValueError, match="'gemma3' wraps a 'gemma3_text' text model"):
        family_of(Gemma3Config())
    with pytest.raises(TypeError, match="model"):
        patch_model(torch.nn.Linear(2, 2))


def test_a_family_whose_layers_drop_the_cache_is_caught(monkeypatch):
    """StableLM's decoder layers do not pass transformers' attention keywords on (5.8 to 5.23),
    so its attention never sees the StaticKVCache: listed as a family anyway, its patched forward
    must fail loudly rather than attend to the new tokens alone."""
    from transformers import StableLmConfig

    from gptfast_kernels.models import families

    monkeypatch.setitem(families.FAMILIES, "stablelm",
                        families.Family("stablelm", "StableLmAttention", "num_key_value_heads", None))
    model = AutoModelForCausalLM.from_config(StableLmConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                            num_attention_heads=2, num_key_value_heads=2,
                                                            vocab_size=50))
    patched = patch_model(model, int8=False)
    cache = StaticKVCache(patched.config, 1, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="0 of this StableLmForCausalLM's 2 attention layers"):
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0]


@pytest.mark.parametrize("other", [dict(layers=3), dict(layers=1), dict(num_key_value_heads=4)])
def test_a_cache_built_for_another_config_is_refused(other):
    patched = patched_copy(tiny_model("llama"), int8=False)  # 2 layers x 2 kv heads x head dim 16
    cache = StaticKVCache(tiny_model("llama", **other).config, 1, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"past_key_values: .* this model needs 2 x \(2, 16\);"):
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0]


def test_a_cache_with_other_per_layer_geometry_is_refused():
    """Gemma 4's layers differ (a global layer's head dim and kv heads are its own): a cache whose
    global layer has another head dim is refused, though its other layers fit."""
    patched = patched_copy(tiny_model("gemma4_text"), int8=False)
    config = tiny_config("gemma4_text")
    config.per_layer_config = {i: dict(head_dim=64, num_key_value_heads=1) for i in (1, 3)}
    cache = StaticKVCache(config, 1, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"\(2, 16\), 1 x \(1, 64\), 2 x None, this model needs "
                                                          r"1 x \(2, 16\), 1 x \(1, 32\), 2 x None"):
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0]


def test_values_wider_than_the_keys_are_refused():
    """The cache keeps values narrower than the keys in buffers as wide as the keys (MiMo-V2-Flash);
    wider values have no place there: a clear error from the patched attention and from the
    unpatched model's cache update, the cache unchanged."""
    model = tiny_model("mimo_v2_flash", head_dim=16, v_head_dim=24)
    ids = torch.tensor([[3, 4, 5]])
    patched = patched_copy(model, int8=False)
    cache = StaticKVCache(patched.config, 1, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="values are 24 wide, wider than its keys \\(16\\)"):
        patched(ids, past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0]
    cache = StaticKVCache(model.config, 1, 8)
    refusal = r"holds keys / values of 4 heads x 16, .* values \[1, 4, 3, 24\]"
    with torch.no_grad(), pytest.raises(ValueError, match=refusal):
        model(ids, past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0] and not cache.layers[0].values.any()


def test_attention_checks_each_call_signature_once():
    """The patched attention checks kv_cache_attention's inputs once per call signature and layer (they
    cost more than a small model's kernel); a new shape is checked again, bad inputs still raise the
    wrapper's errors, and the checked path computes what the wrapper does."""
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids, _ = ragged_prompts(2, 9, "left")
    cache = StaticKVCache(patched.config, 2, 16)
    with torch.no_grad():
        patched(ids[:, :6], past_key_values=cache)
        signatures = [dict(layer.checked_calls) for layer in cache.layers]
        assert all(len(s) == 1 and list(s.values()) == ["cpu"] for s in signatures), signatures
        patched(ids[:, 6:7], past_key_values=cache)  # decode: T = 1, a new signature per layer
        patched(ids[:, 7:8], past_key_values=cache)  # the same again: no new one
        assert [len(layer.checked_calls) for layer in cache.layers] == [2] * len(cache.layers)
        # a long-lived cache fed ever new shapes keeps at most MAX_CHECKED_SIGNATURES of them
        long_lived = StaticKVCache(patched.config, 2, attention.MAX_CHECKED_SIGNATURES + 1)
        for t in range(attention.MAX_CHECKED_SIGNATURES + 1):
            long_lived.reset()
            patched(torch.randint(2, 50, (2, t + 1)), past_key_values=long_lived)
        assert [len(layer.checked_calls) for layer in long_lived.layers] == [1] * len(long_lived.layers)

    layer = StaticKVCache(patched.config, 2, 16).layers[0]
    B, Hkv, D = 2, layer.num_heads, layer.head_dim
    q, k, v = torch.randn(B, Hkv, 3, D), torch.randn(B, Hkv, 3, D), torch.randn(B, Hkv, 3, D)
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
    first = attention._attend(layer, q, k, v, positions, None, None, None, None, False, "auto")
    second = attention._attend(layer, q, k, v, positions, None, None, None, None, False, "auto")  # checked before
    want = ops.kv_cache_attention(q, k, v, torch.zeros_like(layer.keys), torch.zeros_like(layer.values), positions,
                                  backend="reference")
    torch.testing.assert_close(first, want, **TOL)
    torch.testing.assert_close(second, want, **TOL)
    with pytest.raises(ValueError, match="v must have k's shape"):
        attention._attend(layer, q, k, v[:, :, :2], positions, None, None, None, None, False, "auto")
    with pytest.raises(ValueError, match="k must have q's dtype"):
        attention._attend(layer, q, k.double(), v, positions, None, None, None, None, False, "auto")
    with pytest.raises(ValueError, match="k_cache must have shape"):
        wide = torch.randn(B, Hkv, 3, D + 1)
        attention._attend(layer, wide, wide, wide, positions, None, None, None, None, False, "auto")
    assert len(layer.checked_calls) == 1


def test_a_family_that_compiles_from_a_release_says_why_the_earlier_ones_do_not():
    """compiles_from and compiles_from_reason come together: the earlier releases' refusal names what
    their model code does (check_compile's ValueError), so a table entry with one alone is refused."""
    from gptfast_kernels.models.families import Family
    with pytest.raises(ValueError, match="'aria_text'.*compiles_from and compiles_from_reason go together"):
        Family("aria_text", "AriaTextAttention", "num_key_value_heads", "head_dim", None, compiles_from="5.18")
    with pytest.raises(ValueError, match="compiles_from and compiles_from_reason"):
        Family("aria_text", "AriaTextAttention", "num_key_value_heads", "head_dim", None,
               compiles_from_reason="loop in Python")
