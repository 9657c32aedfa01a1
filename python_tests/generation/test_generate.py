"""generate: token-for-token equal to transformers' greedy generate on every family (left- and
right-padded ragged batches), int8 equal to HF on the dequantised weights, eos per row, sampling
(temperature / top-k / top-p as transformers' warpers), reproducibility and bad inputs."""

import collections
import copy

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from gptfast_kernels import Int8Linear, StaticKVCache, generate
from gptfast_kernels.generation.continuous import ContinuousBatcher
from gptfast_kernels.generation.end_watch import EndWatch
from gptfast_kernels.models.families import family_of, transformers_before
from gptfast_kernels.generation.sampling import apply_repetition_penalty, eos_columns, logits_to_probs, seen_tokens
from python_tests import tiny_models
from python_tests.tiny_models import (EOS, FAMILIES, HYBRID, INDEX_POSITIONED, MOE, PAD, RecordingStreamer, left_pad,
                                      patched_copy, ragged_prompts, tiny_model)

NEW = 12


def hf_greedy(model, ids, mask, new=NEW, **kwargs):
    return tiny_models.hf_greedy(model, ids, mask, new, **kwargs)


def hf_greedy_rows_alone(model, ids, mask):
    """transformers' greedy generate on each row's real tokens alone -> [B, NEW] new tokens: the
    reference for families whose transformers models mistreat padded rows (INDEX_POSITIONED)."""
    return torch.cat([hf_greedy(model, ids[b:b + 1, mask[b] == 1], None, eos_token_id=None)[:, -NEW:]
                      for b in range(ids.shape[0])])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_left_padded(family):
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    if family in INDEX_POSITIONED:
        assert torch.equal(got[:, 7:], hf_greedy_rows_alone(model, ids, mask))
    else:
        assert torch.equal(got, hf_greedy(model, ids, mask, eos_token_id=None))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_right_padded_continues_each_row(family):
    """A right-padded row continues after its last real token (transformers would read the pad
    position's logits, so the reference is transformers on the same prompts left-padded). The
    prefill projects only the columns where rows end onto the vocabulary (logits_to_keep), not all;
    a hybrid model's prompt goes in left-aligned (its recurrent layers take no padding after a
    token), so there only the last column."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "right")
    projected = []
    hook = patched.get_output_embeddings().register_forward_hook(
        lambda module, args, out: projected.append(args[0].shape[1]))
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    hook.remove()
    ends = 1 if family in HYBRID else len(set(mask.sum(dim=1).tolist()))
    assert projected[0] == ends < 7 and set(projected[1:]) == {1}
    assert torch.equal(got[:, :7], ids)  # the prompt layout is kept
    if family in INDEX_POSITIONED:
        assert torch.equal(got[:, 7:], hf_greedy_rows_alone(model, ids, mask))
    else:
        want = hf_greedy(model, *left_pad(ids, mask), eos_token_id=None)
        assert torch.equal(got[:, 7:], want[:, 7:])


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_int8_equals_transformers_on_dequantised_weights(family):
    model = tiny_model(family)
    patched = patched_copy(model, int8=True)
    dequantised = copy.deepcopy(model)
    for name, module in patched.named_modules():
        if isinstance(module, Int8Linear):
            weight = module.qweight.float() * module.scales[:, None]
            if name.endswith(".gate_up_proj"):  # Int8GatedMLP: [gate | up] rows of one matmul
                mlp = dequantised.get_submodule(name.rpartition(".")[0])
                pairs = zip((mlp.gate_proj, mlp.up_proj), weight.chunk(2))
            elif name.endswith(".qkv_proj.fused"):  # Int8FusedProjections: [q | k | v] rows
                owner = name.rpartition(".")[0]
                attn = dequantised.get_submodule(owner.rpartition(".")[0])
                sizes = patched.get_submodule(owner).sizes
                pairs = zip((attn.q_proj, attn.k_proj, attn.v_proj), weight.split(sizes))
            else:
                pairs = [(dequantised.get_submodule(name), weight)]
            for original, w in pairs:
                original.weight.data.copy_(w if isinstance(original, torch.nn.Linear) else w.t())
    ids, mask = ragged_prompts(2, 6, "left", seed=3)
    want = hf_greedy(dequantised, ids, mask, eos_token_id=None)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences, want)


def test_rows_stop_at_eos_independently():
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 5, "left")
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    stop = int(free[0, 5 + 2])  # row 0's third new token becomes "eos"
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop).sequences
    want = hf_greedy(model, ids, mask, eos_token_id=stop, pad_token_id=PAD)
    assert torch.equal(got, want)
    row0 = got[0, 5:].tolist()
    cut = row0.index(stop)
    assert all(t == PAD for t in row0[cut + 1:])
    # the default eos is the model's generation_config's, as in transformers
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=NEW).sequences,
                       hf_greedy(model, ids, mask))


@pytest.mark.parametrize("stop_steps", [(2, 4, 1), (0, 9, 3), (10, 10, 10)], ids=["early", "across-a-check", "late"])
def test_output_ends_where_the_last_row_stops(stop_steps):
    """Every row reaches an eos before max_new_tokens; the output ends at the step of the last one
    (as transformers' does), although on a GPU generate reads whether all rows stopped a step late."""
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 5, "left")
    new = 24
    free = generate(patched, ids, mask, max_new_tokens=new, eos_token_id=[]).sequences
    stops = sorted({int(free[b, 5 + step]) for b, step in enumerate(stop_steps)})
    got = generate(patched, ids, mask, max_new_tokens=new, eos_token_id=stops).sequences
    want = hf_greedy(model, ids, mask, new=new, eos_token_id=stops, pad_token_id=PAD)
    assert torch.equal(got, want)
    assert got.shape[1] < 5 + new  # every row stopped early
    assert model.generation_config.eos_token_id == EOS


