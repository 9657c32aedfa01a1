"""Multi-head latent attention (DeepSeek-V2 / V3 and the families on their code), absorbed: the
cache holds one latent per token (what transformers' own cache holds, side by side) and no value
buffer, kv_b_proj is never applied to the cache (with int8 its per-head weights run as
int8_expert_linear, equal to the float absorption of its rounded weight), an unpatched model is
refused the cache, bad modules are refused. Logits, generation, compilation and int8 per family are
in the family-wide tests."""

import pytest
import torch
import transformers
from transformers import DynamicCache

from gptfast_kernels import Int8Linear, StaticKVCache, patch_model
from python_tests.tiny_models import HYBRID, LATENT, MLA_DIMS, patched_copy, ragged_prompts, tiny_model

R, DR = MLA_DIMS["kv_lora_rank"], MLA_DIMS["qk_rope_head_dim"]


@pytest.mark.parametrize("family", LATENT)
def test_cache_holds_the_latent_transformers_caches(family):
    """Per token one row [c, k_rot]: transformers' DynamicCache keeps c (the normed latent) as the
    layer's keys and k_rot (the rotated shared key) as its values; ours keeps their concatenation as the
    keys, at each row's own positions (left padding: row 1 starts later), and no value buffer: the
    kernel reads the values from the keys' first r numbers (c). (Kimi Linear's layers 0 and 2 are
    linear attention: recurrent states, no latents.)"""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(2, 7, "left")
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 2, 10)
        patched(ids, attention_mask=mask, past_key_values=cache)
        latent = [i for i, layer in enumerate(cache.layers) if any(layer is a for a in cache.attention_layers)]
        assert latent == ([1] if family in HYBRID else list(range(len(cache.layers))))
        for row in range(2):
            real = ids[row:row + 1, mask[row].bool()]
            hf_cache = DynamicCache(config=model.config)
            model(real, past_key_values=hf_cache)
            if hf_cache.layers[latent[0]].keys.shape[1] != 1:
                pytest.skip(f"transformers {transformers.__version__}'s {family} caches per-head keys and values, "
                            "not the latent")
            for i in latent:
                n = real.shape[1]
                want = torch.cat([hf_cache.layers[i].keys, hf_cache.layers[i].values], dim=-1)[0, :, :n]
                torch.testing.assert_close(cache.layers[i].keys[row, :, :n], want, atol=2e-5, rtol=1e-4)
    assert [cache.geometry[i] for i in latent] == [(1, R + DR, R)] * len(latent)
    assert all(layer.value_dim == R and layer.values.numel() == 0 for layer in cache.attention_layers)


def test_kv_b_proj_is_int8_per_head_and_not_applied_per_step(monkeypatch):
    """int8: every projection is Int8Linear, kv_b_proj included; a step never calls kv_b_proj (no
    expansion of the cache through it): its per-head int8 weights go through int8_expert_linear, the
    head as the expert, twice per layer (the query's W_k, the output's W_v), each row with its head."""
    from gptfast_kernels.models import latent_attention

    patched = patched_copy(tiny_model("deepseek_v3"), int8=True)
    attention = patched.model.layers[0].self_attn
    assert all(isinstance(getattr(attention, name), Int8Linear) for name in ("q_b_proj", "o_proj", "kv_b_proj"))
    # the two projections of the layer's input are one int8 matmul
    assert attention.qkv_proj.sizes == [MLA_DIMS["q_lora_rank"], R + DR]
    H, dn, dv = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
    assert attention._gptfast_wk_t.shape == (H, R, dn) and attention._gptfast_wv.shape == (H, dv, R)
    assert "_gptfast_wk_t" not in attention.state_dict()
    calls, per_head = [], []
    for layer in patched.model.layers:
        monkeypatch.setattr(layer.self_attn.kv_b_proj, "forward", lambda x: calls.append(x.shape))
    real = latent_attention.int8_expert_linear

    def recording(x, qweight, scales, experts, **kwargs):
        per_head.append((x.shape[0], qweight.shape, experts.tolist()))
        return real(x, qweight, scales, experts, **kwargs)

    monkeypatch.setattr(latent_attention, "int8_expert_linear", recording)
    with torch.no_grad():
        cache = StaticKVCache(patched.config, 1, 8)
        patched(torch.tensor([[3, 4, 5]]), past_key_values=cache)
        patched(torch.tensor([[6]]), past_key_values=cache)
    assert calls == [] and cache.seq_lengths.tolist() == [4]
    layers = len(patched.model.layers)
    assert len(per_head) == 2 * 2 * layers  # 2 forwards x (W_k, W_v) per layer
    # the prompt's query: rows (token, head) in [B, T, H] order, each with its head's weight
    rows, shape, experts = per_head[0]
    assert rows == 3 * H and shape == (H, R, dn) and experts == list(range(H)) * 3
    rows, shape, experts = per_head[2 * layers + 1]  # the decode step's first W_v
    assert rows == H and shape == (H, dv, R) and experts == list(range(H))


def test_int8_absorption_equals_the_dequantized_kv_b_proj():
    """The int8 absorbed products are the float ones with kv_b_proj's int8-rounded weight: one
    patched forward with int8 kv_b_proj against the same model whose kv_b_proj is the rounded float
    weight (everything else identical, float)."""
    from gptfast_kernels.modules.int8_linear import Int8Linear as I8

    model = tiny_model("deepseek_v3")
    floating = patched_copy(model, int8=False)
    int8 = patched_copy(model, int8=False)
    for f_layer, i_layer in zip(floating.model.layers, int8.model.layers):
        quantized = I8.from_float(i_layer.self_attn.kv_b_proj)
        i_layer.self_attn.kv_b_proj = quantized
        f_layer.self_attn.kv_b_proj.weight.data = quantized.qweight.float() * quantized.scales[:, None]
    from gptfast_kernels.models.latent_attention import patch_latent_attention_

    patch_latent_attention_(int8, type(int8.model.layers[0].self_attn).__name__, "cos_sin")
    ids, mask = ragged_prompts(2, 7, "left")
    with torch.no_grad():
        want = floating(ids, attention_mask=mask, past_key_values=StaticKVCache(floating.config, 2, 10)).logits
        got = int8(ids, attention_mask=mask, past_key_values=StaticKVCache(int8.config, 2, 10)).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


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
    with pytest.raises(ValueError, match="kv_b_proj must be a bias-free nn.Linear"):
        patch_model(model, int8=False)
