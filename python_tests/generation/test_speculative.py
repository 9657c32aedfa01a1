"""speculative_generate: greedy output equals the target's own greedy decoding (B = 1 and ragged
B = 4, Llama and GPT-2, int8 on and off, any draft), sampled output follows the target's
distribution (chi-square on a small vocabulary), rows finish independently, bad inputs."""

import collections
import itertools

import pytest
import torch

from gptfast_kernels import generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation import forward
from gptfast_kernels.generation.forward import CompiledStep
from gptfast_kernels.generation.sampling import (apply_additive_penalties, apply_repetition_penalty, logits_to_probs,
                                                 sample_by_uniform, seen_tokens)
from gptfast_kernels.generation.end_watch import EndWatch
from python_tests.generation.test_generate import PICKING
from python_tests.tiny_models import (INDEX_POSITIONED, RecordingStreamer, draft_of, hf_greedy, patched_copy,
                                     ragged_prompts, tiny_model)

NEW = 20


def _pair(family, int8, draft_layers=2, seed=0, **config):
    target = tiny_model(family, layers=3, seed=seed, **config)
    draft = patch_model(draft_of(target, draft_layers), int8=int8)
    return target, patched_copy(target, int8=int8), draft


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "phi3", "granite", "gpt2", "gemma4_text",
                                    "gemma4_unified_text", "gemma3n_text", "deepseek_v3", "llama4_text",
                                    "mimo_v2_flash", "gptj", "falcon", "gpt_neo", "bloom", "mpt"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("batch, k", [(1, 4), (4, 4), (4, 1)])
def test_greedy_equals_target_greedy(family, int8, batch, k):
    # (seed 0's tiny Gemma 4 repeats one token after a prompt of row 0, which any draft then predicts; its
    # tiny GPT-J repeats one the draft never does)
    target, patched, draft = _pair(family, int8, seed={"gemma4_text": 3, "gptj": 1}.get(family, 0))
    ids, mask = ragged_prompts(batch, 6, "left", seed=batch)
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[])
    # the int8 target's own greedy decoding; and where transformers' model mistreats padded rows
    # (INDEX_POSITIONED), the patched target's (equal to transformers' on each row alone: test_generate)
    if int8 or family in INDEX_POSITIONED:
        want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    else:     # transformers' greedy decoding of the unpatched target
        want = hf_greedy(target, ids, mask, NEW, eos_token_id=None)
    assert torch.equal(out.sequences, want)
    assert torch.all(out.num_proposed > 0) and torch.all(out.num_accepted <= out.num_proposed)
    assert 0 < out.acceptance_rate < 1  # a 2-layer draft of a 3-layer target: partial agreement


def test_right_padding_unrelated_draft_and_eos_per_row():
    target, patched, _ = _pair("llama", False)
    unrelated = patch_model(tiny_model("llama", layers=1, seed=7), int8=False)
    ids, mask = ragged_prompts(4, 6, "right")
    own = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = speculative_generate(patched, unrelated, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    assert torch.equal(out.sequences, own)
    stop = int(own[1, 6 + 4])  # row 1's fifth new token becomes "eos"
    own_eos = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop).sequences
    out_eos = speculative_generate(patched, unrelated, ids, mask, max_new_tokens=NEW, speculate_k=3,
                                   eos_token_id=stop)
    assert torch.equal(out_eos.sequences, own_eos)


def test_identical_draft_accepts_everything():
    _, patched, _ = _pair("gpt2", False)
    ids, mask = ragged_prompts(3, 5, "left")
    out = speculative_generate(patched, patched, ids, mask, max_new_tokens=13, speculate_k=4, eos_token_id=[])
    assert out.acceptance_rate == 1.0
    # 1 token from the prefill, then rounds of k + 1 = 5: 3 rounds reach 13 (the last one cut)
    assert out.num_proposed.tolist() == [12, 12, 12]
    assert out.sequences.shape == (3, 5 + 13)
    # the draft's distributions go through the same repetition penalty and eos suppression as the
    # target's, drafts before each position included: an identical draft still matches every time
    stops = [t for t in range(97) if t not in range(2, 40)]
    out = speculative_generate(patched, patched, ids, mask, max_new_tokens=13, speculate_k=4, eos_token_id=stops,
                               repetition_penalty=1.7, min_new_tokens=8)
    assert out.acceptance_rate == 1.0


