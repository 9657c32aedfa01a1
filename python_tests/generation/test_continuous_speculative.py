"""SpeculativeBatcher: continuous batching whose steps are speculative rounds (a draft model, or
prompt lookup), with more requests than rows, ending at different rounds so that new ones take the
freed rows mid-batch. Each greedy request gets exactly the tokens generate gives its prompt alone
(ring-buffer, ALiBi, mixture-of-experts and hybrid families; int8 and compiled rounds), and with its
own options (penalties, min_new_tokens, stops, log-probabilities); sampled requests follow their own
arguments; what it cannot serve is refused, naming the argument."""

from types import SimpleNamespace

import pytest
import torch

from gptfast_kernels import SpeculativeBatcher, patch_model
from gptfast_kernels.generation import forward
from gptfast_kernels.generation.continuous_speculative import _DraftRows
from gptfast_kernels.generation.prompt_lookup import lookup_continuations
from gptfast_kernels.generation.speculative import SpeculativeRounds
from gptfast_kernels.generation.stopping import token_bytes
from python_tests.generation.test_continuous import LIMITS, _alone, _prompts
from python_tests.generation.test_speculative import assert_samples_follow_the_target
from python_tests.tiny_models import HYBRID, draft_of, patched_copy, tiny_model
from python_tests.tiny_tokenizers import byte_level_tokenizer, stop_string_from


def _draft(target, int8=False):
    """A patched draft of the target's first layer (first two for a hybrid, whose first layer alone
    may have no attention)."""
    return patched_copy(draft_of(target, 2 if target.config.model_type in HYBRID else 1), int8=int8)


def _serve(batcher, prompts, limits, **options):
    """Submits every prompt and steps until all ended -> ({id: tokens}, steps taken)."""
    for p, n in zip(prompts, limits):
        batcher.submit(p, max_new_tokens=n, **options)
    out, steps = {}, 0
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        steps += 1
    return out, steps


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mistral", "bloom", "qwen3_moe", "qwen3_5_text", "bamba",
                                    "lfm2", "mamba"])
def test_every_request_gets_what_generate_gives_its_prompt_alone(family, proposer, monkeypatch):
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)  # (ring-buffer layers: they wrap)
    target = tiny_model(family)
    model = patched_copy(target, int8=False)
    prompts = _prompts()
    eos = [_alone(model, prompts[1], 9, [])[1]]  # (a token some request makes: it ends early)
    batcher = SpeculativeBatcher(model, _draft(target) if proposer == "draft" else None, speculate_k=3,
                                 batch_size=3, max_length=24, eos_token_id=eos)
    out, steps = _serve(batcher, prompts, LIMITS, output_logprobs=True)
    for request, (prompt, limit) in enumerate(zip(prompts, LIMITS)):
        tokens, logprobs = _alone(model, prompt, limit, eos, logprobs=True)
        assert out[request] == tokens, (family, proposer, request)
        torch.testing.assert_close(torch.tensor(batcher.logprobs[request]), logprobs, atol=2e-4, rtol=1e-4)
    assert any(out[r][-1] == eos[0] and len(out[r]) < n for r, n in enumerate(LIMITS))  # (an eos ended one)
    assert steps < sum(LIMITS) and 0 <= batcher.num_accepted <= batcher.num_proposed and batcher.num_proposed > 0


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "bloom", "qwen3_moe"])
def test_prompts_split_across_rounds_give_generates_tokens(family, proposer, monkeypatch):
    """max_prefill_tokens: the parts of prompts ride in the rounds' forwards (the target's and the
    draft's), at most that many prompt tokens a step; every request still gets generate's tokens."""
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    target = tiny_model(family)
    model = patched_copy(target, int8=False)
    prompts = _prompts(10)
    eos = [_alone(model, prompts[1], 9, [])[1]]
    batcher = SpeculativeBatcher(model, _draft(target) if proposer == "draft" else None, speculate_k=3,
                                 batch_size=3, max_length=24, eos_token_id=eos, max_prefill_tokens=3)
    for p, n in zip(prompts, LIMITS):
        batcher.submit(p, max_new_tokens=n)
    out, taken = {}, []
    while batcher.waiting or batcher.running:
        before = {r.id: r.filled for r in batcher.rows if r is not None}
        out.update(batcher.step())
        taken.append(sum(r.filled - before.get(r.id, 0) for r in batcher.rows if r is not None))
    assert max(taken) == 3
    assert out == {i: _alone(model, p, n, eos) for i, (p, n) in enumerate(zip(prompts, LIMITS))}