def all_but(allowed):
    """eos ids: every token of the tiny vocabulary but ``allowed``; a row then ends at the first step
    whose argmax is not allowed, which min_new_tokens moves to exactly its boundary."""
    return [t for t in range(tiny_models.VOCAB) if t not in allowed]


def test_min_new_tokens_equals_transformers():
    """No eos before min_new_tokens new tokens, as in transformers' generate: with nearly every
    token an eos, each row makes exactly min_new_tokens tokens and then ends on an eos."""
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 5, "left")
    stops = all_but(range(2, 22))
    for minimum in (1, 6):
        got = generate(patched, ids, mask, max_new_tokens=NEW, min_new_tokens=minimum, eos_token_id=stops).sequences
        want = hf_greedy(model, ids, mask, min_new_tokens=minimum, eos_token_id=stops, pad_token_id=PAD)
        assert torch.equal(got, want)
        assert got.shape[1] == 5 + minimum + 1 and torch.isin(got[:, -1], torch.tensor(stops)).all()
        assert not torch.isin(got[:, 5:5 + minimum], torch.tensor(stops)).any()


def test_logprobs_are_the_raw_log_softmax_of_transformers_logits():
    """output_logprobs: each new token's log-probability under the model's raw logits (before the
    penalty and sampling arguments), equal to transformers' output_logits; 0 after a row's eos."""
    model = tiny_model("llama")
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 6, "left")
    out = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], output_logprobs=True)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    raw = torch.stack(hf.logits, dim=1).float().log_softmax(dim=-1)  # [B, NEW, V]
    want = raw.gather(2, hf.sequences[:, 6:, None])[..., 0]
    assert torch.equal(out.sequences, hf.sequences) and out.logprobs.shape == (3, NEW)
    torch.testing.assert_close(out.logprobs, want, atol=1e-4, rtol=1e-4)
    # the raw distribution, not the sampled one: a penalty changes the tokens, not how they are scored
    penalised = generate(patched, ids, mask, max_new_tokens=4, repetition_penalty=3.0, eos_token_id=[],
                         output_logprobs=True)
    with torch.no_grad():
        again = patched_copy(model, int8=False)(penalised.sequences, attention_mask=torch.cat(
            [mask, torch.ones(3, 4, dtype=mask.dtype)], dim=1)).logits
    rescored = again[:, 5:-1].float().log_softmax(dim=-1).gather(2, penalised.sequences[:, 6:, None])[..., 0]
    torch.testing.assert_close(penalised.logprobs, rescored, atol=1e-4, rtol=1e-4)
    # rows that ended: 0 after their eos
    stop = int(out.sequences[0, 6 + 2])
    ended = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop, output_logprobs=True)
    row_end = int((ended.sequences[0, 6:] == stop).nonzero()[0]) + 1
    assert torch.all(ended.logprobs[0, row_end:] == 0) and torch.all(ended.logprobs[0, :row_end] < 0)
    assert generate(patched, ids, mask, max_new_tokens=3).logprobs is None