def _exact_target_distribution(model, prompt, steps, vocab, temperature, min_p=None, repetition_penalty=None,
                               additive=None):
    """P(t1..t_steps | prompt) for every sequence, by enumeration: [vocab] * steps array (with a
    repetition penalty, each step's logits penalise the prompt and the tokens before it; with
    ``additive`` (presence, frequency) penalties, the tokens generated before it)."""
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=steps - 1)), dtype=torch.int64)
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    P = prompt.shape[1]
    with torch.no_grad():
        logits = model(full).logits[:, P - 1:]  # [N, steps, V]
        if repetition_penalty is not None:
            logits = torch.stack([apply_repetition_penalty(logits[:, i], seen_tokens(
                full[:, :P + i], torch.ones_like(full[:, :P + i]), vocab), repetition_penalty)
                for i in range(steps)], dim=1)
        if additive is not None:
            counts = torch.nn.functional.one_hot(seqs, vocab).cumsum(dim=1)  # [N, steps - 1, V]: up to each draft
            counts = torch.cat([torch.zeros_like(counts[:, :1]), counts], dim=1)  # before each step
            logits = apply_additive_penalties(logits, counts, *additive)
        probs = logits_to_probs(logits, temperature, min_p=min_p)
    joint = torch.ones(len(seqs), vocab, dtype=torch.float64)
    for i in range(steps - 1):
        joint *= probs[:, i].double().gather(1, seqs[:, i:i + 1])
    joint = joint * probs[:, steps - 1].double()
    return joint.reshape([vocab] * steps)


@pytest.mark.parametrize("family, int8, min_p, penalty",
                         [("llama", False, None, None), ("llama", True, None, None), ("llama", False, 0.3, None),
                          ("llama", False, None, 1.8), ("qwen3_5_text", False, None, None)],
                         ids=["float", "int8", "min-p", "repetition", "hybrid"])
def test_sampling_follows_the_target_distribution(family, int8, min_p, penalty):
    """20000 rows sample 3 tokens with a draft that disagrees with the target; the joint
    distribution of (t1, t2, t3) — t2 and t3 come from verification — fits the target's exact
    distribution (chi-square over the cells with enough mass; with min_p, the cells it removes
    get no sample). A hybrid target and draft too: their recurrent states roll back per row."""
    vocab, rows, steps, temperature = 6, 20000, 3, 1.0
    target = patched_copy(tiny_model(family, vocab=vocab, seed=1), int8=int8)
    draft = patch_model(tiny_model(family, vocab=vocab, layers=2, seed=2), int8=False)
    prompt = torch.tensor([[2, 3]])
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(target, draft, prompt.expand(rows, -1).contiguous(), max_new_tokens=steps,
                               speculate_k=2, temperature=temperature, min_p=min_p, repetition_penalty=penalty,
                               generator=g, eos_token_id=[])
    assert 0.05 < out.acceptance_rate < 0.95
    assert_samples_follow_the_target(target, prompt, out.sequences[:, 2:], vocab, temperature, min_p, penalty)


def test_drafts_sample_each_rows_inverse_cdf_at_its_uniform():
    """sample_by_uniform (how a round samples its drafts, step by step and in one compiled call):
    the first token whose cumulative mass passes uniform x total, never a token of zero mass (at
    uniform 1, past the last mark, the last token with mass), any positive total; many uniforms
    from a generator give each token its probability."""
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]])
    uniforms = torch.tensor([0.0, 0.19, 0.21, 0.69, 0.71, 0.99, 1.0], dtype=torch.float64)
    want = torch.tensor([0, 0, 2, 2, 3, 3, 3])
    assert torch.equal(sample_by_uniform(probs.expand(len(uniforms), -1), uniforms), want)
    assert torch.equal(sample_by_uniform(2 * probs.expand(len(uniforms), -1), uniforms), want)
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(1, 40, generator=g) * (torch.rand(1, 40, generator=g) > 0.3)
    probs /= probs.sum()
    draws = 200_000
    tokens = sample_by_uniform(probs.expand(draws, -1), torch.rand(draws, dtype=torch.float64, generator=g))
    frequencies = torch.bincount(tokens, minlength=40) / draws
    assert (frequencies[probs[0] == 0] == 0).all()
    torch.testing.assert_close(frequencies, probs[0], rtol=0, atol=0.004)


