"""Int8Linear and quantize_int8_ on nn.Linear, GPT-2 Conv1D and tiny HF models built from configs."""

import pytest
import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from gptfast_kernels import Int8Linear, quantize_int8_
from gptfast_kernels.ops import reference


def test_from_linear_matches_dequantised_weights():
    linear = nn.Linear(48, 20)
    layer = Int8Linear.from_float(linear)
    qweight, scales = reference.quantize_int8(linear.weight.detach())
    assert torch.equal(layer.qweight, qweight) and torch.equal(layer.scales, scales)
    x = torch.randn(3, 48)
    expected = x @ (qweight.float() * scales[:, None]).T + linear.bias.detach()
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    # and stays within the quantisation error of the float layer
    assert (layer(x) - linear(x)).abs().max() < 0.05


def test_from_conv1d_transposes_gpt2_layout():
    conv = Conv1D(nf=24, nx=40)  # weight [in=40, out=24]
    nn.init.normal_(conv.weight, std=0.1)
    layer = Int8Linear.from_float(conv)
    assert layer.qweight.shape == (24, 40)
    x = torch.randn(2, 5, 40)
    torch.testing.assert_close(layer(x), conv(x), atol=0.03, rtol=0.02)


def test_from_float_rejects_other_modules():
    with pytest.raises(TypeError, match="module"):
        Int8Linear.from_float(nn.Conv2d(3, 3, 1))


@pytest.mark.parametrize("in_features, out_features", [(0, 4), (4, 0), (-1, 4), (4.0, 4), (True, 4)])
def test_sizes_must_be_positive_ints(in_features, out_features):
    # (Int8Linear(0, 4) divided by zero on its first call)
    with pytest.raises(ValueError, match="in_features|out_features"):
        Int8Linear(in_features, out_features)


def test_quantize_skip_patterns():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module("lm_head", nn.Linear(8, 4))
    quantize_int8_(model)
    assert isinstance(model.proj, Int8Linear) and isinstance(model.lm_head, nn.Linear)
    model2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    quantize_int8_(model2, skip=("1",))
    assert isinstance(model2[0], Int8Linear) and isinstance(model2[1], nn.Linear)


class _Router(nn.Linear):
    """An nn.Linear subclass with a forward of its own (as PhiMoE's router): more than a matmul."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1).indices


class _RenamedLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward: a plain matmul under another name."""


def test_linear_subclasses_with_a_forward_of_their_own_stay_float():
    model = nn.Sequential()
    model.add_module("router", _Router(8, 4))
    model.add_module("proj", _RenamedLinear(8, 8))
    quantize_int8_(model)
    assert type(model.router) is _Router and isinstance(model.proj, Int8Linear)
    with pytest.raises(TypeError, match="_Router .* forward of its own"):
        Int8Linear.from_float(_Router(8, 4))


class _HeadNamedOtherwise(nn.Module):
    """A model whose output head is not called lm_head (GPT-NeoX's embed_out before transformers 5.14)."""

    def __init__(self):
        super().__init__()
        self.proj, self.embed_out = nn.Linear(8, 8), nn.Linear(8, 4)

    def get_output_embeddings(self):
        return self.embed_out


def test_lm_head_pattern_names_the_output_head_whatever_its_name():
    model = quantize_int8_(_HeadNamedOtherwise())
    assert isinstance(model.proj, Int8Linear) and type(model.embed_out) is nn.Linear
    model = quantize_int8_(_HeadNamedOtherwise(), skip=())
    assert isinstance(model.embed_out, Int8Linear)
    model = quantize_int8_(_HeadNamedOtherwise(), skip=("lm_*",))  # patterns match the head's alias too
    assert type(model.embed_out) is nn.Linear


TINY = {
    "gpt2": GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    "llama": LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_quantized_tiny_model_logits_close(family):
    model = AutoModelForCausalLM.from_config(TINY[family]).eval()
    input_ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        float_logits = model(input_ids).logits
        quantize_int8_(model)
        n_int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
        int8_logits = model(input_ids).logits
    assert n_int8 >= 2 * 4  # at least the attention and MLP projections of both layers
    assert not any(type(m) is nn.Linear for name, m in model.named_modules()
                   if not name.endswith("lm_head"))
    rel = (int8_logits - float_logits).norm() / float_logits.norm()
    assert rel < 0.02, f"int8 logits deviate by {rel:.4f} (relative L2)"
    assert (int8_logits.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.9