def test_eos_columns_leave_ids_past_the_vocabulary_out():
    want = torch.zeros(10, dtype=torch.bool)
    want[[1, 5]] = True
    assert torch.equal(eos_columns(torch.tensor([1, 5, 200, 10]), 10), want)
    assert not eos_columns(torch.tensor([], dtype=torch.int64), 10).any()


def test_finished_rows_feed_the_model_a_pad_id_it_embeds():
    """With no pad token configured the pad is the first eos id, which may be one the model does not
    embed (an id past the vocabulary, never emitted): rows finished by their own limit or a stop fed
    it to the model, which failed in its embedding. The pad is now the first eos id the model embeds,
    else 0, and every row is as alone."""
    patched = patched_copy(tiny_model("llama"), int8=False)
    patched.generation_config.pad_token_id = None
    ids, mask = ragged_prompts(3, 5, "left")
    vocab = patched.get_input_embeddings().num_embeddings
    for eos, pad in (([vocab + 3], 0), ([vocab + 3, EOS], EOS)):
        got = generate(patched, ids, mask, max_new_tokens=[1, 4, 3], eos_token_id=eos).sequences
        for b, limit in enumerate([1, 4, 3]):
            alone = generate(patched, ids[b:b + 1], mask[b:b + 1], max_new_tokens=limit, eos_token_id=eos).sequences
            assert got[b, :5 + limit].tolist() == alone[0].tolist() and (got[b, 5 + limit:] == pad).all()
    stop = generate(patched, ids, mask, max_new_tokens=4, eos_token_id=[]).sequences[0, 6].item()
    generate(patched, ids, mask, max_new_tokens=4, eos_token_id=[vocab + 3], stop_sequences=[[stop]])
    batcher = ContinuousBatcher(patched, batch_size=2, max_length=12, eos_token_id=[vocab + 3])
    request = batcher.submit(ids[1][mask[1] == 1].tolist(), max_new_tokens=3)
    assert batcher.run()[request] == generate(patched, ids[1:2], mask[1:2], max_new_tokens=3,
                                              eos_token_id=[]).sequences[0, 5:].tolist()
    with pytest.raises(ValueError, match="eos_token_id"):
        ContinuousBatcher(patched, batch_size=2, max_length=12, eos_token_id=[-1])