def test_sampled_first_token_is_generates_at_the_same_seed():
    """The token after the prompt is picked as generate picks it (a uniform per row from the
    generator, the inverse CDF there): at one seed both give each row the same first token."""
    _, patched, draft = _pair("llama", False)
    ids, mask = ragged_prompts(4, 6, "left")
    options = dict(max_new_tokens=3, temperature=1.3, top_k=40, repetition_penalty=1.2, eos_token_id=[])
    firsts = []
    for seed in range(4):
        out = speculative_generate(patched, draft, ids, mask, speculate_k=2,
                                   generator=torch.Generator().manual_seed(seed), **options)
        want = generate(patched, ids, mask, generator=torch.Generator().manual_seed(seed), **options).sequences
        assert torch.equal(out.sequences[:, 6], want[:, 6])
        firsts.append(out.sequences[:, 6])
    assert len({tuple(f.tolist()) for f in firsts}) > 1  # (sampled: the seeds differ)


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (1.2, -0.8)])
def test_sampling_with_presence_and_frequency_penalties_follows_the_penalised_target(presence, frequency):
    """As above, with presence / frequency penalties: the tokens fit the target's distribution with
    each step penalising the tokens generated before it (the prompt's aside)."""
    vocab, rows, steps = 6, 20000, 3
    target = patched_copy(tiny_model("llama", vocab=vocab, seed=1), int8=False)
    draft = patch_model(tiny_model("llama", vocab=vocab, layers=2, seed=2), int8=False)
    prompt = torch.tensor([[2, 3]])
    out = speculative_generate(target, draft, prompt.expand(rows, -1).contiguous(), max_new_tokens=steps,
                               speculate_k=2, temperature=1.0, presence_penalty=presence, frequency_penalty=frequency,
                               generator=torch.Generator().manual_seed(0), eos_token_id=[])
    assert 0.05 < out.acceptance_rate < 0.95
    assert_samples_follow_the_target(target, prompt, out.sequences[:, 2:], vocab, 1.0, additive=(presence, frequency))


def record_proposals(monkeypatch, proposer_class) -> list:
    """Every round ``proposer_class`` proposes in, recorded: (generated, num_generated, active,
    draft tokens, the proposer) as the round saw them."""
    rounds = []
    propose = proposer_class.propose

    def recording(self, rounds_, last, active, history):
        tokens, probs = propose(self, rounds_, last, active, history)
        rounds.append((history.generated.clone(), history.num_generated.clone(), active.clone(), tokens.clone(), self))
        return tokens, probs

    monkeypatch.setattr(proposer_class, "propose", recording)
    return rounds


def assert_every_rounds_drafts(rounds, ids, mask, reference) -> int:
    """Each active row's drafts in every recorded round (record_proposals) equal ``reference(text)``,
    text: the row's prompt and what it had generated by then -> how many rows were checked."""
    checked = 0
    for generated, num_generated, active, tokens, _ in rounds:
        for b in range(ids.shape[0]):
            if active[b]:
                text = torch.cat([ids[b][mask[b].bool()], generated[b, :num_generated[b]]])
                assert tokens[b].tolist() == reference(text), (b, text.tolist())
                checked += 1
    return checked


def assert_drafter_keeps_the_target_distribution(target, draft_model, vocab):
    """20000 rows sample 3 tokens after [2, 3] (k = 2, temperature 1) with ``draft_model`` drafting;
    some drafts but not all are accepted, and the tokens fit the target's joint distribution."""
    rows, steps = 20000, 3
    prompt = torch.tensor([[2, 3]])
    out = speculative_generate(target, draft_model, prompt.expand(rows, -1).contiguous(), max_new_tokens=steps,
                               speculate_k=2, temperature=1.0, generator=torch.Generator().manual_seed(0),
                               eos_token_id=[])
    assert 0.05 < out.acceptance_rate < 0.95
    assert_samples_follow_the_target(target, prompt, out.sequences[:, 2:], vocab, 1.0)


