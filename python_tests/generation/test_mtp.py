"""speculative_generate with a model's own multi-token-prediction layer (transformers' MtpModel) as
the draft: every round's drafts, for every row of a ragged batch, equal those transformers' MtpModel
computes from that row's text alone (its first draft from the target's hidden states, later ones
with the layer reused on its own output); greedy output equals the target's own; sampled output
follows the target's distribution; bad drafters are refused."""

import copy

import pytest
import torch

from gptfast_kernels import generate, patch_model, speculative_generate
from gptfast_kernels.generation import mtp as mtp_module
from python_tests.generation.test_speculative import (ONE_CALL_DRAFTING, assert_compiled_rounds_draft_in_one_call,
                                                     assert_compiled_rounds_equal_eager,
                                                     assert_drafter_keeps_the_target_distribution,
                                                     assert_every_rounds_drafts, record_proposals)
from python_tests.tiny_models import draw_zero_initialised_, ragged_prompts, tiny_model

MtpModel = pytest.importorskip("transformers.modeling_layers").__dict__.get("MtpModel")
if MtpModel is None:
    pytest.skip("this transformers has no MtpModel", allow_module_level=True)

# the supported families whose configs have MTP layers (DeepSeek-V3's code: Sarvam-MLA too; GLM-4-MoE's: Sarvam-MoE;
# Mellum's is a sliding-window layer). tiny_config sets num_mtp_layers after building the config, too late for
# Mellum's config to derive its MTP layer's types from it: they are given
FAMILIES = ["deepseek_v3", "glm4_moe", "sarvam_mla", "sarvam_moe", "mellum"]
MTP_OPTIONS = {"mellum": dict(mtp_layer_types=["sliding_attention"], mtp_mlp_layer_types=["sparse"])}
# a small vocabulary: the untrained MTP layer's drafts are then accepted now and then, so the rows of a round
# accept different numbers of drafts (0 to k)
VOCAB = 4
NEW = 16


def _drawn(mtp):
    """``mtp`` with its layer's weights drawn. transformers' MtpModel(model, n) leaves a MoE MTP
    layer's experts (3-D gate_up_proj / down_proj) as torch.empty allocated them, for a checkpoint to
    fill (MtpModel.from_pretrained): whatever that memory held (NaN, after some other tests) drafted
    otherwise. Its router, zero, would send every token to the same experts."""
    with torch.no_grad():
        for weight in mtp.layers.parameters():
            if weight.dim() >= 2:
                weight.normal_(0.0, mtp.config.initializer_range)
    return draw_zero_initialised_(mtp)


def _with_mtp(family, *, int8=False, vocab=VOCAB, seed=0):
    """(target, its MtpModel) as transformers builds them, and a patched copy of the two (the MtpModel
    shares the target's embedding and output head, as MtpModel.from_pretrained ties them)."""
    model = tiny_model(family, layers=2, vocab=vocab, seed=seed, num_mtp_layers=1, **MTP_OPTIONS.get(family, {}))
    torch.manual_seed(seed + 1)
    mtp = _drawn(MtpModel(model, 1).eval())
    patched, patched_mtp = copy.deepcopy((model, mtp))
    patch_model(patched, int8=int8)
    patch_model(patched_mtp, int8=int8)
    return model, mtp, patched, patched_mtp


def _transformers_drafts(model, mtp, text: torch.Tensor, k: int) -> list[int]:
    """The k drafts after ``text`` [n + 1] (its last token: the target's last emitted one), from
    transformers' modules: the MTP layer over every pair (hidden state at j, token j + 1) of the
    text, then on its own output state and each draft."""
    from transformers.cache_utils import MtpCache

    with torch.no_grad():
        hidden = model(text[None, :-1], output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=mtp.config)
        n = text.shape[0] - 1
        state = mtp.forward_layer(0, hidden, torch.arange(1, n + 1)[None], cache, input_ids=text[None, 1:])[:, -1:]
        drafts = []
        for i in range(k):
            drafts.append(int(mtp._project_to_logits(state)[0, -1].argmax()))
            if i < k - 1:
                state = mtp.forward_layer(0, state, torch.tensor([[n + 1 + i]]), cache,
                                          input_ids=torch.tensor([[drafts[-1]]]))
    return drafts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_every_rounds_drafts_equal_transformers(family, side, monkeypatch):
    if not hasattr(MtpModel, "forward_layer"):
        pytest.skip("this transformers' MtpModel has no forward_layer")
    ids, mask = ragged_prompts(3, 7, side, vocab=VOCAB)
    model, mtp, patched, patched_mtp = _with_mtp(family)
    k = 3
    rounds = record_proposals(monkeypatch, mtp_module.MtpProposer)
    out = speculative_generate(patched, patched_mtp, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[])
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    assert torch.equal(out.sequences, want)
    assert_every_rounds_drafts(rounds, ids, mask, lambda text: _transformers_drafts(model, mtp, text, k))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("batch, k", [(1, 1), (4, 2), (4, 5)])
