"""Int8FusedProjections: patch_model turns the q / k / v projections of Llama / Mistral / Qwen2
attention into one int8 matmul (not when one is kept in float, not GPT-2's already fused c_attn);
each part equals its separate projection bit for bit, in any call order and for a new input, and
nothing stays alive after the last part."""

import pytest
import torch

from gptfast_kernels import Int8Linear
from gptfast_kernels.modules import Int8FusedProjections
from gptfast_kernels.modules.fused_qkv import PROJECTIONS, ProjectionPart
from python_tests.tiny_models import SEPARATE_PROJECTIONS, patched_copy, tiny_model


def _separate_projections(owner):
    """The three Int8Linear that ``owner`` fused, rebuilt from its stacked rows."""
    fused, parts, start = owner.fused, [], 0
    for size in owner.sizes:
        part = Int8Linear(fused.in_features, size, bias=fused.bias is not None)
        part.qweight.copy_(fused.qweight[start:start + size])
        part.scales.copy_(fused.scales[start:start + size])
        if fused.bias is not None:
            part.bias.copy_(fused.bias[start:start + size])
        parts.append(part)
        start += size
    return parts


@pytest.mark.parametrize("family", SEPARATE_PROJECTIONS)  # qwen2: q / k / v with biases
def test_patch_model_fuses_qkv_exactly(family):
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    owners = [m for m in patched.modules() if isinstance(m, Int8FusedProjections)]
    assert len(owners) == model.config.num_hidden_layers
    attention = patched.model.layers[0].self_attn
    assert all(isinstance(getattr(attention, name), ProjectionPart) for name in PROJECTIONS)
    separate = _separate_projections(attention.qkv_proj)
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        for order in ((0, 1, 2), (2, 0, 1)):  # transformers' order, and any other
            got = {i: getattr(attention, PROJECTIONS[i])(x) for i in order}
            for i in order:
                assert torch.equal(got[i], separate[i](x)), (order, i)
        # a new input between parts is computed afresh, not served from the last one
        q = attention.q_proj(x)
        y = torch.randn_like(x)
        assert torch.equal(attention.k_proj(y), separate[1](y)) and torch.equal(q, separate[0](x))
        attention.v_proj(y)
    assert attention.qkv_proj._parts is None and attention.qkv_proj._input is None


@pytest.mark.parametrize("family, sizes", [
    # Gemma 4's global layers have no v_proj (the keys are the values): q_proj and k_proj fuse; its shared
    # layers (q_proj alone) keep theirs
    ("gemma4_text", [[64, 32, 32], [128, 32], None, None]),
    ("gemma4_unified_text", [[64, 32, 32], [128, 32], None, None]),
    # Gemma 3n's layers all have q / k / v but for the shared ones (q_proj alone)
    ("gemma3n_text", [[64, 32, 32], [64, 32, 32], None, None]),
    # multi-head latent attention: the low-rank query's q_a_proj (or DeepSeek-V2's full q_proj, 4 heads x
    # 24) with kv_a_proj_with_mqa (latent 32 + rotary key 8)
    ("deepseek_v3", [[24, 40]] * 2), ("deepseek_v2", [[96, 40]] * 2)])
def test_other_projection_sets_fuse(family, sizes):
    """Attention modules whose input goes through other projections than q / k / v fuse those; the
    model's logits equal the unfused int8 model's."""
    model = tiny_model(family)
    patched, unfused = patched_copy(model, int8=True), patched_copy(model, int8=True)
    for module in unfused.modules():  # the same int8 weights, each projection on its own
        if hasattr(module, "qkv_proj"):
            separate = _separate_projections(module.qkv_proj)
            for name, child in list(module.named_children()):
                if isinstance(child, ProjectionPart):
                    setattr(module, name, separate[child.index])
            del module.qkv_proj
    layers = [layer.self_attn for layer in patched.model.layers]
    assert [attention.qkv_proj.sizes if hasattr(attention, "qkv_proj") else None for attention in layers] == sizes
    ids = torch.randint(2, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, unfused(ids).logits)


def test_weights_appear_once_in_the_state_dict():
    patched = patched_copy(tiny_model("llama"), int8=True)
    keys = patched.state_dict().keys()
    layers = patched.config.num_hidden_layers
    assert sum(k.endswith("self_attn.qkv_proj.fused.qweight") for k in keys) == layers
    assert not any(".q_proj." in k or ".k_proj." in k or ".v_proj." in k for k in keys)


def test_no_fusion_for_a_float_projection_or_gpt2():
    kept = patched_copy(tiny_model("llama"), int8=True, int8_skip=("lm_head", "k_proj"))
    assert not any(isinstance(m, Int8FusedProjections) for m in kept.modules())
    assert isinstance(kept.model.layers[0].self_attn.q_proj, Int8Linear)
    gpt2 = patched_copy(tiny_model("gpt2"), int8=True)
    assert not any(isinstance(m, Int8FusedProjections) for m in gpt2.modules())


def test_bad_sizes():
    with pytest.raises(ValueError, match="sizes"):
        Int8FusedProjections(Int8Linear(8, 12), [4, 4])
