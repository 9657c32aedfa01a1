"""speculative_generate with a Gemma 4 assistant as the draft: every round's drafts, for every row
of a ragged batch, equal those transformers' assistant computes from that row's text alone (over
the keys and values transformers' target returns for it); greedy output equals the target's own;
sampled output follows the target's distribution; bad assistants are refused."""

import copy

import pytest
import torch

from gptfast_kernels import Int8Linear, generate, patch_model, quantize_int8_, speculative_generate
from gptfast_kernels.generation import assistant as assistant_module
from gptfast_kernels.generation import forward
from python_tests.generation.test_speculative import (ONE_CALL_DRAFTING, assert_compiled_rounds_draft_in_one_call,
                                                     assert_compiled_rounds_equal_eager,
                                                     assert_drafter_keeps_the_target_distribution,
                                                     assert_every_rounds_drafts, record_proposals)
from python_tests.tiny_models import draw_zero_initialised_, ragged_prompts, tiny_model

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4AssistantForCausalLM"):
    pytest.skip("this transformers has no Gemma 4 assistant", allow_module_level=True)

# a small vocabulary: the untrained assistant's drafts are then accepted now and then
VOCAB = 5
NEW = 16


def _assistant_for(target, *, ordered: bool = False, seed: int = 5, layer_types=("sliding_attention", "full_attention"),
                   **overrides):
    """A Gemma 4 assistant for ``target`` (tiny_model's gemma4_text / gemma4_unified_text: sliding layers
    of 2 kv heads of 16, global ones of 1 kv head of 32, keys as values; a unified target gets the
    unified assistant), its weights drawn; ``ordered``: the centroid head."""
    config = target.config
    prefix = "Gemma4Unified" if config.model_type == "gemma4_unified_text" else "Gemma4"
    text_config_class = getattr(transformers, f"{prefix}TextConfig")
    assistant_config_class = getattr(transformers, f"{prefix}AssistantConfig")
    assistant_class = getattr(transformers, f"{prefix}AssistantForCausalLM")
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=config.sliding_window, layer_types=list(layer_types),
                vocab_size=config.vocab_size, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                max_position_embeddings=256, num_kv_shared_layers=len(layer_types),
                pad_token_id=config.pad_token_id, initializer_range=config.initializer_range)
    text.update(overrides)
    options = dict(use_ordered_embeddings=True, num_centroids=config.vocab_size, centroid_intermediate_top_k=2) \
        if ordered else {}
    assistant_config = assistant_config_class(text_config=text_config_class(**text),
                                              backbone_hidden_size=config.hidden_size, **options)
    torch.manual_seed(seed)
    try:
        assistant = assistant_class(assistant_config).eval()
    except ValueError as error:  # (transformers 5.23's config cannot share every layer, as an assistant does)
        if "layer types producing a cache" not in str(error):
            raise
        pytest.skip(f"this transformers cannot build a Gemma 4 assistant: {error}")
    draw_zero_initialised_(assistant)
    if ordered:  # (its token order, zero as built, is a checkpoint's: a permutation)
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(config.vocab_size))
    return assistant


def _target(family="gemma4_unified_text", vocab=VOCAB, seed=0):
    model = tiny_model(family, layers=4, vocab=vocab, seed=seed)
    return model, patch_model(copy.deepcopy(model), int8=False)