def assert_samples_follow_the_target(target, prompt, tokens, vocab, temperature, min_p=None, penalty=None,
                                     additive=None):
    """The rows of ``tokens`` [rows, steps] (sampled after ``prompt`` [1, P]) fit the target's exact
    joint distribution: chi-square over the cells with enough mass (the rare ones pooled), and no
    sample in a cell without any (with min_p, which must remove some)."""
    from scipy.stats import chisquare

    rows, steps = tokens.shape
    cells = (tokens * vocab ** torch.arange(steps - 1, -1, -1)).sum(1)
    counts = torch.bincount(cells, minlength=vocab ** steps).double()
    expected = _exact_target_distribution(target, prompt, steps, vocab, temperature, min_p, penalty,
                                          additive).flatten() * rows
    assert counts[expected == 0].sum() == 0
    if min_p:
        assert (expected == 0).any()  # min_p removed some continuations
    enough, rare = expected >= 5, (expected > 0) & (expected < 5)
    observed, wanted = counts[enough], expected[enough]
    if bool(rare.any()):  # pool the rare cells into one
        observed = torch.cat([observed, counts[rare].sum()[None]])
        wanted = torch.cat([wanted, expected[rare].sum()[None]])
    wanted = wanted / wanted.sum() * observed.sum()
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("penalty", [1.6, 0.7])
def test_greedy_with_repetition_penalty_equals_generate(k, penalty):
    """The target's distribution at each position penalises the tokens before it, drafts included:
    greedy output equals generate's with the same penalty (itself equal to transformers')."""
    _, patched, draft = _pair("llama", False)
    ids, mask = ragged_prompts(4, 6, "left", seed=2)
    want = generate(patched, ids, mask, max_new_tokens=NEW, repetition_penalty=penalty, eos_token_id=[]).sequences
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k,
                               repetition_penalty=penalty, eos_token_id=[])
    assert torch.equal(out.sequences, want)
    assert not torch.equal(want, generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences)
    assert 0 < out.acceptance_rate < 1


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("presence, frequency", [(0.0, 2.0), (3.0, 0.0), (1.5, -0.5)])
def test_greedy_with_presence_and_frequency_penalties_equals_generate(k, presence, frequency):
    """Each position of a round counts the drafts before it as generated: greedy output equals
    generate's with the same penalties, with a draft model and with prompt lookup; an identical
    draft, penalised the same way, is always accepted."""
    _, patched, draft = _pair("llama", False)
    ids, mask = ragged_prompts(4, 6, "left", seed=2)
    options = dict(max_new_tokens=NEW, presence_penalty=presence, frequency_penalty=frequency, eos_token_id=[])
    want = generate(patched, ids, mask, **options).sequences
    assert not torch.equal(want, generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences)
    out = speculative_generate(patched, draft, ids, mask, speculate_k=k, **options)
    assert torch.equal(out.sequences, want)
    assert 0 < out.acceptance_rate < 1
    assert torch.equal(prompt_lookup_generate(patched, ids, mask, speculate_k=k, **options).sequences, want)
    assert speculative_generate(patched, patched, ids, mask, speculate_k=k, **options).acceptance_rate == 1.0


@pytest.mark.parametrize("k", [1, 4])
def test_min_new_tokens_equals_generate(k):
    """Each position of a round suppresses the eos ids while its row has made fewer than
    min_new_tokens new tokens: with nearly every token an eos (rows end as soon as they may, at
    different rounds' positions), the output equals generate's with the same min_new_tokens."""
    _, patched, draft = _pair("llama", False)
    ids, mask = ragged_prompts(4, 6, "left", seed=2)
    stops = [t for t in range(97) if t not in range(2, 22)]
    for minimum in (3, 9):
        want = generate(patched, ids, mask, max_new_tokens=NEW, min_new_tokens=minimum, eos_token_id=stops).sequences
        out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k,
                                   min_new_tokens=minimum, eos_token_id=stops)
        assert torch.equal(out.sequences, want)
        is_stop = torch.isin(want[:, 6:], torch.tensor(stops))
        assert not is_stop[:, :minimum].any() and is_stop[:, minimum].sum() >= 2  # rows ending at the boundary