def test_reusing_a_cache_and_zero_new_tokens():
    patched = patched_copy(tiny_model("gpt_neox"), int8=False)
    ids, mask = ragged_prompts(2, 5, "left")
    cache = StaticKVCache(patched.config, 2, 32)
    first = generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[], past_key_values=cache).sequences
    again = generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[], past_key_values=cache).sequences
    assert torch.equal(first, again)
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=0).sequences, ids)


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids, mask = ragged_prompts(4, 5, "left")

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(patched, ids, mask, max_new_tokens=8, temperature=1.0, generator=g, eos_token_id=[],
                        **kw).sequences

    assert torch.equal(sample(1), sample(1)) and not torch.equal(sample(1), sample(2))
    greedy = generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[]).sequences
    assert torch.equal(sample(5, top_k=1), greedy)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (0.7, None, None, None), (1.3, 5, None, None), (1.0, None, 0.8, None), (0.9, 20, 0.5, None),
    (1.0, None, 1.0, None), (1.0, None, None, 0.1), (1.5, None, None, 0.05), (0.8, 30, 0.9, 0.2),
    (1.0, None, None, 1.0), (1.0, None, None, 0.0)])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p, min_p):
    """As transformers' generate applies its warpers: temperature, top-k, top-p, then min-p."""
    logits = torch.randn(6, 97) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    want = torch.softmax(scores, dim=-1)
    got = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if min_p and min_p > 0.05:  # it did filter: some token each row had left is gone
        assert ((got == 0) & (logits_to_probs(logits, temperature, top_k, top_p) > 0)).any()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_processor(penalty):
    """On the logits: transformers' RepetitionPenaltyLogitsProcessor over the same tokens (here no
    padding, where the two agree; transformers also penalises the pad id of padded rows)."""
    logits = torch.randn(4, 97) * 3
    ids = torch.randint(0, 97, (4, 9), generator=torch.Generator().manual_seed(2))
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = apply_repetition_penalty(logits, seen_tokens(ids, torch.ones_like(ids), 97), penalty)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_5_text"])
@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_greedy_with_repetition_penalty_equals_transformers(family, penalty):
    """Greedy decoding with a repetition penalty equals transformers' generate with the same
    penalty, and differs from decoding without it (the penalty acted)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids = torch.randint(2, 90, (3, 6), generator=torch.Generator().manual_seed(6))
    got = generate(patched, ids, max_new_tokens=NEW, repetition_penalty=penalty, eos_token_id=[]).sequences
    want = hf_greedy(model, ids, torch.ones_like(ids), repetition_penalty=penalty, eos_token_id=None,
                     pad_token_id=PAD)
    assert torch.equal(got, want)
    assert not torch.equal(got, generate(patched, ids, max_new_tokens=NEW, eos_token_id=[]).sequences)


class OpenAIPenalties(LogitsProcessor):
    """The OpenAI API's presence / frequency penalties as a transformers logits processor, written
    out token by token: each token generated so far (after the first ``prompt_length`` columns)
    costs its logit ``frequency`` per occurrence and ``presence`` once."""

    def __init__(self, prompt_length, presence, frequency):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b in range(input_ids.shape[0]):
            for token, count in collections.Counter(input_ids[b, self.prompt_length:].tolist()).items():
                scores[b, token] -= self.frequency * count + self.presence
        return scores


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_5_text"])
@pytest.mark.parametrize("presence, frequency", [(0.0, 2.0), (2.5, 0.0), (1.0, -0.7)])
def test_greedy_with_presence_and_frequency_penalties_equals_transformers(family, presence, frequency):
    """Greedy decoding with presence / frequency penalties (left-padded rows: only generated tokens
    count) equals transformers' generate with the same penalties as a logits processor, and differs
    from decoding without them (the penalties acted)."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    got = generate(patched, ids, mask, max_new_tokens=NEW, presence_penalty=presence, frequency_penalty=frequency,
                   eos_token_id=[]).sequences
    want = hf_greedy(model, ids, mask, logits_processor=LogitsProcessorList([OpenAIPenalties(7, presence, frequency)]),
                     eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(got, want)
    assert not torch.equal(got, generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences)


def test_repetition_penalty_ignores_padding_and_rows_stay_independent():
    """A left-padded row with the penalty decodes as it does alone: its padding tokens are not
    "seen", and no row's tokens count for another."""
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    alone = []
    for b in range(3):
        real = ids[b][mask[b] == 1][None]
        alone.append(generate(patched, real, max_new_tokens=NEW, repetition_penalty=3.0,
                              eos_token_id=[]).sequences[0, real.shape[1]:])
        # padding that holds the row's own first new token: penalised, it would no longer come first
        ids[b] = ids[b].masked_fill(mask[b] == 0, int(alone[b][0]))
    batch = generate(patched, ids, mask, max_new_tokens=NEW, repetition_penalty=3.0, eos_token_id=[]).sequences
    assert (mask == 0).any(dim=1).sum() >= 2
    for b in range(3):
        assert torch.equal(batch[b, 7:], alone[b])


def test_sampled_tokens_follow_the_distribution():
    """One step sampled for 20000 identical rows: the token counts fit the model's top-k
    distribution (chi-square), so sampling is exact, not "returns some token"."""
    from scipy.stats import chisquare

    patched = patched_copy(tiny_model("gpt2"), int8=False)
    rows = 20000
    ids = torch.tensor([[7, 8, 9]]).expand(rows, -1).contiguous()
    g = torch.Generator().manual_seed(0)
    out = generate(patched, ids, max_new_tokens=1, temperature=1.5, top_k=8, generator=g, eos_token_id=[])
    with torch.no_grad():
        probs = logits_to_probs(patched(ids[:1]).logits[0, -1], 1.5, 8)
    counts = torch.bincount(out.sequences[:, -1], minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() / probs[support].double().sum() * rows
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_a_float_mask_of_zeros_and_ones_reads_as_the_integer_one():
    """transformers takes 0 / 1 float masks (``attention_mask.float()`` is common); so do we, with the
    same result as the integer mask (other values, e.g. 0.5, are refused below)."""
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids, mask = ragged_prompts(3, 7, "left")
    want = generate(patched, ids, mask, max_new_tokens=4, eos_token_id=[]).sequences
    for floats in (mask.float(), mask.to(torch.bfloat16)):
        assert torch.equal(generate(patched, ids, floats, max_new_tokens=4, eos_token_id=[]).sequences, want)


@pytest.mark.parametrize("kwargs, needle, error", [
    (dict(input_ids=torch.ones(2, 3)), "input_ids", ValueError),
    (dict(input_ids=torch.ones(3, dtype=torch.int64)), "input_ids", ValueError),
    (dict(input_ids=torch.ones(0, 3, dtype=torch.int64)), "input_ids", ValueError),
    (dict(attention_mask=torch.ones(2, 4)), "attention_mask", ValueError),
    (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "attention_mask", ValueError),
    (dict(attention_mask=torch.tensor([[1, 2, 1], [1, 1, 1]])), "attention_mask", ValueError),
    (dict(attention_mask=torch.tensor([[1, 0.5, 1], [1, 1, 1]])), "attention_mask", ValueError),
    (dict(attention_mask=torch.ones(2, 3, dtype=torch.complex64)), "attention_mask", ValueError),
    (dict(max_new_tokens=-1), "max_new_tokens", ValueError),
    (dict(max_new_tokens=2.5), "max_new_tokens", ValueError),
    (dict(temperature=-0.5), "temperature", ValueError),
    (dict(temperature=float("nan")), "temperature", ValueError),
    (dict(top_k=0), "top_k", ValueError),
    (dict(top_p=0.0), "top_p", ValueError),
    (dict(min_p=-0.1), "min_p", ValueError),
    (dict(min_p=1.5), "min_p", ValueError),
    (dict(min_p=float("nan")), "min_p", ValueError),
    (dict(min_p=True), "min_p", ValueError),
    (dict(repetition_penalty=0.0), "repetition_penalty", ValueError),
    (dict(repetition_penalty=-1.2), "repetition_penalty", ValueError),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", ValueError),
    (dict(repetition_penalty=True), "repetition_penalty", ValueError),
    (dict(presence_penalty=float("nan")), "presence_penalty", ValueError),
    (dict(presence_penalty=None), "presence_penalty", ValueError),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty", ValueError),
    (dict(frequency_penalty=True), "frequency_penalty", ValueError),
    (dict(min_new_tokens=-1), "min_new_tokens", ValueError),
    (dict(min_new_tokens=1.5), "min_new_tokens", ValueError),
    (dict(output_logprobs=1), "output_logprobs", ValueError),
    (dict(compile="yes"), "compile", ValueError),
    (dict(eos_token_id="eos"), "eos_token_id", ValueError),
    (dict(eos_token_id=[-1]), "eos_token_id", ValueError),  # (with min_new_tokens it crashed in a scatter)
    (dict(eos_token_id=[-1], min_new_tokens=1), "eos_token_id", ValueError),
    (dict(eos_token_id=[2, True]), "eos_token_id", ValueError),
    (dict(past_key_values="cache"), "past_key_values", ValueError),
    (dict(generator=0), "generator", TypeError),
])
def test_bad_inputs(kwargs, needle, error):
    patched = patched_copy(tiny_model("llama"), int8=False)
    args = dict(input_ids=torch.tensor([[2, 3, 4], [5, 6, 7]]), attention_mask=None, max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(error, match=needle):
        generate(patched, **args)


def test_unpatched_model_and_short_cache_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="patch_model"):
        generate(model, torch.tensor([[2, 3]]), max_new_tokens=2)
    patched = patched_copy(model, int8=False)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(patched, torch.tensor([[2, 3]]), max_new_tokens=9,
                 past_key_values=StaticKVCache(patched.config, 1, 4))


def _compile_refused_before_its_release(family, compiled_call) -> bool:
    """Whether the installed transformers is older than the release ``family``'s model code compiles
    from (Aria before 5.18: its float experts loop in Python); then ``compiled_call`` raises the
    ValueError naming the release."""
    first = family.compiles_from
    if not (first and transformers_before(first)):
        return False
    with pytest.raises(ValueError, match=f"compile=True.*from transformers {first}"):
        compiled_call()
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_step_gives_the_same_tokens(family):
    """compile=True: the decode step runs through torch.compile(fullgraph=True) (a CUDA graph on
    GPUs); tokens equal the eager run, and a second call reuses the model's compiled step, cache
    and decode state."""
    patched = patched_copy(tiny_model(family), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    eager = generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[]).sequences
    family = family_of(patched.config)
    if family.compile_blocker:  # CTRL
        with pytest.raises(ValueError, match=f"compile=True: transformers' {family.model_type} models"):
            generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[], compile=True)
        return
    if _compile_refused_before_its_release(
            family, lambda: generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[], compile=True)):
        return
    compiled = generate(patched, ids, mask, max_new_tokens=8, eos_token_id=[], compile=True).sequences
    assert torch.equal(compiled, eager)
    step, cache = patched._gptfast_compiled_decode, patched._gptfast_cache
    states = [id(state) for state in patched._gptfast_decode_state.values()]
    again = generate(patched, ids[:, 1:], mask[:, 1:], max_new_tokens=5, eos_token_id=[], compile=True).sequences
    assert torch.equal(again, generate(patched, ids[:, 1:], mask[:, 1:], max_new_tokens=5, eos_token_id=[]).sequences)
    assert patched._gptfast_compiled_decode is step and patched._gptfast_cache is cache
    assert [id(state) for state in patched._gptfast_decode_state.values()] == states