def _transformers_drafts(model, assistant, text: torch.Tensor, k: int) -> list[int]:
    """The k greedy drafts after ``text`` [n + 1] (its last token: the target's last emitted one),
    from transformers' modules: the target over text[:-1] (its last hidden state and the keys and
    values it shares), then the assistant k times at position n, as its candidate generator runs it."""
    with torch.no_grad():
        out = model(text[None, :-1], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        hidden, shared = out.hidden_states[-1][:, -1:], dict(out.shared_kv_states)
        token, n = text[None, -1:], text.shape[0] - 1
        drafts = []
        for _ in range(k):
            embeds = torch.cat([model.get_input_embeddings()(token), hidden], dim=-1)
            step = assistant(inputs_embeds=embeds, position_ids=torch.tensor([[n]]), shared_kv_states=shared)
            token, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
            drafts.append(int(token))
    return drafts


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("ordered", [False, True], ids=["head", "centroids"])
@pytest.mark.parametrize("ring", [False, True], ids=["full-buffers", "ring-buffers"])
def test_every_rounds_drafts_equal_transformers(family, side, ordered, ring, monkeypatch):
    """Prompts and outputs longer than the window (4), so the sliding layers' window cuts; with
    ``ring`` the target's sliding layers are ring buffers (prefill chunks of 5 tokens: 8 slots)."""
    if ring:
        monkeypatch.setattr(forward, "PREFILL_CHUNK", 5)
    model, patched = _target(family)
    assistant = _assistant_for(model, ordered=ordered)
    ids, mask = ragged_prompts(3, 9, side, vocab=VOCAB)
    k = 3
    rounds = record_proposals(monkeypatch, assistant_module.AssistantProposer)
    out = speculative_generate(patched, assistant, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[])
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    assert torch.equal(out.sequences, want)
    assert all(proposer.cache.has_ring_layers == ring for *_, proposer in rounds)
    reference = lambda text: _transformers_drafts(model, assistant, text, k)  # noqa: E731
    assert assert_every_rounds_drafts(rounds, ids, mask, reference) >= 3 * 4
    assert 0 < int(out.num_accepted.sum()) < int(out.num_proposed.sum())


@pytest.mark.parametrize("batch, k, ordered", [(1, 1, False), (4, 2, True), (4, 5, False)])
def test_greedy_equals_target_greedy_int8(batch, k, ordered):
    """An int8 target, and an assistant with int8 linear layers (quantize_int8_; the output head,
    which the centroid head reads, stays float)."""
    model = tiny_model("gemma4_text", layers=4, vocab=97)
    patched = patch_model(copy.deepcopy(model), int8=True)
    assistant = quantize_int8_(_assistant_for(model, ordered=ordered))
    assert isinstance(assistant.pre_projection, Int8Linear) and not isinstance(assistant.lm_head, Int8Linear)
    ids, mask = ragged_prompts(batch, 9, "left")
    want = generate(patched, ids, mask, max_new_tokens=14, eos_token_id=[]).sequences
    out = speculative_generate(patched, assistant, ids, mask, max_new_tokens=14, speculate_k=k, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert torch.equal(out.num_proposed.clamp(max=1), torch.ones(batch, dtype=torch.int64))


@pytest.mark.parametrize("ordered", [False, True], ids=["head", "centroids"])
def test_compiled_rounds_give_the_same_tokens(ordered):
    model, patched = _target()
    assert_compiled_rounds_equal_eager(patched, _assistant_for(model, ordered=ordered),
                                       ragged_prompts(2, 6, "left", vocab=VOCAB))


@pytest.mark.parametrize("drafting", ONE_CALL_DRAFTING)
def test_compiled_rounds_draft_in_one_call(drafting, monkeypatch):
    model, patched = _target()
    assert_compiled_rounds_draft_in_one_call(monkeypatch, patched, _assistant_for(model),
                                             ragged_prompts(2, 6, "left", vocab=VOCAB), drafting, "_assistant_drafts")


def test_sampling_follows_the_target_distribution():
    """As test_speculative's chi-square test, with the assistant drafting (its centroid head: every
    token has a probability, those of the clusters it does not choose a small one)."""
    model, patched = _target(vocab=6, seed=1)
    assert_drafter_keeps_the_target_distribution(patched, _assistant_for(model, ordered=True), 6)


def test_centroid_logits_equal_transformers_per_row():
    """ordered_logits for one row equals transformers' masked embedder; in a batch, each row's
    logits are its own (transformers' floor, the batch's lowest score, would mix rows)."""
    model, _ = _target(vocab=12)
    assistant = _assistant_for(model, ordered=True)
    embedder, head = assistant.masked_embedding, assistant.lm_head.weight
    hidden = torch.randn(3, 2, 32)
    with torch.no_grad():
        batched = assistant_module.ordered_logits(embedder, hidden, head)
        for b in range(3):
            for t in range(2):
                one = hidden[b:b + 1, t:t + 1]
                assert torch.allclose(batched[b, t], embedder(one, head)[0, 0], rtol=1e-5, atol=1e-6)
                assert torch.equal(batched[b, t], assistant_module.ordered_logits(embedder, one, head)[0, 0])
    # the 2 chosen clusters of 1 token each (12 tokens, 12 centroids) score above the floor, the rest sit on it
    chosen = batched > batched.amin(dim=-1, keepdim=True)
    assert torch.equal(chosen.sum(-1), torch.full((3, 2), 2))


def test_bad_assistants_are_refused(monkeypatch):
    model, patched = _target()
    ids = torch.tensor([[1, 2, 3]])
    # a ring buffer too short to keep the last window + 1 committed positions through a round
    # (prefill chunks of 3, k = 3: 4 + max(3, 4) - 1 = 7 slots, 8 needed)
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    with pytest.raises(ValueError, match="speculate_k=3 is too large for model's ring-buffer layer 0 .7 slots."):
        speculative_generate(patched, _assistant_for(model), ids, max_new_tokens=4, speculate_k=3)
    out = speculative_generate(patched, _assistant_for(model), ids, max_new_tokens=4, speculate_k=1)  # (6 of 6)
    assert torch.equal(out.sequences, generate(patched, ids, max_new_tokens=4).sequences)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="backbone_hidden_size 48 but model has hidden_size 64"):
        bad = _assistant_for(model)
        bad.config.backbone_hidden_size = 48
        speculative_generate(patched, bad, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"layer 1 \(full_attention\) attends with \(kv heads, head dim\) \(2, 32\)"):
        speculative_generate(patched, _assistant_for(model, num_global_key_value_heads=2), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft_model is torch.float64 but model is torch.float32"):
        speculative_generate(patched, _assistant_for(model).double(), ids, max_new_tokens=4)
    llama = patch_model(tiny_model("llama", vocab=VOCAB), int8=False)
    with pytest.raises(ValueError, match="drafts over a Gemma 4 model's keys and values; model is a 'llama' model"):
        speculative_generate(llama, _assistant_for(model), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab_size 7 but model has 5"):
        speculative_generate(patched, _assistant_for(model, vocab_size=7), ids, max_new_tokens=4)


def test_penalised_greedy_and_min_new_tokens_equal_generate():
    """The round's shared machinery with an assistant drafting: the repetition, presence and
    frequency penalties (drafts included in what later positions penalise) and min_new_tokens (eos
    suppressed) as generate."""
    model, patched = _target()
    ids, mask = ragged_prompts(3, 7, "left", vocab=VOCAB)
    options = dict(max_new_tokens=10, repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3,
                   min_new_tokens=6, eos_token_id=[1])
    want = generate(patched, ids, mask, **options).sequences
    out = speculative_generate(patched, _assistant_for(model), ids, mask, speculate_k=3, **options)
    assert torch.equal(out.sequences, want)
    assert int(out.num_accepted.sum()) > 0