@pytest.mark.parametrize("k", [1, 4])
def test_logprobs_equal_generate(k):
    """output_logprobs: the target's raw log-probability of every emitted token (accepted drafts and
    the round's own token alike), as generate's for the same tokens; 0 past a row's end."""
    _, patched, draft = _pair("llama", False)
    ids, mask = ragged_prompts(4, 6, "left", seed=2)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], output_logprobs=True)
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=[],
                               output_logprobs=True)
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
    stop = int(want.sequences[1, 6 + 3])
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop, output_logprobs=True)
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=k, eos_token_id=stop,
                               output_logprobs=True)
    assert torch.equal(out.sequences, want.sequences) and (out.logprobs == 0).any()
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise_before_any_work():
    _, patched, draft = _pair("llama", False)
    ids = torch.tensor([[2, 3, 4]])
    other_vocab = patch_model(tiny_model("llama", vocab=50, layers=1), int8=False)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(patched, other_vocab, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="speculate_k"):
        speculative_generate(patched, draft, ids, max_new_tokens=4, speculate_k=0)
    with pytest.raises(ValueError, match="draft_model"):
        speculative_generate(patched, tiny_model("llama"), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(patched, draft, ids, max_new_tokens=-2)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(patched, draft, ids, max_new_tokens=2, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        speculative_generate(patched, draft, ids, max_new_tokens=2, repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        speculative_generate(patched, draft, ids, max_new_tokens=2, presence_penalty=float("inf"))
    with pytest.raises(ValueError, match="frequency_penalty"):
        prompt_lookup_generate(patched, ids, max_new_tokens=2, frequency_penalty="high")
    with pytest.raises(ValueError, match="min_new_tokens"):
        speculative_generate(patched, draft, ids, max_new_tokens=2, min_new_tokens=-3)
    out = speculative_generate(patched, draft, ids, max_new_tokens=0)
    assert torch.equal(out.sequences, ids) and out.acceptance_rate == 0.0
    # a float64 model: the cache's message named neither the call nor the argument
    for run, name in ((lambda: speculative_generate(patched, patched_copy(draft).double(), ids, max_new_tokens=2),
                       "draft_model"),
                      (lambda: prompt_lookup_generate(patched_copy(patched).double(), ids, max_new_tokens=2), "model"),
                      (lambda: generate(patched_copy(patched).double(), ids, max_new_tokens=2), "model")):
        with pytest.raises(ValueError, match=f": {name} is torch.float64; the kernels and caches take"):
            run()


def test_speculate_k_is_capped_by_the_tokens_a_call_can_make():
    """Drafts past a call's last new token are never emitted: k is capped at max_new_tokens - 1
    (the prefill makes the first), as transformers' assisted generation caps it. Uncapped, each round
    drafted and verified all k (k = 300: seconds for 3 tokens, num_proposed 300 a round), and a
    learned position table refused a call that fits it."""
    target = tiny_model("gpt2", n_positions=16)
    patched, draft = patched_copy(target, int8=False), patched_copy(draft_of(target), int8=False)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10]])
    want = generate(patched, ids, max_new_tokens=3, eos_token_id=[])
    for run in (lambda k: prompt_lookup_generate(patched, ids, max_new_tokens=3, speculate_k=k, eos_token_id=[]),
                lambda k: speculative_generate(patched, draft, ids, max_new_tokens=3, speculate_k=k, eos_token_id=[])):
        capped, two = run(300), run(2)
        assert torch.equal(capped.sequences, want.sequences)
        assert torch.equal(capped.num_proposed, two.num_proposed) and int(capped.num_proposed.max()) <= 4
    one = prompt_lookup_generate(patched, ids, max_new_tokens=1, speculate_k=5, eos_token_id=[])
    assert torch.equal(one.sequences, generate(patched, ids, max_new_tokens=1, eos_token_id=[]).sequences)


def test_a_compiled_model_drafting_for_itself_keeps_two_caches():
    """The same model as target and draft, compiled: each role reuses a cache of its own (one
    shared cache would hold the draft's tokens where the target's belong)."""
    _, patched, _ = _pair("llama", True)
    ids, mask = ragged_prompts(2, 6, "left")
    want = generate(patched, ids, mask, max_new_tokens=10, eos_token_id=[]).sequences
    out = speculative_generate(patched, patched, ids, mask, max_new_tokens=10, speculate_k=3, eos_token_id=[],
                               compile=True)
    assert torch.equal(out.sequences, want) and out.acceptance_rate == 1.0
    assert patched._gptfast_cache is not patched._gptfast_cache_draft


def count_compiled_calls(monkeypatch, draft_model) -> collections.Counter:
    """A counter, from now on, of the compiled calls: ("draft" or "target", the compiled function's
    name) -> calls (the draft: ``draft_model``'s)."""
    calls = collections.Counter()
    original = CompiledStep.__call__

    def counting(self, *args):
        calls[("draft" if self.model is draft_model else "target", self.function.__name__)] += 1
        return original(self, *args)

    monkeypatch.setattr(CompiledStep, "__call__", counting)
    return calls


