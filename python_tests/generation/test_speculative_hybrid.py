"""Speculative decoding of hybrid models (linear-attention / Mamba / convolution layers beside
attention): a StaticKVCache built with rollback_tokens keeps each row's recurrent states after every
token since its checkpoint(), and a crop puts every row back at the length it keeps.

- The cache: after a checkpoint, forwards of several tokens (padding columns included) and a crop
  to any per-row length, every recurrent state equals that of a cache fed only the kept tokens, as
  do the next step's logits; in one forward or over several (a draft's round); bad uses raise.
- Generation, every hybrid family: greedy speculative decoding (hybrid target and draft, a dense
  draft, prompt lookup) equals the target's own greedy decoding; a draft identical to the target
  accepts every sampled proposal (the compiled rounds: test_speculative.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from gptfast_kernels import StaticKVCache, generate, patch_model, speculative_generate
from gptfast_kernels.generation.prompt_lookup import prompt_lookup_generate
from gptfast_kernels.models import recurrent
from gptfast_kernels.models.families import family_of
from python_tests.tiny_models import (ATTENTION_FREE, HYBRID, LATENT, VOCAB, draft_of, patched_copy, ragged_prompts,
                                     tiny_model)

NEW = 16


def _states(cache) -> list[torch.Tensor]:
    return [tensor.clone() for layer in cache.layers if isinstance(layer, LinearAttentionLayer)
            for states in (layer.conv_states, layer.recurrent_states) for tensor in states.values()
            if tensor is not None]


def _prefilled(model, ids, mask, **cache_options):
    cache = StaticKVCache(model.config, ids.shape[0], 24, **cache_options)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    return cache


@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request):
    model = tiny_model(request.param, layers=3)
    return model, patched_copy(model, int8=False)


# per row: which columns of the checkpointed forwards are real (1) or padding (0), and how many of the
# real tokens the crop keeps; row 3 is padding throughout (a finished row)
COLUMNS = [[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
KEPT = [[4, 2, 0, 0], [1, 3, 1, 0], [3, 0, 4, 0], [2, 1, 2, 0]]


@pytest.mark.parametrize("kept", KEPT, ids=lambda kept: "kept" + "".join(map(str, kept)))
@pytest.mark.parametrize("forwards, check", [((4,), True), ((2, 1, 1), True), ((2, 1, 1), False)],
                         ids=["one-forward", "draft-round", "draft-round-unchecked"])
def test_crop_after_checkpoint_restores_every_rows_states(hybrid, forwards, check, kept):
    """A checkpoint, then 4 token columns (one verification forward, or a draft's round of 2 + 1 + 1
    tokens) with padding columns, then a crop keeping ``kept`` real tokens per row (checked, or
    not: the generators' way): each row's states equal those of the same prompt fed the kept
    tokens alone, and so do the logits of the next token."""
    _, patched = hybrid
    B = len(COLUMNS)
    ids, mask = ragged_prompts(B, 5, "left", seed=1)
    new = torch.randint(2, VOCAB, (B, 4), generator=torch.Generator().manual_seed(2))
    columns = torch.tensor(COLUMNS)
    cache = _prefilled(patched, ids, mask, rollback_tokens=4)
    start = cache.seq_lengths.clone()
    cache.checkpoint()
    with torch.no_grad():
        done = 0
        for width in forwards:
            patched(new[:, done:done + width], attention_mask=columns[:, done:done + width], past_key_values=cache)
            done += width
    assert torch.equal(cache.seq_lengths, start + columns.sum(dim=1))
    keep = torch.minimum(torch.tensor(kept), columns.sum(dim=1))
    cache.crop(start + keep, check=check)
    assert torch.equal(cache.seq_lengths, start + keep)
    restored = _states(cache)
    after = torch.randint(2, VOCAB, (B, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = patched(after, past_key_values=cache).logits[:, -1]
    for row in range(B):
        real = new[row][columns[row] == 1][:int(keep[row])]
        alone = _prefilled(patched, ids[row:row + 1], mask[row:row + 1])
        with torch.no_grad():
            for token in real:  # one decode step per kept token, as plain decoding feeds them
                patched(token.view(1, 1), past_key_values=alone)
            for ours, theirs in zip(restored, _states(alone)):
                torch.testing.assert_close(ours[row], theirs[0], atol=1e-5, rtol=1e-4)
            want = patched(after[row:row + 1], past_key_values=alone).logits[0, -1]
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)


def test_checkpoint_and_crop_refuse_what_they_cannot_do(hybrid):
    model, patched = hybrid
    ids, mask = ragged_prompts(2, 5, "left", seed=1)
    new = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match="rollback_tokens must be"):
        StaticKVCache(patched.config, 2, 8, rollback_tokens=-1)
    plain = _prefilled(patched, ids, mask)
    with pytest.raises(ValueError, match="checkpoint.*rollback_tokens > 0"):
        plain.checkpoint()
    empty = StaticKVCache(patched.config, 2, 24, rollback_tokens=4)
    with pytest.raises(ValueError, match="checkpoint comes after the prompt"):
        empty.checkpoint()

    cache = _prefilled(patched, ids, mask, rollback_tokens=2)
    start = cache.seq_lengths.clone()
    cache.checkpoint()
    with torch.no_grad():
        patched(new[:, :2], past_key_values=cache)
    before = _states(cache)
    with pytest.raises(ValueError, match="row 1 would go back to length .* before the checkpoint"):
        cache.crop(torch.stack([start[0], start[1] - 1]))
    assert torch.equal(cache.seq_lengths, start + 2)  # nothing changed
    assert all(torch.equal(a, b) for a, b in zip(before, _states(cache)))
    with torch.no_grad():  # 3 tokens since the checkpoint, 2 kept
        patched(new[:, 2:], past_key_values=cache)
    with pytest.raises(ValueError, match="more than rollback_tokens = 2 token columns"):
        cache.crop(start + 1)

    # (unpatched latent attention cannot use the cache at all, nor an unpatched attention-free model: test_patch)
    if model.config.model_type not in LATENT + ATTENTION_FREE:
        # (rows of one length: an unpatched model refuses ragged rows, which it would read at the longest's)
        cache = _prefilled(patched, ids, None, rollback_tokens=2)
        cache.checkpoint()
        with torch.no_grad():  # transformers' model: its recurrent layers do not record their states
            model(new[:, :1], past_key_values=cache)
        with pytest.raises(RuntimeError, match="recorded 0 of .* only a patched model"):
            cache.crop(cache.seq_lengths - 1)

    cache = _prefilled(patched, ids, mask, rollback_tokens=2)
    cache.checkpoint()
    cache.crop(torch.zeros(2, dtype=torch.int64))  # emptying needs no history (and closes the checkpoint)
    assert cache.seq_lengths.tolist() == [0, 0] and not any(state.any() for state in _states(cache))
    assert not cache.state_history.is_open


def _three_layer(family: str = "qwen3_5_text"):
    """A patched hybrid whose layers are recurrent, attention, recurrent (the tiny configs')."""
    return patched_copy(tiny_model(family, layers=3), int8=False)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_raises_leaves_the_states_as_before_it(error):
    """Under a checkpoint a forward fails after the first recurrent layer stepped (a hook on the
    attention layer after it raises; PyTorch runs no forward hook after a KeyboardInterrupt, so the
    next planned forward or crop notices instead). The lengths stay, the recurrent states go back
    to what they were before it, and a crop then restores each row exactly."""
    patched = _three_layer()
    ids, mask = ragged_prompts(2, 5, "left", seed=1)
    cache = _prefilled(patched, ids, mask, rollback_tokens=3)
    reference = _prefilled(patched, ids, mask)
    new = torch.randint(2, VOCAB, (2, 3), generator=torch.Generator().manual_seed(4))
    cache.checkpoint()
    with torch.no_grad():
        patched(new[:, :1], past_key_values=cache)
        patched(new[:, :1], past_key_values=reference)
    lengths, before, good = cache.seq_lengths.clone(), _states(cache), _states(reference)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(good, before))
    attention = next(m for m in patched.modules() if type(m).__name__ == "Qwen3_5Attention")

    def fail(*args):
        raise error("interrupted")

    hook = attention.register_forward_hook(fail)
    with pytest.raises(error), torch.no_grad():  # (row 1 is padding in it, as a finished row)
        patched(new[:, 1:], attention_mask=torch.tensor([[1, 1], [0, 0]]), past_key_values=cache)
    hook.remove()
    assert torch.equal(cache.seq_lengths, lengths)
    if error is RuntimeError:  # the model's forward hook put the states back at once
        assert all(torch.equal(a, b) for a, b in zip(before, _states(cache)))
    cache.crop(lengths)
    assert all(torch.equal(a, b) for a, b in zip(before, _states(cache)))


def test_crop_to_a_length_a_row_never_had_raises():
    """With explicit position_ids a forward can skip positions (length 4 -> 7 for one token at 6):
    a crop to 5 or 6 has no state to go back to (ValueError naming the row), one to 4 or 7 has."""
    patched = _three_layer()
    ids = torch.randint(2, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1))
    cache = _prefilled(patched, ids, None, rollback_tokens=3)
    before = _states(cache)
    for length in (5, 6, 4):
        cache.checkpoint()
        with torch.no_grad():
            patched(torch.tensor([[9]]), position_ids=torch.tensor([[6]]), past_key_values=cache)
        assert cache.seq_lengths.tolist() == [7]
        if length == 4:
            cache.crop(torch.tensor([length]))
        else:
            with pytest.raises(ValueError, match=f"row 0 never had length {length} since the checkpoint"):
                cache.crop(torch.tensor([length]))
            cache.crop(torch.tensor([4]))
        assert cache.seq_lengths.tolist() == [4]
        assert all(torch.equal(a, b) for a, b in zip(before, _states(cache)))