@pytest.mark.parametrize("proposer", ["self", "draft", "lookup"])
def test_shared_prefixes_are_reused_in_rounds(proposer):
    """reuse_prefixes: a system prompt's keys and values copied (the draft's too) from the row that
    holds them; every request gets generate's tokens, and a draft that is the target itself is still
    always accepted (its copied rows hold what the target's do)."""
    target = tiny_model("llama", layers=2)
    model = patched_copy(target, int8=False)
    draft = {"self": lambda: patched_copy(target, int8=False), "draft": lambda: _draft(target),
             "lookup": lambda: None}[proposer]()
    g = torch.Generator().manual_seed(14)
    system = torch.randint(3, 97, (9,), generator=g).tolist()
    prompts = [system + torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 4, 1, 3, 5)]
    prompts[2:2] = [torch.randint(3, 97, (6,), generator=g).tolist()]  # (a row that held something else)
    limits = (11, 3, 2, 6, 2, 4)
    for budget in (None, 3):
        batcher = SpeculativeBatcher(model, draft, speculate_k=3, batch_size=2, max_length=28, eos_token_id=[],
                                     reuse_prefixes=True, max_prefill_tokens=budget)
        out, _ = _serve(batcher, prompts, limits)
        assert batcher.reused_tokens >= 9  # (at least one request took the system prompt)
        assert out == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, limits))}
        if proposer == "self":
            assert batcher.acceptance_rate == 1.0


def test_rounds_advance_rows_by_several_tokens():
    """A draft that is the target itself is always accepted: every round gives a request k + 1
    tokens (fewer where it ends), streamed as lists in last_tokens. New prompts ride in the round's
    forwards: one target forward a step."""
    target = tiny_model("llama", layers=2)
    model = patched_copy(target, int8=False)
    prompts = _prompts(6)
    batcher = SpeculativeBatcher(model, patched_copy(target, int8=False), speculate_k=3, batch_size=2,
                                 max_length=24, eos_token_id=[])
    for p, n in zip(prompts, LIMITS):
        batcher.submit(p, max_new_tokens=n)
    streamed, out, forwards = {}, {}, []
    model.register_forward_hook(lambda *_: forwards.append(1))
    while batcher.waiting or batcher.running:
        before = len(forwards)
        done = batcher.step()
        assert len(forwards) == before + 1
        for request, tokens in batcher.last_tokens.items():
            streamed.setdefault(request, []).extend(tokens)
            assert 1 <= len(tokens) <= 4
        out.update(done)
    assert batcher.acceptance_rate == 1.0 and batcher.num_proposed > 0
    assert streamed == out == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS))}