# how a round's drafts are picked: from the draft's logits as they are (greedy, or sampled with
# scalar or per-row arguments), or after the penalties or with the eos held back (processed in the
# same call)
DRAFTING = {"greedy": {}, "penalty": {"repetition_penalty": 1.3}, "sampled": {"temperature": 0.8, "top_k": 20},
            "per_row": {"temperature": [0.0, 0.7, 1.2], "top_p": [None, 0.9, 0.8], "min_p": [0.05, None, 0.0]},
            "penalties_sampled": {"temperature": 0.9, "repetition_penalty": [1.3, 1.0, 0.7], "presence_penalty": 0.5,
                                  "frequency_penalty": [0.0, 0.4, 0.8]},
            "eos_held_back": {"temperature": 1.0, "min_new_tokens": [12, 3, 20]}}


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_compiled_rounds_draft_in_one_call(family, monkeypatch):
    """Compiled, a round's k drafts are one compiled call of the draft (forward.drafts_function),
    not k steps, greedy or sampled, with the penalties over each row's text and the drafts before
    (each a number or per row) and the eos held back short of min_new_tokens processed in the
    call: the same tokens and acceptances as eager rounds, which draft step by step (sampled: from
    the same generator seed, the drafts drawn at the same uniforms), with rows finishing at their
    own eos (inactive rows in the call) and, for Mistral, the caches' sliding layers as rings."""
    if family == "mistral":
        monkeypatch.setattr(forward, "PREFILL_CHUNK", 1)  # rings of window + k slots
    _, patched, draft = _pair(family, True)
    ids, mask = ragged_prompts(3, 6, "left")
    stop = int(generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences[1, 6 + 4])
    calls = count_compiled_calls(monkeypatch, draft)
    for name, options in DRAFTING.items():
        run = dict(max_new_tokens=NEW, speculate_k=3, eos_token_id=stop, **options)
        seeded = (lambda: {"generator": torch.Generator().manual_seed(11)}) if "temperature" in options else dict
        eager = speculative_generate(patched, draft, ids, mask, **run, **seeded())
        calls.clear()
        compiled = speculative_generate(patched, draft, ids, mask, compile=True, **run, **seeded())
        assert torch.equal(compiled.sequences, eager.sequences), name
        assert torch.equal(compiled.num_accepted, eager.num_accepted) and 0 < eager.acceptance_rate < 1, name
        # one verification forward a round, in the target's round call (verify_step)
        rounds = calls[("target", "_verify_round")]
        assert rounds > 0 and calls[("target", "_forward")] == 0, name
        assert calls[("draft", "_drafts")] == rounds and calls[("draft", "_forward")] == 0, name
        if name == "greedy":
            want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop).sequences
            assert torch.equal(compiled.sequences, want)
            new = compiled.sequences[:, 6:]
            ends = [row.tolist().index(stop) if stop in row.tolist() else len(row) for row in new]
            assert len(set(ends)) > 1  # rows ended at different steps: inactive rows drafted


@pytest.mark.parametrize("settling", PICKING)
def test_compiled_rounds_verify_in_the_targets_call(settling, monkeypatch):
    """Compiled, a round after its drafts is one call of the target (verify_step): its forward, the
    eos held back under min_new_tokens, verification, the crop and each row's emitted tokens,
    counts and end, on buffers the call updates in place. Tokens, acceptances and log-probabilities
    equal the eager rounds' from the same seed, in every way generate's steps pick or a row ends
    (generate's PICKING), stop patterns and penalties included (their record, which the call
    writes, kept static)."""
    _, patched, draft = _pair("llama", True)
    ids, mask = ragged_prompts(3, 6, "left", seed=3)
    options = dict(max_new_tokens=NEW, speculate_k=3, eos_token_id=[], output_logprobs=True)
    options.update(PICKING[settling])

    def run(compile):
        return speculative_generate(patched, draft, ids, mask, compile=compile,
                                    generator=torch.Generator().manual_seed(4), **options)

    calls = count_compiled_calls(monkeypatch, draft)
    eager, compiled = run(False), run(True)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.num_proposed, eager.num_proposed)
    assert torch.equal(compiled.num_accepted, eager.num_accepted)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs)
    # one target forward a round, in its round call; the drafts in one call of the draft
    rounds = calls[("target", "_verify_round")]
    assert rounds > 0 and calls[("target", "_forward")] == 0
    assert calls[("draft", "_drafts")] == rounds and calls[("draft", "_forward")] == 0


@pytest.mark.parametrize("proposer", ["draft_model", "prompt_lookup"])
def test_compiled_rounds_with_a_streamer_are_one_call(proposer, monkeypatch):
    """A streamer reads each round's tokens on the host; compiled, the round after its drafts is
    still one call of the target: the streamer gets what eager rounds stream, round by round, cut
    at max_new_tokens (inside a round), at an eos, and with penalties and sampling."""
    _, patched, draft = _pair("llama", True)
    ids, mask = ragged_prompts(1, 6, "left", seed=4)
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences[0, 6:].tolist()
    at = next(i for i in range(8, NEW) if free[i] not in free[:i])
    calls = count_compiled_calls(monkeypatch, draft)
    for options in (dict(max_new_tokens=13, eos_token_id=[]), dict(max_new_tokens=NEW, eos_token_id=free[at]),
                    dict(max_new_tokens=NEW, eos_token_id=[], temperature=0.9, repetition_penalty=1.3,
                         frequency_penalty=0.5)):
        streamed, outputs = [], []
        for compile in (False, True):
            streamer = RecordingStreamer()
            run = dict(speculate_k=3, compile=compile, streamer=streamer, generator=torch.Generator().manual_seed(2),
                       **options)
            calls.clear()
            if proposer == "draft_model":
                outputs.append(speculative_generate(patched, draft, ids, mask, **run).sequences)
            else:
                outputs.append(prompt_lookup_generate(patched, ids, mask, **run).sequences)
            streamed.append(streamer.puts)
            assert streamer.ended == 1 and torch.equal(torch.cat(streamer.puts[1:], dim=1), outputs[-1][:, 6:])
        assert torch.equal(outputs[0], outputs[1]), options
        assert len(streamed[0]) == len(streamed[1]) and all(map(torch.equal, *streamed)), options
        assert len(streamed[1]) < 2 + outputs[1].shape[1] - 6  # (rounds that emitted several tokens at once)
        assert calls[("target", "_verify_round")] == len(streamed[1]) - 2 and calls[("target", "_forward")] == 0
        new = outputs[1].shape[1] - 6
        if options["max_new_tokens"] == 13:
            assert new == 13
        elif options["eos_token_id"]:
            assert new < NEW and int(outputs[1][0, -1]) == options["eos_token_id"]