@pytest.mark.parametrize("check", [True, False])
def test_a_crop_to_zero_empties_the_states(check):
    """A crop to 0 under a checkpoint empties the rows' recurrent states, checked or not (a row
    emptied mid-batch starts over, as in a fresh cache): the next prompt's logits are a fresh
    cache's."""
    patched = _three_layer()
    ids, mask = ragged_prompts(2, 5, "left", seed=1)
    cache = _prefilled(patched, ids, mask, rollback_tokens=3)
    cache.checkpoint()
    with torch.no_grad():
        patched(ids[:, :2], past_key_values=cache)
    cache.crop(torch.zeros(2, dtype=torch.int64), check=check)
    assert cache.seq_lengths.tolist() == [0, 0] and not any(state.any() for state in _states(cache))
    other, other_mask = ragged_prompts(2, 4, "left", seed=2)
    with torch.no_grad():
        got = patched(other, attention_mask=other_mask, past_key_values=cache).logits
        want = patched(other, attention_mask=other_mask, past_key_values=StaticKVCache(patched.config, 2, 24)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_dense_cache_checkpoint_is_a_no_op():
    patched = patched_copy(tiny_model("llama"), int8=False)
    cache = _prefilled(patched, torch.tensor([[3, 4, 5]]), None, rollback_tokens=2)
    assert cache.state_history is None
    cache.checkpoint()
    cache.crop(-1)
    assert cache.seq_lengths.tolist() == [2]


def _draft_pair(family: str, int8: bool = False):
    target = tiny_model(family, layers=3)
    return patched_copy(target, int8=int8), patch_model(draft_of(target, 2), int8=int8)


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("batch, k", [(1, 4), (4, 3)])
def test_greedy_equals_target_greedy(family, batch, k):
    """Hybrid target and hybrid draft (its first 2 of 3 layers), and prompt lookup: the target's own
    greedy tokens, whatever each round accepted."""
    patched, draft = _draft_pair(family)
    ids, mask = ragged_prompts(batch, 6, "left", seed=batch)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert torch.all(out.num_proposed > 0) and torch.all(out.num_accepted <= out.num_proposed)
    lookup = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[])
    assert torch.equal(lookup.sequences, want)