def test_lookup_reads_each_rows_own_text():
    """Prompt lookup's text per row is its current request's prompt and tokens (a row reused starts
    over): before every round, the proposals are lookup_continuations of exactly that."""
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9], [4, 8, 4, 8, 4], [11, 12, 13, 14, 11, 12], [20, 21]]
    batcher = SpeculativeBatcher(model, speculate_k=3, batch_size=2, max_length=24, eos_token_id=[])
    for p, n in zip(prompts, (5, 9, 4, 7, 6)):
        batcher.submit(p, max_new_tokens=n)
    rounds = 0
    while batcher.waiting or batcher.running:
        proposer = batcher.proposer
        for b, request in enumerate(batcher.rows):
            if request is not None:
                text = request.prompt + request.tokens
                assert proposer.lengths[b] == len(text) and proposer.text[b, :len(text)].tolist() == text
                assert (proposer.text[b, len(text):] == -1).all()
                want = lookup_continuations(torch.tensor([text]), torch.tensor([len(text)]), 3, 3)
                got, _ = proposer.propose(SimpleNamespace(k=3, greedy=True), None, None, None)
                assert got[b].tolist() == want[0].tolist()
                rounds += 1
        batcher.step()
    assert rounds > len(prompts)


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_each_request_gets_generate_with_its_own_options(proposer):
    """Penalties (the drafts before each position counted), min_new_tokens, stop sequences, stop
    strings and log-probabilities per request: each equals generate on its prompt alone."""
    tokenizer = byte_level_tokenizer()
    pieces = token_bytes(tokenizer)
    target = tiny_model("llama", layers=3)
    model = patched_copy(target, int8=False)
    prompts = _prompts(3)
    free = [_alone(model, p, 12, []) for p in prompts]
    eos = [free[0][1]]
    options = [dict(repetition_penalty=1.5), dict(presence_penalty=0.7, frequency_penalty=0.4),
               dict(stop_sequences=[free[2][3:5]]), dict(stop_strings=[stop_string_from(pieces, free[3])]),
               dict(min_new_tokens=5, stop_sequences=[[free[4][1]]]),
               dict(repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=2.0, min_new_tokens=2), dict()]
    batcher = SpeculativeBatcher(model, _draft(target) if proposer == "draft" else None, speculate_k=3,
                                 batch_size=3, max_length=28, eos_token_id=eos, tokenizer=tokenizer)
    for p, o in zip(prompts, options):
        batcher.submit(p, max_new_tokens=12, output_logprobs=True, **o)
    out, streamed = {}, {}
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        for request, logprobs in batcher.last_logprobs.items():
            streamed.setdefault(request, []).extend(logprobs)
    assert streamed == batcher.logprobs
    for request, o in enumerate(options):
        tokens, logprobs = _alone(model, prompts[request], 12, eos, logprobs=True,
                                  tokenizer=tokenizer if "stop_strings" in o else None, **o)
        assert out[request] == tokens, (request, o)
        torch.testing.assert_close(torch.tensor(batcher.logprobs[request]), logprobs, atol=2e-4, rtol=1e-4)
    assert any(len(t) < 12 for t in out.values())


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_min_new_tokens_holds_the_eos_back_exactly_that_long(proposer):
    """An eos the target makes first as new token j: with min_new_tokens j it ends the request there
    (inside a round), with j + 1 it is held back; both as generate gives them."""
    target = tiny_model("llama", layers=3)
    model = patched_copy(target, int8=False)
    prompt = _prompts(7)[0]
    free = _alone(model, prompt, 14, [])
    j = next(j for j in range(2, len(free)) if free.index(free[j]) == j)
    eos = [free[j]]
    batcher = SpeculativeBatcher(model, _draft(target) if proposer == "draft" else None, speculate_k=3,
                                 batch_size=2, max_length=28, eos_token_id=eos)
    for least in (0, j, j + 1):
        batcher.submit(prompt, max_new_tokens=14, min_new_tokens=least)
    out = batcher.run()
    assert out[0] == out[1] == free[:j + 1] and len(out[2]) > j + 1
    assert out[2] == _alone(model, prompt, 14, eos, min_new_tokens=j + 1)