@pytest.mark.parametrize("settling", ["eos_held_back", "stops", "penalties_per_row"])
def test_a_hybrid_targets_compiled_rounds_verify_in_its_call(settling, monkeypatch):
    """A hybrid target (Qwen3.5: gated delta nets beside attention) and draft: the round after its
    drafts is one call of the target, its crop rolling each row's recurrent states back in the call,
    with generate's ways of picking and ending: tokens, acceptances and log-probabilities equal the
    eager rounds' from the same seed."""
    _, patched, draft = _pair("qwen3_5_text", True)
    ids, mask = ragged_prompts(3, 6, "left", seed=3)
    options = dict(max_new_tokens=NEW, speculate_k=3, eos_token_id=[], output_logprobs=True)
    options.update(PICKING[settling])
    calls = count_compiled_calls(monkeypatch, draft)
    eager, compiled = (speculative_generate(patched, draft, ids, mask, compile=compile,
                                            generator=torch.Generator().manual_seed(4), **options)
                       for compile in (False, True))
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.num_accepted, eager.num_accepted)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs)
    assert calls[("target", "_verify_round")] > 0 and calls[("target", "_forward")] == 0


@pytest.mark.parametrize("ending", ["limits", "eos", "eos_sampled"])
def test_lagged_watch_queues_rounds_before_the_last_ends(ending, monkeypatch):
    """Compiled rounds on a GPU ask whether every row has finished one round late (EndWatch,
    here run on the CPU): the next round is queued before the last one is read, unless the last
    could have ended every row at its limit. Rows ending at their limits (per-row) cost no extra
    round; one row ending at an eos costs one round past the end, in which no row is active. Either
    way tokens, counts and log-probabilities equal the eager rounds' and the rounds read at once."""
    _, patched, draft = _pair("llama", True)
    options = dict(speculate_k=3, output_logprobs=True,
                   **({"temperature": 0.9, "top_k": 30} if ending == "eos_sampled" else {}))
    if ending == "limits":
        ids, mask = ragged_prompts(3, 6, "left", seed=3)
        options.update(max_new_tokens=[NEW, NEW - 7, 13], eos_token_id=[])
    else:  # one row, its eos a token it first emits a few rounds in
        ids, mask = ragged_prompts(1, 6, "left", seed=3)
        free = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                    generator=torch.Generator().manual_seed(4), **options).sequences[0, 6:].tolist()
        at = next(i for i in range(8, NEW) if free[i] not in free[:i])
        options.update(max_new_tokens=NEW, eos_token_id=free[at])

    def run(compile):
        return speculative_generate(patched, draft, ids, mask, compile=compile,
                                    generator=torch.Generator().manual_seed(4), **options)

    calls = count_compiled_calls(monkeypatch, draft)
    eager, read_at_once = run(False), run(True)
    rounds_at_once = calls.pop(("target", "_verify_round"))
    monkeypatch.setattr(EndWatch, "LAGGED_DEVICES", ("cuda", "cpu"))
    unread = []  # per round: how many queued rounds were still unread when the next was queued
    another = EndWatch.another

    def watched(self):
        more = another(self)
        if more and self.lagged:
            unread.append(len(self.pending))
        return more

    monkeypatch.setattr(EndWatch, "another", watched)
    lagged = run(True)
    for out in (read_at_once, lagged):
        assert torch.equal(out.sequences, eager.sequences)
        assert torch.equal(out.num_proposed, eager.num_proposed)
        assert torch.equal(out.num_accepted, eager.num_accepted)
        torch.testing.assert_close(out.logprobs, eager.logprobs)
    if ending != "limits":
        assert int(eager.sequences[0, -1]) == options["eos_token_id"]  # (the row ended at its eos)
    assert calls[("target", "_verify_round")] == rounds_at_once + (ending != "limits")
    assert unread[0] == 0 and 1 in unread  # (the first round: nothing queued before it)
    if ending == "limits":
        assert 0 in unread[1:]  # near the limits the host waited for the last round