@pytest.mark.parametrize("family", ["qwen3_5_text", "jamba", "lfm3", "zaya"])
def test_right_padded_prompts(family):
    """Right-padded prompts go into both models left-aligned: the target's own greedy tokens after
    the prompt as given."""
    patched, draft = _draft_pair(family)
    ids, mask = ragged_prompts(3, 6, "right", seed=5)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, want) and torch.equal(out.sequences[:, :6], ids)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "lfm2", "falcon_h1", "zaya"])
def test_unrelated_drafts_and_int8(family):
    """int8 target and draft; a dense draft for a hybrid target and a hybrid draft for a dense target
    (the tiny models share a vocabulary), both mostly rejected: every round rolls back."""
    patched, draft = _draft_pair(family, int8=True)
    dense = patch_model(tiny_model("llama", layers=2, seed=5), int8=True)
    ids, mask = ragged_prompts(3, 6, "left", seed=3)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    for drafter in (draft, dense):
        out = speculative_generate(patched, drafter, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
        assert torch.equal(out.sequences, want)
    assert out.acceptance_rate < 1  # (the dense draft's)
    dense_want = generate(dense, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = speculative_generate(dense, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, dense_want)
    assert out.acceptance_rate < 1


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm3"])
def test_identical_sampling_draft_accepts_everything(family):
    """Sampling with the target itself as the draft: its distributions equal the target's, so every
    proposal is accepted; a draft whose states had not rolled forward with the text would propose
    from other distributions and be rejected."""
    patched, _ = _draft_pair(family)
    ids, mask = ragged_prompts(3, 6, "left", seed=2)
    out = speculative_generate(patched, patched, ids, mask, max_new_tokens=NEW, speculate_k=3, temperature=1.0,
                               eos_token_id=[], generator=torch.Generator().manual_seed(0))
    assert out.acceptance_rate == 1.0
    assert out.sequences.shape == (3, 6 + NEW)


def test_a_family_whose_states_no_module_steps_is_refused():
    """Where no recurrent block of a layer with a state can be found (here: the family's attention
    class renamed to the mixers' own), speculative decoding says why, naming the argument."""
    model = tiny_model("qwen3_5_text")
    family = family_of(model.config)
    mixer_class = type(next(iter(recurrent.recurrent_mixers(model, family).values()))).__name__
    renamed = dataclasses.replace(family, attention_class=mixer_class)
    blocker = recurrent.install_stepped_mixers(model, renamed, recurrent.recurrent_mixers(model, renamed))
    assert blocker is not None and "recurrent state" in blocker
    patched = patched_copy(model, int8=False)
    patched._gptfast_rollback_blocker = blocker
    dense = patch_model(tiny_model("llama"), int8=False)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match="speculative_generate: model .*cannot roll back"):
        speculative_generate(patched, dense, ids, max_new_tokens=3)
    with pytest.raises(ValueError, match="speculative_generate: draft_model .*cannot roll back"):
        speculative_generate(dense, patched, ids, max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt_lookup_generate: model .*cannot roll back"):
        prompt_lookup_generate(patched, ids, max_new_tokens=3)


# per family: the int8 layers of a recurrent block that take its input (with int8 its input projections are one
# Int8Linear: Qwen3.5's four, Kimi's five beside its low-rank forget gate's first, ZAYA1's four), and the others;
# the blocks with a one-pass forward (recurrent_columns.py: all here but ZAYA1's) run every layer once
SHARED_AND_OTHER = {"qwen3_5_text": (2, 0), "bamba": (2, 0), "kimi_linear": (5, 0), "zaya": (1, 0),
                    "olmo_hybrid": (2, 0), "qwen3_next": (2, 0)}


@pytest.mark.parametrize("family", sorted(SHARED_AND_OTHER))
def test_recurrent_blocks_run_their_input_projections_once(family, monkeypatch):
    """With int8 a recurrent block's input projections are one Int8Linear, one call per forward;
    under a checkpoint the block steps token by token, but that call (and any other linear layer
    taking the block's input) still runs once on all the forward's columns, the others (the output
    projection ...) once per column; a mixer with a one-pass forward (Mamba-2's) runs each once."""
    from gptfast_kernels.modules.int8_linear import Int8Linear

    patched = patched_copy(tiny_model(family, layers=3), int8=True)
    mixers = recurrent.recurrent_mixers(patched, family_of(patched.config))
    shared, other = SHARED_AND_OTHER[family]
    ids, mask = ragged_prompts(2, 5, "left")
    cache = _prefilled(patched, ids, mask, rollback_tokens=4)
    calls = []  # (linear layer, columns of its input)
    forward = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: calls.append((self, x.shape[1])) or forward(self, x))

    def per_mixer():
        for mixer in mixers.values():
            inner = [columns for linear, columns in calls if any(linear is m for m in mixer.modules())]
            yield sum(isinstance(m, Int8Linear) for m in mixer.modules()), inner
        calls.clear()

    with torch.no_grad():
        patched(ids[:, :1], past_key_values=cache)  # a plain decode step: each layer once
    for layers, inner in per_mixer():
        assert layers == shared + other and inner == [1] * (shared + other)
    cache.checkpoint()
    with torch.no_grad():
        patched(ids[:, :4], past_key_values=cache)
    for _, inner in per_mixer():
        assert sorted(inner, reverse=True) == [4] * shared + [1] * (4 * other)


# the hybrid families whose recurrent blocks run a round in one pass (recurrent_columns: Mamba-2 mixers, gated
# delta nets and Kimi's delta attention, LFM2's short convolutions, Mamba mixers), with config options: Falcon-H1's tiny config gates its
# read-out without a norm, "falcon_h1-norm" with its gated norm; OLMo-Hybrid's lets beta reach 2, "-beta1" not
ONE_PASS_FAMILIES = {"mamba2": {}, "bamba": {}, "granitemoehybrid": {}, "nemotron_h": {}, "zamba2": {},
                     "falcon_h1": {}, "falcon_h1-norm": {"mamba_rms_norm": True}, "qwen3_5_text": {},
                     "qwen3_5_moe_text": {}, "qwen3_next": {}, "lara_mini": {}, "lfm2": {}, "lfm2_moe": {}, "lfm3": {},
                     "mamba": {}, "falcon_mamba": {}, "jamba": {}, "olmo_hybrid": {},
                     "olmo_hybrid-beta1": {"linear_allow_neg_eigval": False}, "kimi_linear": {}, "zamba": {},
                     "zaya": {}}


def test_every_hybrid_family_has_a_one_pass_case():
    assert {variant.split("-")[0] for variant in ONE_PASS_FAMILIES} == set(HYBRID)


@pytest.mark.parametrize("variant", sorted(ONE_PASS_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_blocks_run_a_round_in_one_pass_as_stepping_would(variant, dtype):
    """A Mamba-2 mixer, gated delta net, short convolution or Mamba mixer under a checkpoint runs all of
    a forward's columns in one pass: the logits, the states after the forwards and after each row's crop equal those of the
    same model stepping its blocks column by column (transformers' single-token path), padding
    columns included, in float32 and bfloat16."""
    import transformers
    from packaging.version import Version

    from gptfast_kernels.models import recurrent_columns

    if variant == "falcon_h1-norm" and Version(transformers.__version__) < Version("5.23"):
        pytest.skip("transformers' own Falcon-H1 decode step with mamba_rms_norm broadcasts one column's gate over "
                    "the batch before 5.23 (seen on 5.17; fine on 5.23)")
    torch.manual_seed(0)
    model = tiny_model(variant.split("-")[0], layers=3, **ONE_PASS_FAMILIES[variant]).to(dtype)
    one_pass, stepping = patched_copy(model, int8=False), patched_copy(model, int8=False)
    found = recurrent.recurrent_mixers(stepping, family_of(stepping.config))
    mixers = [found[index] for index in recurrent.stateful_layers(family_of(stepping.config), stepping.config)]
    assert mixers and all(recurrent_columns.column_forward_of(m) is not None for m in mixers)
    for mixer in mixers:
        mixer._gptfast_column_forward = None
    B = len(COLUMNS)
    ids, mask = ragged_prompts(B, 5, "left", seed=1)
    new = torch.randint(2, VOCAB, (B, 4), generator=torch.Generator().manual_seed(2))
    columns = torch.tensor(COLUMNS)
    keep = torch.tensor(KEPT[1])
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    results = []
    for patched in (one_pass, stepping):
        cache = _prefilled(patched, ids, mask, rollback_tokens=4)
        start = cache.seq_lengths.clone()
        cache.checkpoint()
        with torch.no_grad():
            logits = [patched(new[:, :3], attention_mask=columns[:, :3], past_key_values=cache).logits,
                      patched(new[:, 3:], attention_mask=columns[:, 3:], past_key_values=cache).logits]
        states = _states(cache)
        assert cache.state_history.steps_recorded == 4 * len(mixers)
        cache.crop(start + torch.minimum(keep, columns.sum(dim=1)))
        results.append((logits, states, _states(cache)))
    (got_logits, got_after, got_kept), (want_logits, want_after, want_kept) = results
    real = columns.bool()
    for got, want, which in zip(got_logits, want_logits, (real[:, :3], real[:, 3:])):
        torch.testing.assert_close(got[which], want[which], **tolerance)
    for got, want in zip(got_after + got_kept, want_after + want_kept):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("family, function", [("mamba2", "mamba2_columns_forward"),
                                              ("qwen3_5_text", "gated_delta_columns_forward"),
                                              ("lfm2", "short_conv_columns_forward"),
                                              ("jamba", "mamba_columns_forward"),
                                              ("olmo_hybrid", "gated_delta_columns_forward"),
                                              ("zamba", "zamba_mamba_columns_forward"),
                                              ("zaya", "cca_columns_forward")])
def test_the_one_pass_forward_is_what_runs(family, function, monkeypatch):
    """Under a checkpoint the one-pass forward runs, once per recurrent layer and forward, on all its
    columns; without a checkpoint the block takes transformers' path."""
    from gptfast_kernels.models import recurrent_columns

    calls = []
    one_pass = getattr(recurrent_columns, function)
    monkeypatch.setattr(recurrent_columns, function, lambda *args: calls.append(args[1].shape[1]) or one_pass(*args))
    patched = patched_copy(tiny_model(family, layers=4), int8=True)
    layers = len(recurrent.stateful_layers(family_of(patched.config), patched.config))
    ids, mask = ragged_prompts(2, 5, "left")
    cache = _prefilled(patched, ids, mask, rollback_tokens=4)
    with torch.no_grad():
        patched(ids[:, :1], past_key_values=cache)
        assert calls == []
        cache.checkpoint()
        patched(ids[:, :4], past_key_values=cache)
    assert layers and calls == [4] * layers


def test_a_block_whose_states_are_not_as_expected_steps(monkeypatch):
    """When a block's cache layer holds states of other shapes than its one-pass forward expects (a
    transformers change), the one-pass forward declines and the block steps: the same logits."""
    from gptfast_kernels.models import recurrent_columns

    patched = patched_copy(tiny_model("qwen3_5_text", layers=3), int8=False)
    ids, mask = ragged_prompts(2, 5, "left")
    logits = []
    for declines in (False, True):
        if declines:
            monkeypatch.setattr(recurrent_columns, "_layer_states", lambda *args: None)
        cache = _prefilled(patched, ids, mask, rollback_tokens=4)
        cache.checkpoint()
        with torch.no_grad():
            logits.append(patched(ids[:, :4], past_key_values=cache).logits)
        assert cache.state_history.steps_recorded == 4 * len(cache.state_history.slots)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-4)