def test_sampled_requests_beside_greedy_ones():
    """Greedy requests in a batch with sampled ones (verified by sampling, their distributions
    one-hot) still get generate's tokens; top-k 1 samples the greedy tokens; the others sample."""
    target = tiny_model("llama", layers=2)
    model = patched_copy(target, int8=False)
    prompts = _prompts(2)
    settings = [dict(), dict(temperature=0.9, top_k=1), dict(temperature=1.5), dict(temperature=0.7, top_p=0.9),
                dict(), dict(temperature=2.0, min_p=0.1), dict(temperature=1.0, top_k=1)]
    for proposer in ("draft", "lookup"):
        batcher = SpeculativeBatcher(model, _draft(target) if proposer == "draft" else None, speculate_k=3,
                                     batch_size=3, max_length=24, eos_token_id=[],
                                     generator=torch.Generator().manual_seed(0))
        for p, n, s in zip(prompts, LIMITS, settings):
            batcher.submit(p, max_new_tokens=n, **s)
        out = batcher.run()
        for i, (p, n, s) in enumerate(zip(prompts, LIMITS, settings)):
            if not s or s.get("top_k") == 1:
                assert out[i] == _alone(model, p, n, []), (proposer, i, s)
            assert len(out[i]) == n and all(0 <= t < 97 for t in out[i])
        assert any(out[i] != _alone(model, prompts[i], LIMITS[i], []) for i in (2, 5)), proposer


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_sampled_requests_follow_the_target_distribution(proposer):
    """6000 requests of one prompt, 3 new tokens each, through 500 rows with a draft that disagrees
    with the target (or prompt lookup): the first token is sampled after the prompt's forward, the
    others in rounds; the joint distribution of (t1, t2, t3) fits the target's exact one."""
    vocab, requests, steps, temperature = 6, 6000, 3, 1.0
    target = patched_copy(tiny_model("llama", vocab=vocab, seed=1), int8=False)
    draft = patch_model(tiny_model("llama", vocab=vocab, layers=2, seed=2), int8=False) if proposer == "draft" else None
    batcher = SpeculativeBatcher(target, draft, speculate_k=2, batch_size=500, max_length=8, eos_token_id=[],
                                 generator=torch.Generator().manual_seed(0))
    for _ in range(requests):
        batcher.submit([2, 3], max_new_tokens=steps, temperature=temperature)
    out = batcher.run()
    assert 0.05 < batcher.acceptance_rate < 0.95
    tokens = torch.tensor([out[i] for i in range(requests)])
    assert_samples_follow_the_target(target, torch.tensor([[2, 3]]), tokens, vocab, temperature)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_int8_and_compiled_rounds_give_the_eager_tokens(family, monkeypatch):
    """Compiled rounds (a hybrid's too: its drafts and its round after them each one call, the
    recurrent states rolled back in them) give the eager rounds' tokens and acceptances."""
    from python_tests.generation.test_speculative import count_compiled_calls

    target = tiny_model(family, layers=3)
    model = patched_copy(target, int8=True)
    draft = _draft(target, int8=True)
    prompts = _prompts(1)
    calls = count_compiled_calls(monkeypatch, draft)
    runs, accepted = [], []
    for compile in (False, True):
        batcher = SpeculativeBatcher(model, draft, speculate_k=2, batch_size=2, max_length=20, eos_token_id=[],
                                     compile=compile)
        runs.append(_serve(batcher, prompts, LIMITS)[0])
        accepted.append((batcher.num_accepted, batcher.num_proposed))
    assert runs[0] == runs[1]
    # the same drafts too: compiled rounds draft in one call (a round that takes new prompts in: after
    # its first draft forward)
    assert accepted[0] == accepted[1]
    assert runs[0] == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS))}
    assert calls[("target", "_verify_going")] == calls[("draft", "_drafts")] > 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_compiled_rounds_are_a_drafts_call_and_a_targets_call(sampled, monkeypatch):
    """Compiled, a round's drafts with the requests' penalties and eos held back (per row: a request
    without them beside ones with) are one call of the draft, processed in the call, and the rest
    of the round one call of the target (its forward, the penalties, verification, the crop, the
    record, the log-probabilities); a round that takes new prompts in makes each call after that
    model's first forward, run on its own. The eager batcher's tokens, log-probabilities and
    acceptances (sampled: from the same seed, with per-request temperatures and filters), and each
    greedy request equals generate on its prompt alone."""
    from python_tests.generation.test_speculative import count_compiled_calls

    target = tiny_model("llama", layers=3)
    model = patched_copy(target, int8=False)
    draft = _draft(target)
    prompts = _prompts(5)
    free = [_alone(model, p, 12, []) for p in prompts]
    eos = [free[0][1]]
    options = [dict(repetition_penalty=1.5, min_new_tokens=3), dict(presence_penalty=0.7, frequency_penalty=0.4),
               dict(), dict(repetition_penalty=0.8, frequency_penalty=1.0, min_new_tokens=6), dict(min_new_tokens=2)]
    if sampled:
        for o, sampling in zip(options, [dict(temperature=0.8), dict(temperature=1.2, top_k=20), dict(),
                                         dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.05)]):
            o.update(sampling)
    calls = count_compiled_calls(monkeypatch, draft)
    stepped = {"merges": 0, "rounds": 0, "step_by_step": 0}  # (step_by_step: rounds that draft a step a forward)

    def counted(function, key):
        def wrapper(*args, **kwargs):
            stepped[key] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(_DraftRows, "merge", counted(_DraftRows.merge, "merges"))
    monkeypatch.setattr(SpeculativeRounds, "draft", counted(SpeculativeRounds.draft, "step_by_step"))
    monkeypatch.setattr(SpeculativeBatcher, "_round", counted(SpeculativeBatcher._round, "rounds"))
    runs, logprobs, accepted = [], [], []
    for compile in (False, True):
        batcher = SpeculativeBatcher(model, draft, speculate_k=3, batch_size=3, max_length=28, eos_token_id=eos,
                                     compile=compile, generator=torch.Generator().manual_seed(7))
        for p, o in zip(prompts, options):
            batcher.submit(p, max_new_tokens=12, output_logprobs=True, **o)
        stepped.update(merges=0, rounds=0, step_by_step=0)
        calls.clear()
        runs.append(batcher.run())
        logprobs.append(batcher.logprobs)
        accepted.append((batcher.num_accepted, batcher.num_proposed))
    assert runs[0] == runs[1] and accepted[0] == accepted[1]
    for request in runs[0]:
        torch.testing.assert_close(torch.tensor(logprobs[1][request]), torch.tensor(logprobs[0][request]))
    if not sampled:
        for request, o in enumerate(options):
            assert runs[1][request] == _alone(model, prompts[request], 12, eos, **o), (request, o)
    # compiled: every round's drafts in one call of the draft and the rest in one call of the target;
    # a round that takes prompts in runs each model's first forward, as wide as they are, before its call
    assert stepped["merges"] > 0 and stepped["step_by_step"] == 0 and calls[("draft", "_forward")] == 0
    assert calls[("draft", "_drafts")] + calls[("draft", "_drafts_after")] == stepped["rounds"]
    assert calls[("target", "_verify_going")] == calls[("draft", "_drafts")] > 0
    assert calls[("target", "_verified_going")] == calls[("draft", "_drafts_after")] == stepped["merges"]