def test_new_round_values_reuse_the_compiled_verification():
    """Another temperature, top-k, top-p, min_new_tokens, per-row limit or output width is not
    another graph: the round's call takes them as tensors, and its state's buffers are the
    target's from call to call."""
    _, patched, draft = _pair("llama", True)
    ids, mask = ragged_prompts(2, 6, "left", seed=5)

    def run(temperature, top_k, top_p, min_new, limits, compile=True):
        return speculative_generate(patched, draft, ids, mask, max_new_tokens=limits, min_new_tokens=min_new,
                                    temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=[5],
                                    speculate_k=3, compile=compile, generator=torch.Generator().manual_seed(1))

    run(0.7, 5, 0.9, 2, [4, 6])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    states = [id(state) for state in patched._gptfast_round_state.values()]
    for values in ((1.3, 9, 0.8, 3, [9, 2]), ([0.5, 1.1], [3, None], [0.95, 0.6], [1, 4], [5, 3])):
        compiled, eager = run(*values), run(*values, compile=False)
        assert torch.equal(compiled.sequences, eager.sequences)
        assert torch.equal(compiled.num_accepted, eager.num_accepted)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert [id(state) for state in patched._gptfast_round_state.values()] == states


# (hybrids: their states roll back in the graph, each kind of one-pass block: Qwen3.5's gated delta nets, Bamba's
# Mamba-2 mixers, Jamba's Mamba mixers, LFM2's short convolutions, Kimi Linear's delta attention)
@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "bamba", "jamba", "lfm2", "kimi_linear"])
def test_compiled_rounds_give_the_same_tokens(family, monkeypatch):
    """Compiled rounds equal eager ones; a round's drafts are one call of the draft and the rest one
    call of the target, a hybrid's too (their forwards record the recurrent states, the crop in the
    target's call rolls each row's back to its committed tokens, the draft's commit its own)."""
    _, patched, draft = _pair(family, True)
    calls = count_compiled_calls(monkeypatch, draft)
    assert_compiled_rounds_equal_eager(patched, draft, ragged_prompts(2, 6, "left"))
    assert calls[("target", "_verify_round")] == calls[("draft", "_drafts")] > 0
    assert calls[("target", "_forward")] == calls[("draft", "_forward")] == 0


# how a drafter's compiled rounds are checked against eager ones (assert_compiled_rounds_draft_in_one_call): greedy;
# sampled, per-row temperature, with penalties; the eos held back (its id a token a small vocabulary makes often)
ONE_CALL_DRAFTING = {"greedy": {}, "eos_held_back": dict(eos_token_id=2, min_new_tokens=[4, 9]),
                     "sampled_penalised": dict(temperature=[0.8, 1.2], repetition_penalty=1.3,
                                               frequency_penalty=[0.0, 0.5])}


def assert_compiled_rounds_draft_in_one_call(monkeypatch, target, drafter, prompts, drafting: str, name: str):
    """Compiled, a round's k drafts are one call of ``drafter`` (its compiled function ``name``:
    its forwards and the picks between them; the penalties and the eos held back processed in the
    call) and the round after them one call of the target: the eager rounds' tokens and
    acceptances, from the same seed (``drafting``: ONE_CALL_DRAFTING's options, for two rows)."""
    ids, mask = prompts
    run = dict(max_new_tokens=NEW, speculate_k=3, **{"eos_token_id": [], **ONE_CALL_DRAFTING[drafting]})
    calls = count_compiled_calls(monkeypatch, drafter)
    outs = [speculative_generate(target, drafter, ids, mask, compile=compile,
                                 generator=torch.Generator().manual_seed(5), **run) for compile in (False, True)]
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    assert torch.equal(outs[1].num_accepted, outs[0].num_accepted) and 0 < outs[0].acceptance_rate < 1
    rounds = calls[("target", "_verify_round")]
    assert rounds > 0 and calls[("draft", name)] == rounds and calls[("target", "_forward")] == 0
    assert sum(calls.values()) == 2 * rounds  # (no draft step of its own)


def assert_compiled_rounds_equal_eager(target, draft_model, prompts):
    """Compiled rounds (k = 3, 12 new tokens after ``prompts``: (ids, mask)) give the eager
    rounds' tokens and acceptances; some drafts but not all were accepted (rounds rolled back)."""
    ids, mask = prompts
    eager = speculative_generate(target, draft_model, ids, mask, max_new_tokens=12, speculate_k=3, eos_token_id=[])
    compiled = speculative_generate(target, draft_model, ids, mask, max_new_tokens=12, speculate_k=3,
                                    eos_token_id=[], compile=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.num_accepted, eager.num_accepted)
    assert 0 < eager.acceptance_rate < 1