def test_greedy_equals_target_greedy_int8(family, batch, k):
    _, _, patched, patched_mtp = _with_mtp(family, int8=True, vocab=97)
    ids, mask = ragged_prompts(batch, 9, "left")
    want = generate(patched, ids, mask, max_new_tokens=14, eos_token_id=[]).sequences
    out = speculative_generate(patched, patched_mtp, ids, mask, max_new_tokens=14, speculate_k=k, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert torch.equal(out.num_proposed.clamp(max=1), torch.ones(batch, dtype=torch.int64))


def test_compiled_rounds_give_the_same_tokens():
    _, _, patched, patched_mtp = _with_mtp("glm4_moe", int8=True)
    assert_compiled_rounds_equal_eager(patched, patched_mtp, ragged_prompts(2, 6, "left", vocab=VOCAB))


@pytest.mark.parametrize("drafting", ONE_CALL_DRAFTING)
def test_compiled_rounds_draft_in_one_call(drafting, monkeypatch):
    _, _, patched, patched_mtp = _with_mtp("glm4_moe", int8=True)
    assert_compiled_rounds_draft_in_one_call(monkeypatch, patched, patched_mtp,
                                             ragged_prompts(2, 6, "left", vocab=VOCAB), drafting, "_mtp_drafts")


def test_sampling_follows_the_target_distribution():
    """As test_speculative's chi-square test, with the MTP layer drafting."""
    _, _, patched, patched_mtp = _with_mtp("deepseek_v3", int8=True, vocab=6, seed=1)
    assert_drafter_keeps_the_target_distribution(patched, patched_mtp, 6)


def test_bad_drafters_are_refused():
    model, mtp, patched, patched_mtp = _with_mtp("deepseek_v3")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="draft_model is not patched"):
        speculative_generate(patched, mtp, ids, max_new_tokens=4)
    two = patch_model(MtpModel(copy.deepcopy(model), 2).eval(), int8=False)
    with pytest.raises(ValueError, match="draft_model is an MtpModel with 2 MTP layers"):
        speculative_generate(patched, two, ids, max_new_tokens=4)
    other = tiny_model("deepseek_v3", layers=2, vocab=VOCAB, hidden_size=48, num_mtp_layers=1)
    foreign = patch_model(MtpModel(other, 1).eval(), int8=False)
    with pytest.raises(ValueError, match="draft_model .an MtpModel. has hidden_size 48"):
        speculative_generate(patched, foreign, ids, max_new_tokens=4)
    # another dtype: a RuntimeError from inside the layer's first matmul (bfloat16), or the cache's
    # message naming neither the call nor the argument (float64)
    with pytest.raises(ValueError, match="draft_model .an MtpModel. is torch.bfloat16 but model is torch.float32"):
        speculative_generate(patched, copy.deepcopy(patched_mtp).to(torch.bfloat16), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="speculative_generate: draft_model is torch.float64"):
        speculative_generate(patched, copy.deepcopy(patched_mtp).double(), ids, max_new_tokens=4)
    # the MtpModel as the target: a TypeError from its forward (it takes the target's hidden states)
    for run in (lambda: speculative_generate(patched_mtp, patched, ids, max_new_tokens=4),
                lambda: generate(patched_mtp, ids, max_new_tokens=4)):
        with pytest.raises(ValueError, match="model is MtpModel, a draft that reads another model"):
            run()