def test_what_it_cannot_serve_is_refused():
    target = tiny_model("llama")
    model = patched_copy(target, int8=False)
    with pytest.raises(ValueError, match="speculate_k"):
        SpeculativeBatcher(model, speculate_k=0)
    with pytest.raises(ValueError, match="max_ngram_size"):
        SpeculativeBatcher(model, max_ngram_size=0)
    with pytest.raises(ValueError, match="draft_model.*not patched"):
        SpeculativeBatcher(model, draft_of(target))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeBatcher(model, patched_copy(tiny_model("llama", vocab_size=64), int8=False))
    with pytest.raises(ValueError, match="batch_size"):
        SpeculativeBatcher(model, batch_size=0)
    batcher = SpeculativeBatcher(model, speculate_k=2, batch_size=2, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        batcher.submit([3] * 8, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^SpeculativeBatcher\.submit: top_p"):  # (its own name, not its base's)
        batcher.submit([3], max_new_tokens=2, temperature=1.0, top_p=1.5)
    with pytest.raises(KeyError, match=r"SpeculativeBatcher\.cancel: request_id 7"):
        batcher.cancel(7)
    assert batcher.run() == {} and not batcher.waiting
    # a draft whose embeddings are narrower than the target's (both heads 81 wide): prompts must fit both
    wide = patched_copy(tiny_model("apertus1p5_text"), int8=False)  # 97 input ids
    narrow = patched_copy(tiny_model("llama", vocab=wide.config.output_vocab_size), int8=False)
    batcher = SpeculativeBatcher(wide, narrow, speculate_k=2, batch_size=1, max_length=10)
    with pytest.raises(ValueError, match=r"prompt_ids .* \[0, 81\)"):
        batcher.submit([4, 85, 9], max_new_tokens=2)
    assert batcher.run() == {} and not batcher.waiting


def test_default_max_length_fits_a_learned_position_table():
    """A batcher's max_length defaults to 2048, or to what GPT-2's learned positions (n_positions)
    leave past a round's drafts; a larger one is refused up front, naming it (requests failed inside
    the embedding mid-serving). Requests up to the default are served as generate serves them."""
    from gptfast_kernels import ContinuousBatcher, generate

    model = tiny_model("gpt2", n_positions=16)
    patched, draft = patched_copy(model, int8=False), patched_copy(draft_of(model), int8=False)
    assert ContinuousBatcher(patched).max_length == 16
    assert ContinuousBatcher(tiny_patched := patched_copy(tiny_model("llama"), int8=False)).max_length == 2048
    assert SpeculativeBatcher(tiny_patched, speculate_k=3).max_length == 2048
    # a draft with a smaller table than the target's bounds the default too
    short_draft = patched_copy(tiny_model("gpt2", n_positions=12), int8=False)
    assert SpeculativeBatcher(patched, short_draft, speculate_k=3).max_length == 9
    batcher = SpeculativeBatcher(patched, draft, speculate_k=3, eos_token_id=[])
    assert batcher.max_length == 13
    prompt = list(range(3, 11))
    request = batcher.submit(prompt, max_new_tokens=6)  # 8 + 6 - 1 = 13 slots
    want = generate(patched, torch.tensor([prompt]), max_new_tokens=6, eos_token_id=[]).sequences[0, 8:]
    assert batcher.run()[request] == want.tolist()
    for make in (lambda: ContinuousBatcher(patched, max_length=17), lambda: SpeculativeBatcher(patched, max_length=14,
                                                                                                speculate_k=3)):
        with pytest.raises(ValueError, match="max_length.*position table holds"):
            make()