# generate's options, as (name, keyword arguments): each way a step picks or a row ends
PICKING = {
    "greedy": dict(),
    "sampled": dict(temperature=0.8, top_k=5),
    "per_row": dict(temperature=[0.0, 0.9, 1.3], top_p=[None, 0.8, 0.9], min_p=[None, None, 0.05]),
    "eos_held_back": dict(temperature=1.0, min_new_tokens=[2, 5, 3], eos_token_id=[3, 8], output_logprobs=True),
    "per_row_limits": dict(max_new_tokens=[3, 10, 0], eos_token_id=[6]),
    "stops": dict(stop_sequences=[[7, 7]], eos_token_id=[5], min_new_tokens=2),
    "penalty": dict(temperature=0.7, repetition_penalty=1.3, eos_token_id=[4]),
    "penalties_per_row": dict(repetition_penalty=[1.3, 1.0, 0.8], presence_penalty=0.4,
                              frequency_penalty=[0.0, 0.3, 0.6]),
}


@pytest.mark.parametrize("picking", PICKING)
def test_compiled_steps_pick_their_tokens_in_the_call(picking, monkeypatch):
    """Compiled, a decode step is one call: the forward, then the pick (argmax, or a sample at the
    step's uniforms) and each row's eos, limit and length, on buffers the step updates in place.
    Tokens and log-probabilities equal the eager steps' from the same seed, in every way a step
    picks or a row ends, penalties too (their record, which each step writes, kept static)."""
    from gptfast_kernels.generation.forward import CompiledStep

    patched = patched_copy(tiny_model("llama"), int8=True)
    ids, mask = ragged_prompts(3, 6, "left", seed=3)
    options = dict(max_new_tokens=10, eos_token_id=[], output_logprobs=True)
    options.update(PICKING[picking])

    def run(compile):
        return generate(patched, ids, mask, compile=compile, generator=torch.Generator().manual_seed(4), **options)

    calls = []
    original = CompiledStep.__call__
    monkeypatch.setattr(CompiledStep, "__call__", lambda self, *a: calls.append(self.function.__name__)
                        or original(self, *a))
    eager, compiled = run(False), run(True)
    assert calls, "no compiled step ran"
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs)
    assert set(calls) == {"_decode_step"}
    # one call a step after the first (picked from the prefill's logits), none past the end (read at once on a CPU)
    assert len(calls) == compiled.sequences.shape[1] - ids.shape[1] - 1
    if options.get("temperature"):  # (sampled: not the greedy tokens)
        assert not torch.equal(eager.sequences, generate(patched, ids, mask, **{
            **options, **dict(temperature=0.0, top_k=None, top_p=None, min_p=None)}).sequences)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("ending", ["limits", "eos", "eos_sampled"])
