"""Falcon: its three q / k / v layouts through the fused path (models/falcon.py), each kv head cached
once, int8 FalconLinear projections, ALiBi (Falcon-RW); Falcon's and GPT-Neo's flash-attention
module classes patched like their base classes."""

import copy

import pytest
import torch
import transformers.models.falcon.modeling_falcon as falcon_code
from transformers import DynamicCache

from gptfast_kernels import Int8Linear, StaticKVCache, generate, patch_model
from gptfast_kernels.models import alibi
from gptfast_kernels.models.families import family_of
from python_tests.tiny_models import hf_greedy, patched_copy, ragged_prompts, tiny_model

# the tiny config (Falcon-40B's grouped layout, 4 query heads over 2 kv heads), Falcon-7B's multi-query
# layout (one kv head; num_kv_heads, which the config fills with the query heads' count, unused), and
# multi-head attention with sequential attention and MLP, and the same with ALiBi instead of rotary
# positions (Falcon-RW), with 12 heads: 8 slopes from one geometric series and 4 from a second, whose
# slopes are no powers of two (transformers rounds them to bfloat16)
MULTI_HEAD = dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=4, parallel_attn=False)
LAYOUTS = {"grouped": dict(), "multi_query": dict(new_decoder_architecture=False, multi_query=True),
           "multi_head": MULTI_HEAD,
           "alibi": dict(MULTI_HEAD, alibi=True, hidden_size=96, num_attention_heads=12, num_kv_heads=12)}
# transformers' ALiBi builder for Falcon (the layout test replaces it in transformers' module)
FALCON_ALIBI = falcon_code.build_alibi_tensor
# (kv heads, head dim) of each layout's cache layers
GEOMETRY = {"grouped": (2, 16), "multi_query": (1, 16), "multi_head": (4, 16), "alibi": (12, 8)}


def _alibi_without_rounding(attention_mask, num_heads, dtype):
    """transformers' Falcon ALiBi tensor with its product slope_h * position in float32 instead of
    bfloat16 (its slopes still rounded to bfloat16, as transformers rounds them): the bias the kernels
    add, up to the per-query constant the softmax drops."""
    slopes = FALCON_ALIBI(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32).reshape(-1, 2)[:, 1]
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes.to(attention_mask.device)[:, None] * positions
    return alibi.reshape(-1, 1, attention_mask.shape[1]).to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_each_layout_caches_its_kv_heads_once_and_matches_transformers(layout, fused, monkeypatch):
    """(Against transformers' ALiBi without its bfloat16 rounding of slope x position: see
    test_alibi_differs_from_transformers_by_its_rounding_alone.)"""
    if layout == "alibi":
        monkeypatch.setattr(falcon_code, "build_alibi_tensor", _alibi_without_rounding)
    model = tiny_model("falcon", **LAYOUTS[layout])
    patched = patched_copy(model, int8=False, fused_attention=fused)
    ids, mask = ragged_prompts(2, 8, "left")
    cache = StaticKVCache(patched.config, 2, 16)
    assert cache.geometry == (GEOMETRY[layout],) * 2
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = torch.cat([patched(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache).logits,
                         patched(ids[:, 5:], attention_mask=mask, past_key_values=cache).logits], dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[]).sequences,
                       hf_greedy(model, ids, mask, 6, eos_token_id=None))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_takes_every_falcon_linear(layout):
    """FalconLinear subclasses nn.Linear with a forward of its own that computes nn.Linear's product:
    the family names it, so int8 replaces the fused q / k / v, the output and both MLP projections."""
    patched = patched_copy(tiny_model("falcon", **LAYOUTS[layout]), int8=True)
    layer = patched.transformer.h[0]
    for linear in (layer.self_attention.query_key_value, layer.self_attention.dense, layer.mlp.dense_h_to_4h,
                   layer.mlp.dense_4h_to_h, patched.lm_head):
        assert type(linear) is Int8Linear
    ids, mask = ragged_prompts(2, 6, "left")
    eager = generate(patched, ids, mask, max_new_tokens=5, eos_token_id=[]).sequences
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=5, eos_token_id=[], compile=True).sequences, eager)


def test_without_a_static_cache_it_runs_transformers_attention():
    model = tiny_model("falcon")
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (2, 7))
    with torch.no_grad():
        want = model(ids[:, :4], past_key_values=DynamicCache(config=model.config)).logits
        got = patched(ids[:, :4], past_key_values=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_alibi_slopes_are_transformers_times_the_softmax_scale():
    """transformers adds slope_h * (key position) to the scores before scaling them (its slopes rounded
    to bfloat16): each attention module's slopes are those, scaled, in float32 whether the model is cast
    to bfloat16 before patching or after; a rotary config gets none."""
    bias = FALCON_ALIBI(torch.ones(1, 3, dtype=torch.long), 12, torch.float32).reshape(12, 3)
    rounded = bias[:, 2] / 2  # slope x 2, rounded to bfloat16, halved: the bfloat16 slope
    assert not torch.equal(rounded, rounded.log2().round().exp2())  # (some are no powers of two)
    for cast_first in (False, True):
        model = tiny_model("falcon", **LAYOUTS["alibi"])
        if cast_first:
            model.to(torch.bfloat16)
        patched = patch_model(model, int8=False).to(torch.bfloat16)
        for layer in patched.transformer.h:
            attention = layer.self_attention
            slopes = alibi.slopes_of(attention)
            assert slopes.dtype == torch.float32
            torch.testing.assert_close(slopes, rounded * attention.inv_norm_factor, atol=0, rtol=0)
    rotary = patch_model(tiny_model("falcon", **LAYOUTS["multi_head"]), int8=False)
    assert all(alibi.slopes_of(layer.self_attention) is None for layer in rotary.transformer.h)


def test_alibi_differs_from_transformers_by_its_rounding_alone():
    """transformers rounds each slope_h x position to bfloat16 (models/alibi.py): the patched model's
    logits equal transformers' without that rounding (the layout test) and stay within the rounding's
    effect of transformers' own, here at 8 tokens."""
    model = tiny_model("falcon", **LAYOUTS["alibi"])
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(2, 8, "left")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = patched(ids, attention_mask=mask, past_key_values=StaticKVCache(patched.config, 2, 8)).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-2, rtol=0)


@pytest.mark.parametrize("family, variant", [("falcon", "FalconFlashAttention2"),
                                             ("gpt_neo", "GPTNeoFlashAttention2")])
def test_flash_attention_variants_are_patched_too(family, variant):
    """A model loaded with attn_implementation="flash_attention_2" has Falcon's / GPT-Neo's flash-attention
    subclasses as its attention modules (made here by swapping the class: flash-attn needs a GPU): they get
    the fused forward all the same, and with a StaticKVCache the logits match transformers' model."""
    import importlib

    model = tiny_model(family)
    flash = copy.deepcopy(model)
    code = importlib.import_module(type(model).__module__)
    swapped = 0
    for module in flash.modules():
        if type(module).__name__ == family_of(model.config).attention_class:
            module.__class__ = getattr(code, variant)
            swapped += 1
    assert swapped == 2
    patched = patch_model(copy.deepcopy(flash), int8=False)
    ids = torch.randint(2, 90, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        got = patched(ids, past_key_values=StaticKVCache(patched.config, 2, 8)).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # int8: GPT-Neo's separate q / k / v projections fuse into one as in its base class
    int8 = patch_model(flash, int8=True)
    fused = [hasattr(module, "qkv_proj") for module in int8.modules() if isinstance(module, getattr(code, variant))]
    assert fused == [family == "gpt_neo"] * 2
