"""Llama 4 (models/llama4.py) on a tiny config: chunked attention reaches the kernel as its
chunk_size and decodes across chunk boundaries as transformers' mask does; NoPE layers scale each
row's queries by that row's own positions (test_patch.py's ragged-rows test); int8 experts run the
chosen (token, expert) rows alone on router-scaled inputs. The family-wide tests (test_patch.py,
generation/) cover the rest."""

import inspect

import pytest
import torch

import gptfast_kernels.models.attention as attention
from gptfast_kernels import StaticKVCache
from gptfast_kernels.models.llama4 import Int8Llama4Moe, query_temperature
from gptfast_kernels.modules.int8_experts import Int8Experts
from python_tests.tiny_models import CHUNK, dequantized_copy, patched_copy, stepwise_logits, tiny_model

TOL = dict(atol=2e-5, rtol=1e-4)


def _recording(monkeypatch):
    """Records the chunk_size of every kernel call the patched attention makes."""
    seen = []
    real = attention.run_kv_cache_attention

    def recording(*args):
        seen.append(inspect.signature(real).bind(*args).arguments.get("chunk_size"))
        return real(*args)

    monkeypatch.setattr(attention, "run_kv_cache_attention", recording)
    return seen


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_decoding_across_chunks_equals_transformers(fused, monkeypatch):
    """A prompt and 12 decode steps over 5 chunks of CHUNK tokens give transformers' logits (its
    chunked mask, its query temperature from position floor_scale - 1 on); the chunked layer's calls
    carry chunk_size, the full layer's none."""
    seen = _recording(monkeypatch)
    model = tiny_model("llama4_text")
    patched = patched_copy(model, int8=False, fused_attention=fused)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    ids = torch.randint(2, 90, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(stepwise_logits(patched, ids, StaticKVCache(patched.config, 2, 24), 6), want, **TOL)
    assert seen == [CHUNK, None] * 13


def test_chunks_no_shorter_than_the_cache_are_not_passed(monkeypatch):
    """Where no position of the cache can leave the first chunk, the kernel runs unchunked."""
    seen = _recording(monkeypatch)
    model = tiny_model("llama4_text", attention_chunk_size=16)
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = patched(ids, past_key_values=StaticKVCache(patched.config, 1, 16)).logits
        torch.testing.assert_close(got, model(ids).logits, **TOL)
        patched(ids, past_key_values=StaticKVCache(patched.config, 1, 17))
    assert seen == [None, None, 16, None]


def test_query_temperature_as_transformers_computes_it():
    """1 + attn_scale * log1p(floor((p + 1) / floor_scale)), padding (-1) as position 0."""
    positions = torch.tensor([[-1, 0, 2, 3, 7, 8190, 8191, 100000]])
    got = query_temperature(positions, 8192.0, 0.1)
    p = positions.clamp(min=0).double()
    want = 1 + 0.1 * torch.log1p(torch.floor((p + 1) / 8192))
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    assert got[0, :6].eq(1).all() and got[0, 6] > 1


def test_int8_experts_run_the_chosen_rows_on_scaled_inputs(monkeypatch):
    """Int8Llama4Moe replaces each MoE block: the router stays float, its experts run one row per
    (token, chosen expert) through int8_expert_linear (not every expert on every token, as
    transformers' dense block does), and the result equals transformers' block with the int8-rounded
    expert weights."""
    import gptfast_kernels.modules.int8_experts as int8_experts

    model = tiny_model("llama4_text")
    patched = patched_copy(model, int8=True)
    blocks = [m for m in patched.modules() if isinstance(m, Int8Llama4Moe)]
    assert len(blocks) == 1 and not any(type(m).__name__ == "Llama4TextMoe" for m in patched.modules())
    block, original = blocks[0], model.model.layers[1].feed_forward
    assert isinstance(block.experts, Int8Experts) and type(block.router).__name__ == "Llama4Router"
    assert torch.equal(block.router.weight, original.router.weight)
    rows = []
    real = int8_experts.int8_expert_linear
    monkeypatch.setattr(int8_experts, "int8_expert_linear",
                        lambda x, *args, **kwargs: rows.append(x.shape[0]) or real(x, *args, **kwargs))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    rounded = dequantized_copy(model).model.layers[1].feed_forward
    rounded.shared_expert = block.shared_expert  # (int8 as patched: compared on its own elsewhere)
    with torch.no_grad():
        got, logits = block(x)
        want, want_logits = rounded(x)
    assert rows == [5 * model.config.num_experts_per_tok] * 2  # gate / up, then down
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_text_model_of_a_multimodal_checkpoint_patches(tmp_path):
    """Meta's Llama 4 checkpoints are the multimodal model: AutoModelForCausalLM loads its text model
    (a local checkpoint here, never a hub), which patches and decodes as the multimodal model's
    language model; the multimodal model itself is refused with a message saying what to load."""
    from transformers import AutoModelForCausalLM, Llama4Config, Llama4ForConditionalGeneration

    from gptfast_kernels import generate, patch_model
    from python_tests.tiny_models import tiny_config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    torch.manual_seed(0)
    multimodal = Llama4ForConditionalGeneration(Llama4Config(text_config=tiny_config("llama4_text").to_dict(),
                                                             vision_config=vision)).eval()
    with pytest.raises(ValueError, match="text-only causal language models.*llama4_text"):
        patch_model(multimodal)
    multimodal.save_pretrained(tmp_path)
    text = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(text).__name__ == "Llama4ForCausalLM"
    ids = torch.randint(2, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    # the multimodal model's greedy decoding of text by its language model (a Llama4ForCausalLM), a token at
    # a time: its own generate and forward fail in transformers 5.24 (they read image_outputs from the
    # language model's output, which has none)
    want = ids
    with torch.no_grad():
        for _ in range(6):
            logits = multimodal.language_model(want).logits[:, -1]
            want = torch.cat([want, logits.argmax(-1, keepdim=True)], dim=1)
    got = generate(patch_model(text, int8=False), ids, max_new_tokens=6, eos_token_id=[]).sequences
    assert torch.equal(got, want)
