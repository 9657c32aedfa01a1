"""Multi-head latent attention (DeepSeek-V2 / V3 and the families on their code), absorbed: the
cache holds one latent per token (what transformers' own cache holds, side by side), kv_b_proj stays
float and is never applied to the cache, an unpatched model is refused the cache, bad modules are
refused. Logits, generation, compilation and int8 per family are in the family-wide tests."""

import pytest
import torch
import transformers
from transformers import DynamicCache

from gptfast_kernels import Int8Linear, StaticKVCache, patch_model
from python_tests.tiny_models import LATENT, MLA_DIMS, patched_copy, ragged_prompts, tiny_model

R, DR = MLA_DIMS["kv_lora_rank"], MLA_DIMS["qk_rope_head_dim"]


@pytest.mark.parametrize("family", LATENT)
def test_cache_holds_the_latent_transformers_caches(family):
    """Per token one row [c, k_rot]: transformers' DynamicCache keeps c (the normed latent) as the
    layer's keys and k_rot (the rotated shared key) as its values; ours keeps their concatenation as the
    keys, at each row's own positions (left padding: row 1 starts later), and no value buffer: the
    kernel reads the values from the keys' first r numbers (c)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(2, 7, "left")
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 2, 10)
        patched(ids, attention_mask=mask, past_key_values=cache)
        for row in range(2):
            real = ids[row:row + 1, mask[row].bool()]
            hf_cache = DynamicCache(config=model.config)
            model(real, past_key_values=hf_cache)
            if hf_cache.layers[0].keys.shape[1] != 1:
                pytest.skip(f"transformers {transformers.__version__}'s {family} caches per-head keys and values, "
                            "not the latent")
            for i, layer in enumerate(cache.layers):
                n = real.shape[1]
                want = torch.cat([hf_cache.layers[i].keys, hf_cache.layers[i].values], dim=-1)[0, :, :n]
                torch.testing.assert_close(layer.keys[row, :, :n], want, atol=2e-5, rtol=1e-4)
    assert cache.geometry == ((1, R + DR, R),) * len(cache.layers)
    assert all(layer.value_dim == R and layer.values.numel() == 0 for layer in cache.layers)


def test_kv_b_proj_stays_float_and_is_not_applied_per_step(monkeypatch):
    """int8: every projection but kv_b_proj is Int8Linear; a decode step reads kv_b_proj's weight but
    never calls it (no expansion of the cache through it)."""
    patched = patched_copy(tiny_model("deepseek_v3"), int8=True)
    attention = patched.model.layers[0].self_attn
    assert type(attention.kv_b_proj) is torch.nn.Linear
    assert all(isinstance(getattr(attention, name), Int8Linear) for name in ("q_b_proj", "o_proj"))
    # the two projections of the layer's input are one int8 matmul
    assert attention.qkv_proj.sizes == [MLA_DIMS["q_lora_rank"], R + DR]
    calls = []
    for layer in patched.model.layers:
        monkeypatch.setattr(layer.self_attn.kv_b_proj, "forward", lambda x: calls.append(x.shape))
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 1, 8)
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
        patched(torch.tensor([[6]]), past_key_values=cache)
    assert calls == [] and cache.seq_lengths.tolist() == [4]


def test_unpatched_model_is_refused_the_cache():
    model = tiny_model("deepseek_v3")
    cache = StaticKVCache(model.config, 1, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"multi-head latent attention .* \(patch_model\)"):
        model(torch.tensor([[3, 4, 5]]), past_key_values=cache)
    assert cache.seq_lengths.tolist() == [0] and not cache.layers[0].keys.any()


def test_kv_b_proj_with_a_bias_is_refused():
    model = tiny_model("deepseek_v3")
    projection = model.model.layers[1].self_attn.kv_b_proj
    projection.bias = torch.nn.Parameter(torch.zeros(projection.out_features))
    with pytest.raises(ValueError, match="kv_b_proj must be a bias-free float nn.Linear"):
        patch_model(model, int8=False)