def test_lagged_watch_queues_steps_before_the_last_ends(ending, compile, monkeypatch):
    """On a GPU generate reads whether every row has finished one step late (EndWatch, here run on
    the CPU): the next step is queued before the last one is read, unless the last could have ended
    every row at its limit. The last row ending at its own limit costs no extra step; one ending at
    an eos costs one step past the end, in which no row is active. Either way tokens and
    log-probabilities equal those of the steps read at once."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    options = dict(output_logprobs=True, **({"temperature": 0.9, "top_k": 30} if ending == "eos_sampled" else {}))
    new = 24
    rows = 3 if ending == "limits" else 1
    ids, mask = ragged_prompts(rows, 6, "left", seed=3)
    free = generate(patched, ids, mask, max_new_tokens=new, eos_token_id=[], generator=torch.Generator().manual_seed(4),
                    **options).sequences[:, 6:].tolist()
    if ending == "limits":  # row 0 ends at an eos a few steps in, row 1 at its limit (10) after the others
        at, eos = next((i, free[0][i]) for i in range(2, 7) if free[0][i] not in free[0][:i] + free[1][:10])
        options.update(max_new_tokens=[new, 10, 4], eos_token_id=eos)
    else:  # one row, its eos a token it first emits a few steps in
        at = next(i for i in range(4, new) if free[0][i] not in free[0][:i])
        options.update(max_new_tokens=new, eos_token_id=free[0][at])
    steps, unread = [], []  # per run: the steps queued; per question: queued steps still unread after it
    another, queued = EndWatch.another, EndWatch.queued

    def watched(self):
        more = another(self)
        if self.lagged:
            unread.append(len(self.pending))
        return more

    def counted(self):
        steps[-1] += 1
        queued(self)

    monkeypatch.setattr(EndWatch, "another", watched)
    monkeypatch.setattr(EndWatch, "queued", counted)

    def run():
        steps.append(0)
        return generate(patched, ids, mask, compile=compile, generator=torch.Generator().manual_seed(4), **options)

    read_at_once = run()
    monkeypatch.setattr(EndWatch, "LAGGED_DEVICES", ("cuda", "cpu"))
    lagged = run()
    assert torch.equal(lagged.sequences, read_at_once.sequences)
    torch.testing.assert_close(lagged.logprobs, read_at_once.logprobs)
    emitted = read_at_once.sequences.shape[1] - 6
    assert emitted == (10 if ending == "limits" else at + 1)  # (the rows did end as planned)
    assert steps == [emitted, emitted + (ending != "limits")]
    assert unread[0] == 0 and 1 in unread  # (the first step: nothing queued before it)
    # at the end: near the limit the host waited for the last step; after an eos it had not
    assert unread[-1] == (0 if ending == "limits" else 1)


def test_new_sampling_values_reuse_the_compiled_step():
    """Another temperature, top-k, top-p, min_new_tokens or per-row limit is not another graph: the
    step takes them as tensors, and its state's buffers are the model's from call to call."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    ids, mask = ragged_prompts(2, 6, "left", seed=5)

    def run(temperature, top_k, top_p, min_new, limits, compile=True):
        return generate(patched, ids, mask, max_new_tokens=limits, min_new_tokens=min_new, temperature=temperature,
                        top_k=top_k, top_p=top_p, eos_token_id=[5], compile=compile,
                        generator=torch.Generator().manual_seed(1)).sequences

    run(0.7, 5, 0.9, 2, [4, 6])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    states = [id(state) for state in patched._gptfast_decode_state.values()]
    for values in ((1.3, 9, 0.8, 3, [6, 2]), ([0.5, 1.1], [3, None], [0.95, 0.6], [1, 4], [5, 3])):
        assert torch.equal(run(*values), run(*values, compile=False))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert [id(state) for state in patched._gptfast_decode_state.values()] == states


