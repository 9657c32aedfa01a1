"""BLOOM and MPT (models/bloom.py, models/mpt.py), beyond the family-wide tests: the configuration
options their transformers code reads (BLOOM's residual after the norm, MPT's clip and scale) and
the one it ignores (MPT's alibi_bias_max), their slopes kept in float32 whatever the model's dtype,
and a fused forward that raises ends its step (Family.fused_length_zero hides the cache's length
only while a step is open)."""

import pytest
import torch
from transformers.models.mpt.configuration_mpt import MptAttentionConfig

from gptfast_kernels import StaticKVCache, generate, patch_model
from gptfast_kernels.models import alibi
from python_tests.tiny_models import hf_greedy, patched_copy, ragged_prompts, tiny_model

TOL = dict(atol=2e-5, rtol=1e-4)


def _check_against_transformers(model):
    """Left-padded prompts in two forwards, logits of the real tokens, and greedy generation."""
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(2, 8, "left")
    cache = StaticKVCache(patched.config, 2, 16)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = torch.cat([patched(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache).logits,
                         patched(ids[:, 5:], attention_mask=mask, past_key_values=cache).logits], dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], **TOL)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[]).sequences,
                       hf_greedy(model, ids, mask, 6, eos_token_id=None))


@pytest.mark.parametrize("family, config", [
    ("bloom", dict(apply_residual_connection_post_layernorm=True)),
    ("mpt", dict(attn_config=MptAttentionConfig(clip_qkv=0.5, softmax_scale=0.2))),
    # transformers builds MPT's ALiBi with the default alibi_bias_max of 8 whatever the config says
    ("mpt", dict(attn_config=MptAttentionConfig(alibi_bias_max=4))),
], ids=["bloom-residual-post-norm", "mpt-clip-scale", "mpt-alibi-bias-max"])
def test_config_options_as_transformers_reads_them(family, config):
    _check_against_transformers(tiny_model(family, **config))


@pytest.mark.parametrize("family", ["bloom", "mpt"])
@pytest.mark.parametrize("cast_first", [False, True], ids=["patch-then-cast", "cast-then-patch"])
def test_slopes_stay_float32_through_a_cast(family, cast_first):
    model = tiny_model(family)
    want = [alibi.slopes_of(m).clone() for m in patch_model(tiny_model(family), int8=False).modules()
            if alibi.slopes_of(m) is not None]
    if cast_first:
        model.to(torch.bfloat16)
    patched = patch_model(model, int8=False).to(torch.bfloat16)
    got = [alibi.slopes_of(m) for m in patched.modules() if alibi.slopes_of(m) is not None]
    assert len(got) == len(want) == 2
    for slopes, expected in zip(got, want):
        assert slopes.dtype == torch.float32 and torch.equal(slopes, expected)
    assert not torch.equal(want[0], want[0].log2().round().exp2())  # (some slopes are no powers of two)


def test_a_forward_that_raises_ends_its_step():
    """BLOOM's fused steps hide the cache's length (get_seq_length() says 0 inside them): a forward
    that raises part-way must not leave it hidden, nor the step open."""
    patched = patched_copy(tiny_model("bloom"), int8=False)
    cache = StaticKVCache(patched.config, 1, 16)
    with torch.no_grad():
        patched(torch.tensor([[5, 6, 7, 8, 9, 10]]), past_key_values=cache)
    assert cache.get_seq_length() == 6

    def fail(module, args):
        raise RuntimeError("a failure inside the forward")

    handle = patched.transformer.h[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a failure inside the forward"), torch.no_grad():
        patched(torch.tensor([[11]]), past_key_values=cache)
    handle.remove()
    assert cache.get_seq_length() == 6 and cache._step_positions is None and not cache._fused_step
    with torch.no_grad():  # and the cache goes on from where it was
        patched(torch.tensor([[11]]), past_key_values=cache)
    assert cache.get_seq_length() == 7
