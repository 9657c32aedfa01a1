"""Int8Linear.concat and Int8GatedMLP: the fused gate / up matmul equals the two separate ones, patch_model fuses every gated MLP of Llama / Mistral / Qwen2 (not GPT-2's, not a projection
kept in float), and bad inputs raise."""

import pytest
import torch
from torch import nn

from gptfast_kernels import Int8Linear
from gptfast_kernels.modules import Int8GatedMLP
from python_tests.tiny_models import SEPARATE_PROJECTIONS, patched_copy, tiny_model


def _int8(in_features, out_features, bias=False, seed=0):
    torch.manual_seed(seed)
    return Int8Linear.from_float(nn.Linear(in_features, out_features, bias=bias))


@pytest.mark.parametrize("bias", [False, True])
def test_concat_is_the_separate_outputs(bias):
    parts = [_int8(40, 24, bias, seed=1), _int8(40, 8, bias, seed=2), _int8(40, 17, bias, seed=3)]
    fused = Int8Linear.concat(parts)
    assert (fused.in_features, fused.out_features) == (40, 49)
    for rows in (1, 5):  # the decode (GEMV) path sums every output channel on its own: same bits
        x = torch.randn(rows, 40)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    x = torch.randn(33, 40)  # the GEMM path: the library may block the wider matrix differently
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), atol=1e-6, rtol=1e-6)


def test_concat_bad_inputs():
    with pytest.raises(TypeError, match="modules"):
        Int8Linear.concat([])
    with pytest.raises(TypeError, match="modules"):
        Int8Linear.concat([nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="in_features"):
        Int8Linear.concat([_int8(4, 4), _int8(5, 4)])
    with pytest.raises(ValueError, match="bias"):
        Int8Linear.concat([_int8(4, 4, bias=True), _int8(4, 4)])


@pytest.mark.parametrize("family", SEPARATE_PROJECTIONS)
def test_patch_model_fuses_gated_mlps_exactly(family):
    model = tiny_model(family)
    unfused = patched_copy(model, int8=True)
    fused_count = sum(isinstance(m, Int8GatedMLP) for m in unfused.modules())
    assert fused_count == model.config.num_hidden_layers
    mlp = next(m for m in unfused.modules() if isinstance(m, Int8GatedMLP))
    assert not hasattr(mlp, "gate_proj") and isinstance(mlp.down_proj, Int8Linear)
    # the same MLP with its two int8 projections kept apart gives the same bits
    original = model.model.layers[0].mlp
    halves = mlp.gate_up_proj.qweight.chunk(2), mlp.gate_up_proj.scales.chunk(2)
    gate, up = (Int8Linear(mlp.gate_up_proj.in_features, mlp.intermediate_size, bias=False) for _ in range(2))
    for module, qweight, scales in zip((gate, up), halves[0], halves[1]):
        module.qweight.copy_(qweight)
        module.scales.copy_(scales)
    x = torch.randn(3, 5, model.config.hidden_size)
    layer0 = unfused.model.layers[0].mlp
    with torch.no_grad():
        want = layer0.down_proj(original.act_fn(gate(x)) * up(x))
        assert torch.equal(layer0(x), want)


def test_no_fusion_for_a_float_projection_or_gpt2():
    model = tiny_model("llama")
    kept = patched_copy(model, int8=True, int8_skip=("lm_head", "gate_proj"))
    assert not any(isinstance(m, Int8GatedMLP) for m in kept.modules())
    assert isinstance(kept.model.layers[0].mlp.up_proj, Int8Linear)
    gpt2 = patched_copy(tiny_model("gpt2"), int8=True)
    assert not any(isinstance(m, Int8GatedMLP) for m in gpt2.modules())


def test_patching_twice_keeps_one_fusion():
    from gptfast_kernels import patch_model

    model = patched_copy(tiny_model("llama"), int8=True)
    patch_model(model, int8=True)
    assert sum(isinstance(m, Int8GatedMLP) for m in model.modules()) == model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gaussian_top_k_is_transformers_activation_sparsity(dtype):
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    from gptfast_kernels.modules.gated_mlp import GaussianTopK
    from python_tests.tiny_models import tiny_config

    mlp = Gemma3nTextMLP(tiny_config("gemma3n_text"), layer_idx=0)
    assert mlp.activation_sparsity == 0.9
    x = torch.randn(3, 7, 128, dtype=dtype)
    sparse = GaussianTopK(0.9)(x)
    assert torch.equal(sparse, mlp._gaussian_topk(x))
    # about 90 % of a Gaussian row falls under the cutoff
    assert 0.8 < (sparse == 0).float().mean() < 0.97
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="sparsity"):
            GaussianTopK(bad)


def test_gemma3n_sparse_layers_fuse_with_their_gate_sparsified():
    model = tiny_model("gemma3n_text")
    patched = patched_copy(model, int8=True)
    mlps = [layer.mlp for layer in patched.model.layers]
    assert all(isinstance(mlp, Int8GatedMLP) for mlp in mlps)
    # the tiny config's first half sparsifies (0.9), the rest not
    assert [mlp.sparsify.sparsity if mlp.sparsify is not None else None for mlp in mlps] == [0.9, 0.9, None, None]
    # AltUp's router and coefficient maps stay float (the family's float_linears), LAuReL's go int8
    altup = patched.model.layers[0].altup
    assert all(type(altup.get_submodule(name)) is nn.Linear
               for name in ("modality_router", "prediction_coefs", "correction_coefs"))
    assert isinstance(patched.model.layers[0].laurel.linear_left, Int8Linear)
    for index in (0, 2):
        fused, original = mlps[index], model.model.layers[index].mlp
        # transformers' MLP running the fused module's int8 halves gives the same bits
        _run_on_the_fused_halves_(original, fused)
        x = torch.randn(2, 5, model.config.hidden_size)
        with torch.no_grad():
            assert torch.equal(fused(x), original(x))


def _run_on_the_fused_halves_(original, fused):
    """Gives transformers' MLP ``original`` the int8 gate / up halves and the down projection of
    ``fused`` (an Int8GatedMLP), in place."""
    halves = fused.gate_up_proj.qweight.chunk(2), fused.gate_up_proj.scales.chunk(2)
    for name, qweight, scales in zip(("gate_proj", "up_proj"), halves[0], halves[1]):
        part = Int8Linear(fused.gate_up_proj.in_features, fused.intermediate_size, bias=False)
        part.qweight.copy_(qweight)
        part.scales.copy_(scales)
        setattr(original, name, part.to(fused.gate_up_proj.scales.device))
    original.down_proj = fused.down_proj


def test_beam_mlps_fuse_with_their_activation_in_float32():
    model = tiny_model("beam").to(torch.bfloat16)
    patched = patched_copy(model, int8=True)
    fused, original = patched.model.layers[0].mlp, model.model.layers[0].mlp  # (layer 0: dense)
    assert isinstance(fused, Int8GatedMLP) and fused.float32_activation
    _run_on_the_fused_halves_(original, fused)
    x = torch.randn(2, 7, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused(x), original(x))
        # (the activation in bfloat16 rounds differently: the float32 path is what makes them equal)
        fused.float32_activation = False
        assert not torch.equal(fused(x), original(x))