@pytest.mark.parametrize("family", MOE)
def test_float_experts_compile_to_one_graph_and_match_transformers(family):
    """int8=False keeps a MoE model's experts in float, on transformers' own experts implementation
    (grouped_mm by default): the compiled decode step is one graph, and the tokens equal
    transformers' greedy generate."""
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(2, 6, "left")

    def compiled_call():
        return generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[], compile=True)

    if not family_of(model.config).float_experts_compile:  # DBRX: a Python loop over the routed experts
        with pytest.raises(ValueError, match="compile=True: dbrx's float experts .*int8=True"):
            compiled_call()
        return
    if _compile_refused_before_its_release(family_of(model.config), compiled_call):
        return
    compiled = compiled_call().sequences
    want = hf_greedy(model, ids, mask, 6, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(compiled, want)


def test_compiled_steps_beyond_dynamo_recompile_limit():
    """Each batch size is a compiled graph of its own, all of one code object: with dynamo's limit
    at 1, a second batch size is a hard error under fullgraph=True unless generate raises it."""
    patched = patched_copy(tiny_model("llama"), int8=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (1, 2):
            ids, mask = ragged_prompts(rows, 4, "left")
            eager = generate(patched, ids, mask, max_new_tokens=3, eos_token_id=[]).sequences
            compiled = generate(patched, ids, mask, max_new_tokens=3, eos_token_id=[], compile=True).sequences
            assert torch.equal(compiled, eager)


def test_each_model_has_its_own_recompile_count(monkeypatch):
    """Dynamo's recompile limit counts graphs per code object: each model's compiled step has its own,
    so a process compiling many models (here with a limit of 1) never fails on the next model."""
    from gptfast_kernels.generation import forward

    monkeypatch.setattr(forward, "RECOMPILE_LIMIT", 1)
    ids, mask = ragged_prompts(1, 4, "left")
    with torch._dynamo.config.patch(recompile_limit=1):
        for family in ("llama", "qwen3", "gemma"):  # different modules: different graphs
            patched = patched_copy(tiny_model(family), int8=False)
            eager = generate(patched, ids, mask, max_new_tokens=3, eos_token_id=[]).sequences
            compiled = generate(patched, ids, mask, max_new_tokens=3, eos_token_id=[], compile=True).sequences
            assert torch.equal(compiled, eager)


def test_streamer_gets_the_prompt_then_every_step():
    """As transformers' generate: put(prompt [B, P]), put(tokens [B]) per step on the CPU, end();
    with an eos the stream stops at the step where the last row finished."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    streamer = RecordingStreamer()
    out = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], streamer=streamer).sequences
    assert streamer.ended == 1 and torch.equal(streamer.puts[0], ids)
    assert all(p.device.type == "cpu" and p.shape == (2,) for p in streamer.puts[1:])
    assert torch.equal(torch.stack(streamer.puts[1:], dim=1), out[:, 6:])
    # one row: an eos ends the stream at once (no pad steps after it)
    row = ids[:1]
    stop = int(out[0, 6 + 3])
    streamer = RecordingStreamer()
    got = generate(patched, row, max_new_tokens=NEW, eos_token_id=stop, streamer=streamer).sequences
    assert torch.equal(torch.stack(streamer.puts[1:], dim=1), got[:, 6:])
    assert int(streamer.puts[-1][0]) == stop and streamer.ended == 1
    with pytest.raises(TypeError, match="streamer"):
        generate(patched, row, max_new_tokens=2, streamer=object())


def test_calls_past_a_learned_position_table_are_refused_up_front():
    """GPT-2's learned positions hold n_positions: a call that would feed a token past them fails
    inside the embedding mid-generation (a device-side assert on CUDA); it is refused up front,
    naming the table. A speculative call also writes its round's drafts past a row's last token."""
    from gptfast_kernels import prompt_lookup_generate, speculative_generate
    from python_tests.tiny_models import draft_of

    model = tiny_model("gpt2", n_positions=16)
    patched, draft = patched_copy(model, int8=False), patched_copy(draft_of(model), int8=False)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    fits = generate(patched, ids, max_new_tokens=5, eos_token_id=[]).sequences  # 12 + 5 - 1 = 16 positions
    assert torch.equal(fits, hf_greedy(model, ids, None, new=5, eos_token_id=None))
    with pytest.raises(ValueError, match=r"17 positions, more than model's position table holds \(16"):
        generate(patched, ids, max_new_tokens=6, eos_token_id=[])
    for call in (lambda **kw: speculative_generate(patched, draft, ids, **kw),
                 lambda **kw: prompt_lookup_generate(patched, ids, **kw)):
        with pytest.raises(ValueError, match="speculate_k.*position table"):
            call(max_new_tokens=4, speculate_k=3, eos_token_id=[])  # 12 + 4 + 3 > 16
        # (k is capped at the tokens left after the prefill's: 1 here, 12 + 2 + 1 fits)
        out = call(max_new_tokens=2, speculate_k=3, eos_token_id=[])
        assert torch.equal(out.sequences, fits[:, :14])
