"""ContinuousBatcher: more requests than rows, of different lengths and limits, ending at different
steps (eos or their own limit) so that new ones take the freed rows mid-batch: each greedy request
gets exactly the tokens generate gives its prompt alone (families with ring-buffer layers, ALiBi and
attention of their own included; hybrid models' recurrent states per row; int8 and compiled steps
too), and its log-probabilities; each request samples with its own arguments; what it cannot serve
is refused, naming the argument."""

import pytest
import torch

from gptfast_kernels import generate
from gptfast_kernels.generation import forward
from gptfast_kernels.generation.continuous import ContinuousBatcher
from gptfast_kernels.generation.stopping import token_bytes
from python_tests.tiny_models import HYBRID, patched_copy, tiny_model
from python_tests.tiny_tokenizers import byte_level_tokenizer, stop_string_from

LENGTHS = (5, 9, 3, 7, 4, 6, 8)
LIMITS = (6, 3, 9, 4, 7, 5, 2)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


def _alone(model, prompt, limit, eos, *, logprobs=False, **kwargs):
    """generate's new tokens for one prompt alone, up to (and with) the eos that ended it (with
    ``logprobs``: and their log-probabilities, as a tensor)."""
    out = generate(model, torch.tensor([prompt]), max_new_tokens=limit, eos_token_id=eos, output_logprobs=logprobs,
                   **kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    tokens = next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)
    return (tokens, out.logprobs[0, :len(tokens)]) if logprobs else tokens


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "mistral", "bloom", "falcon", "xglm", "qwen3_moe"])
def test_every_request_gets_what_generate_gives_its_prompt_alone(family, monkeypatch):
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)  # (ring-buffer layers of WINDOW + 2 slots: they wrap)
    model = patched_copy(tiny_model(family), int8=False)
    prompts = _prompts()
    eos = [_alone(model, prompts[1], 9, [])[1]]  # (a token some request makes: it ends early)
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos)
    ids = [batcher.submit(p, max_new_tokens=n) for p, n in zip(prompts, LIMITS)]
    assert batcher.cache.has_ring_layers == (family in ("gemma3_text", "mistral"))
    steps, out = 0, {}
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        steps += 1
    assert steps < sum(LIMITS)  # (rows were shared: requests ran side by side)
    for request, prompt, limit in zip(ids, prompts, LIMITS):
        assert out[request] == _alone(model, prompt, limit, eos), (family, request)
    assert any(out[r][-1] == eos[0] and len(out[r]) < n for r, n in zip(ids, LIMITS))  # (an eos ended one)


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_requests_get_what_generate_gives_their_prompts_alone(family):
    """Recurrent states per row: a step that takes new prompts runs the going rows' tokens first, then
    the prompts in emptied rows (their states zeroed) with the going rows' states kept through it.
    Tokens and log-probabilities equal generate's on each prompt alone (a state decayed by padding,
    or left over from a row's last request, would change the log-probabilities even where a tiny
    model's argmax holds)."""
    model = patched_copy(tiny_model(family), int8=False)
    prompts = _prompts(4)
    eos = [_alone(model, prompts[1], 9, [])[1]]
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos)
    for p, n in zip(prompts, LIMITS):
        batcher.submit(p, max_new_tokens=n, output_logprobs=True)
    out, mixed = {}, 0
    while batcher.waiting or batcher.running:
        waiting = len(batcher.waiting)
        out.update(batcher.step())
        mixed += len(batcher.waiting) < waiting and batcher.running > waiting - len(batcher.waiting)
    assert mixed  # (some step took new prompts while other rows were going)
    for request, (prompt, limit) in enumerate(zip(prompts, LIMITS)):
        tokens, logprobs = _alone(model, prompt, limit, eos, logprobs=True)
        assert out[request] == tokens, (family, request)
        torch.testing.assert_close(torch.tensor(batcher.logprobs[request]), logprobs, atol=2e-4, rtol=1e-4)


def test_logprobs_are_generates_and_stream():
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompts = _prompts(5)
    batcher = ContinuousBatcher(model, batch_size=2, max_length=24, eos_token_id=[])
    for i, (p, n) in enumerate(zip(prompts, LIMITS)):
        batcher.submit(p, max_new_tokens=n, output_logprobs=i % 2 == 0)
    streamed = {}
    while batcher.waiting or batcher.running:
        batcher.step()
        assert set(batcher.last_logprobs) == {r for r in batcher.last_tokens if r % 2 == 0}
        for request, logprob in batcher.last_logprobs.items():
            streamed.setdefault(request, []).append(logprob)
    assert set(batcher.logprobs) == set(streamed) == {0, 2, 4, 6}
    for request in streamed:
        assert batcher.logprobs[request] == streamed[request]
        _, want = _alone(model, prompts[request], LIMITS[request], [], logprobs=True)
        torch.testing.assert_close(torch.tensor(streamed[request]), want, atol=2e-4, rtol=1e-4)


def test_each_request_gets_generate_with_its_own_options():
    """Penalties, min_new_tokens, stop sequences and stop strings per request: each equals generate on
    its prompt alone with those options (rows that held other requests' records before included)."""
    tokenizer = byte_level_tokenizer()
    pieces = token_bytes(tokenizer)
    model = patched_copy(tiny_model("llama", layers=3), int8=False)
    prompts = _prompts(3)
    free = [_alone(model, p, 12, []) for p in prompts]
    eos = [free[0][1]]
    options = [dict(repetition_penalty=1.5), dict(presence_penalty=0.7, frequency_penalty=0.4),
               dict(stop_sequences=[free[2][3:5]]), dict(stop_strings=[stop_string_from(pieces, free[3])]),
               dict(min_new_tokens=5, stop_sequences=[[free[4][1]]]),  # (a stop held back: it comes at 1)
               dict(repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=2.0, min_new_tokens=2), dict()]
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos, tokenizer=tokenizer)
    for p, o in zip(prompts, options):
        batcher.submit(p, max_new_tokens=12, **o)
    streamed = {}
    while batcher.waiting or batcher.running:
        out = batcher.step()
        for request, token in batcher.last_tokens.items():
            streamed.setdefault(request, []).append(token)
        for request, tokens in out.items():
            assert streamed[request] == tokens  # (last_tokens streamed every token)
            o = options[request]
            want = _alone(model, prompts[request], 12, eos, tokenizer=tokenizer if "stop_strings" in o else None, **o)
            assert tokens == want, (request, o)
    assert len(streamed) == len(prompts) and any(len(t) < 12 for t in streamed.values())


@pytest.mark.parametrize("speculative", [False, True])
def test_compiled_calls_between_steps_leave_a_batchers_rows_alone(speculative):
    """A compiled batcher's caches are its own while it lives: compiled generate (speculative_generate
    with the speculative batcher's draft model, whose cache the model keeps too) called between its
    steps, at its batch size and at a smaller one, takes caches of its own, and every request still
    gets the tokens generate gives its prompt alone."""
    from gptfast_kernels import SpeculativeBatcher, speculative_generate
    from python_tests.tiny_models import draft_of, ragged_prompts

    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    draft = patched_copy(draft_of(model, 1), int8=False)
    prompts = _prompts(2)[:4]
    if speculative:
        batcher = SpeculativeBatcher(model, draft, speculate_k=2, batch_size=2, max_length=20, eos_token_id=[],
                                     compile=True)
    else:
        batcher = ContinuousBatcher(model, batch_size=2, max_length=20, eos_token_id=[], compile=True)
    for p, n in zip(prompts, LIMITS):
        batcher.submit(p, max_new_tokens=n)
    out = {**batcher.step(), **batcher.step()}
    ids, mask = ragged_prompts(2, 6, "left", seed=4)
    for B in (2, 1):
        if speculative:
            speculative_generate(model, draft, ids[:B], mask[:B], max_new_tokens=5, eos_token_id=[], compile=True)
        else:
            generate(model, ids[:B], mask[:B], max_new_tokens=5, eos_token_id=[], compile=True)
    out.update(batcher.run())
    assert out == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS))}


@pytest.mark.parametrize("speculative", [False, True])
def test_a_batcher_kept_alive_by_a_caught_error_hands_its_caches_on(speculative):
    """A batcher one of whose calls raised an error that was caught (as pytest.raises does, keeping
    the error) lives on after its last reference goes, in a reference cycle (the error's traceback
    holds the frame of the call, which holds the batcher), until the collector runs: the next
    compiled batcher on the model still gets the model's kept caches (the collector is run when a
    holder is found alive), not caches of its own that would move the CUDA graphs' inputs."""
    import gc
    import weakref

    from gptfast_kernels import SpeculativeBatcher
    from python_tests.tiny_models import draft_of

    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    draft = patched_copy(draft_of(model, 1), int8=False) if speculative else None

    def make():
        if speculative:
            return SpeculativeBatcher(model, draft, speculate_k=2, batch_size=2, max_length=20, eos_token_id=[],
                                      compile=True)
        return ContinuousBatcher(model, batch_size=2, max_length=20, eos_token_id=[], compile=True)

    def addresses(batcher) -> list[int]:  # (where its caches' first keys live: the target's, the draft's)
        caches = [batcher.cache] + (batcher.proposer.caches if speculative else [])
        return [c.layers[0].keys.data_ptr() for c in caches]

    def refused():  # -> a weak reference to a batcher whose caught error keeps it alive
        batcher = make()
        with pytest.raises(ValueError, match="prompt_ids") as caught:
            batcher.submit([], max_new_tokens=3)
        assert caught.traceback  # (kept with the error: the frames, the batcher's among them)
        return weakref.ref(batcher), addresses(batcher)

    enabled = gc.isenabled()
    gc.disable()  # (so that only cache_for's own collection frees it)
    try:
        first, caches = refused()
        assert first() is not None  # (alive: in the cycle)
        second = make()
        assert first() is None
        assert addresses(second) == caches
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_int8_and_compiled_steps_give_the_eager_tokens(family):
    model = patched_copy(tiny_model(family, layers=3), int8=True)
    prompts = _prompts(1)
    runs = []
    for compile in (False, True):
        batcher = ContinuousBatcher(model, batch_size=2, max_length=20, eos_token_id=[], compile=compile)
        for p, n in zip(prompts, LIMITS):
            batcher.submit(p, max_new_tokens=n)
        runs.append(batcher.run())
    assert runs[0] == runs[1]
    assert runs[0] == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS))}


def test_each_request_samples_with_its_own_arguments():
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompts = _prompts(2)
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=[],
                                generator=torch.Generator().manual_seed(0))
    settings = [dict(), dict(temperature=0.9, top_k=1), dict(temperature=1.5), dict(temperature=0.7, top_p=0.9),
                dict(), dict(temperature=2.0, min_p=0.1), dict(temperature=1.0, top_k=1)]
    for p, n, s in zip(prompts, LIMITS, settings):
        batcher.submit(p, max_new_tokens=n, **s)
    out = batcher.run()
    for i, (p, n, s) in enumerate(zip(prompts, LIMITS, settings)):
        greedy = _alone(model, p, n, [])
        if not s or s.get("top_k") == 1:  # greedy, or sampling from the top token alone
            assert out[i] == greedy, (i, s)
        assert len(out[i]) == n and all(0 <= t < 97 for t in out[i])
    assert any(out[i] != _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS)) if i in (2, 5))


@pytest.mark.parametrize("kind", ["continuous", "speculative"])
def test_a_cancelled_request_frees_its_row(kind):
    """cancel: a running request ends at once with the tokens it had (a prefix of generate's), a
    waiting one never starts; the others still get generate's tokens, one taking the freed row."""
    from gptfast_kernels import SpeculativeBatcher

    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompts = _prompts(8)
    make = SpeculativeBatcher if kind == "speculative" else ContinuousBatcher
    batcher = make(model, batch_size=2, max_length=24, eos_token_id=[])
    ids = [batcher.submit(p, max_new_tokens=9) for p in prompts[:4]]
    batcher.step()
    batcher.step()
    running = [r.id for r in batcher.rows if r is not None]
    assert running == ids[:2]
    had = batcher.cancel(ids[0])
    assert batcher.cancel(ids[3]) == []
    assert 0 < len(had) < 9 and had == _alone(model, prompts[0], 9, [])[:len(had)]
    with pytest.raises(KeyError, match="request_id"):
        batcher.cancel(ids[3])
    out = batcher.run()
    assert set(out) == {ids[1], ids[2]}
    assert out == {i: _alone(model, prompts[i], 9, []) for i in (1, 2)}


def test_what_it_cannot_serve_is_refused():
    model = patched_copy(tiny_model("llama"), int8=False)
    batcher = ContinuousBatcher(model, batch_size=2, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        batcher.submit([3] * 8, max_new_tokens=4)  # 11 slots
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit([], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit([3, 97], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit(torch.ones(2, 2, dtype=torch.int64), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batcher.submit([3], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        batcher.submit([3], max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="presence_penalty"):
        batcher.submit([3], max_new_tokens=2, presence_penalty=float("nan"))
    with pytest.raises(ValueError, match="stop_sequences"):
        batcher.submit([3], max_new_tokens=2, stop_sequences=[[]])
    with pytest.raises(ValueError, match="tokenizer"):
        batcher.submit([3], max_new_tokens=2, stop_strings=["x"])  # (this batcher has no tokenizer)
    with pytest.raises(ValueError, match="min_new_tokens"):
        batcher.submit([3], max_new_tokens=2, min_new_tokens=-1)
    with pytest.raises(ValueError, match="batch_size"):
        ContinuousBatcher(model, batch_size=0)
    with pytest.raises(ValueError, match="not patched"):
        ContinuousBatcher(tiny_model("llama"))
    with pytest.raises(ValueError, match="output_logprobs"):
        batcher.submit([3], max_new_tokens=2, output_logprobs="yes")
    assert batcher.run() == {} and not batcher.waiting  # (nothing was queued by the refusals)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "bloom", "falcon", "qwen3_moe"])
@pytest.mark.parametrize("budget", [1, 4])
def test_prompts_split_across_steps_give_generates_tokens(family, budget, monkeypatch):
    """max_prefill_tokens: a step's forward takes at most that many prompt tokens, so prompts go in
    over several steps beside the going rows; every request still gets generate's tokens (ring
    buffers that wrap, ALiBi, attention of its own, experts)."""
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    model = patched_copy(tiny_model(family), int8=False)
    prompts = _prompts()
    eos = [_alone(model, prompts[1], 9, [])[1]]
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos, max_prefill_tokens=budget)
    for p, n in zip(prompts, LIMITS):
        batcher.submit(p, max_new_tokens=n, output_logprobs=True)
    out, widest = {}, []
    while batcher.waiting or batcher.running:
        before = {r.id: r.filled for r in batcher.rows if r is not None}
        out.update(batcher.step())
        taken = sum(r.filled - before.get(r.id, 0) for r in batcher.rows if r is not None)
        widest.append(taken)
    assert max(widest) == budget  # (never more prompt tokens a step than the budget, and some step used it all)
    for request, (prompt, limit) in enumerate(zip(prompts, LIMITS)):
        tokens, logprobs = _alone(model, prompt, limit, eos, logprobs=True)
        assert out[request] == tokens, (family, budget, request)
        torch.testing.assert_close(torch.tensor(batcher.logprobs[request]), logprobs, atol=2e-4, rtol=1e-4)


def test_going_rows_decode_while_a_long_prompt_goes_in():
    """A running request gets a token every step while a 20-token prompt goes in 4 tokens a step;
    the long request's first token comes after its fifth step."""
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    short, long = _prompts(9)[0], torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    batcher = ContinuousBatcher(model, batch_size=2, max_length=40, eos_token_id=[], max_prefill_tokens=4)
    first = batcher.submit(short, max_new_tokens=12)
    while first not in batcher.last_tokens:  # (its prompt in, and its first token)
        batcher.step()
    second = batcher.submit(long, max_new_tokens=3)
    for step in range(7):
        batcher.step()
        assert first in batcher.last_tokens
        assert (second in batcher.last_tokens) == (step >= 5), step
    out = batcher.run()
    assert out == {first: _alone(model, short, 12, []), second: _alone(model, long, 3, [])}


def test_hybrids_refuse_split_prompts():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        ContinuousBatcher(patched_copy(tiny_model("qwen3_5_text"), int8=False), batch_size=2, max_length=8,
                          max_prefill_tokens=4)


def _tokens_run(batcher):
    """A list to which each of ``batcher``'s forwards appends its real input tokens (the going rows'
    tokens and the parts of prompts)."""
    counts, run = [], batcher._run

    def counted(model, cache, step, going, spans, kept=()):
        counts.append(len(going) + sum(stop - start for start, stop in spans.values()))
        return run(model, cache, step, going, spans, kept)
    batcher._run = counted
    return counts


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom", "qwen3_moe"])
@pytest.mark.parametrize("budget", [None, 4])
def test_shared_prefixes_are_reused_and_give_generates_tokens(family, budget):
    """reuse_prefixes: requests that share a system prompt (and one that repeats an earlier prompt
    whole) take its keys and values from the row that holds them, a running or an ended request's,
    or their own row's; each still gets generate's tokens and log-probabilities, and the forwards
    run exactly the reused prompt tokens fewer."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 97, (9,), generator=g).tolist()
    prompts = [system + torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 4, 1, 3, 5)]
    prompts.append(list(prompts[1]))  # (the same prompt again)
    prompts.append(torch.randint(3, 97, (6,), generator=g).tolist())  # (nothing to share)
    limits = (5, 3, 6, 2, 4, 3, 5)
    runs = {}
    for reuse in (False, True):
        model = patched_copy(tiny_model(family), int8=False)
        batcher = ContinuousBatcher(model, batch_size=2, max_length=24, eos_token_id=[], max_prefill_tokens=budget,
                                    reuse_prefixes=reuse)
        counts = _tokens_run(batcher)
        for p, n in zip(prompts, limits):
            batcher.submit(p, max_new_tokens=n, output_logprobs=True)
        out = batcher.run()
        runs[reuse] = (sum(counts), batcher.reused_tokens)
        for i, (p, n) in enumerate(zip(prompts, limits)):
            tokens, logprobs = _alone(model, p, n, [], logprobs=True)
            assert out[i] == tokens, (family, budget, reuse, i)
            torch.testing.assert_close(torch.tensor(batcher.logprobs[i]), logprobs, atol=2e-4, rtol=1e-4)
    assert runs[False][1] == 0 and runs[True][1] >= 3 * 9  # (the three later system-prompt requests at least)
    assert runs[False][0] - runs[True][0] == runs[True][1]


def test_a_repeated_prompt_keeps_its_own_rows_keys():
    """One row: the same prompt again keeps all but its last token in place (its own row), and a
    prompt that shares only a start keeps that start."""
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompt = _prompts(12)[1]
    batcher = ContinuousBatcher(model, batch_size=1, max_length=24, eos_token_id=[], reuse_prefixes=True)
    for p in (prompt, prompt, prompt[:4] + [5, 6]):
        batcher.submit(p, max_new_tokens=4)
    out = batcher.run()
    assert batcher.reused_tokens == len(prompt) - 1 + 4
    assert out == {i: _alone(model, p, 4, []) for i, p in enumerate((prompt, prompt, prompt[:4] + [5, 6]))}


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_prefix_is_copied_from_a_running_row(family):
    """A new request in a row that held something else takes the system prompt from the row of a
    running request: keys and values (a latent-attention cache's one latent) copied."""
    model = patched_copy(tiny_model(family), int8=False)
    g = torch.Generator().manual_seed(13)
    system = torch.randint(3, 97, (9,), generator=g).tolist()
    prompts = [system + [4, 5], torch.randint(3, 97, (6,), generator=g).tolist(), system + [7, 8, 9]]
    limits = (12, 2, 5)
    batcher = ContinuousBatcher(model, batch_size=2, max_length=24, eos_token_id=[], reuse_prefixes=True)
    for p, n in zip(prompts, limits):
        batcher.submit(p, max_new_tokens=n, output_logprobs=True)
    out = batcher.run()
    assert batcher.reused_tokens == 9
    for i, (p, n) in enumerate(zip(prompts, limits)):
        tokens, logprobs = _alone(model, p, n, [], logprobs=True)
        assert out[i] == tokens, i
        torch.testing.assert_close(torch.tensor(batcher.logprobs[i]), logprobs, atol=2e-4, rtol=1e-4)


def test_prefix_reuse_is_refused_where_positions_do_not_stay():
    with pytest.raises(ValueError, match="reuse_prefixes"):
        ContinuousBatcher(patched_copy(tiny_model("qwen3_5_text"), int8=False), batch_size=2, max_length=8,
                          reuse_prefixes=True)
    with pytest.raises(ValueError, match="reuse_prefixes"):
        ContinuousBatcher(patched_copy(tiny_model("llama"), int8=False), batch_size=2, reuse_prefixes="yes")


@pytest.mark.parametrize("family,sampled", [("llama", False), ("llama", True), ("mistral", True),
                                            ("qwen3_5_text", False), ("qwen3_5_text", True)])
def test_compiled_steps_pick_and_decode_in_one_call(family, sampled, monkeypatch):
    """Compiled, a step that starts with every running prompt in is one call (the pick from the kept
    logits with the requests' penalties, eos held back and sampling, the record, the decode forward),
    prompts coming in after it in a forward of their own: the eager batcher's tokens and
    log-probabilities (sampled: from the same seed, with per-request temperatures and filters), and
    each greedy request equals generate on its prompt alone."""
    from python_tests.generation.test_speculative import count_compiled_calls

    model = patched_copy(tiny_model(family, layers=3), int8=False)
    prompts = _prompts(6)
    free = [_alone(model, p, 10, []) for p in prompts]
    eos = [free[0][1]]
    options = [dict(repetition_penalty=1.5, min_new_tokens=3), dict(presence_penalty=0.7, frequency_penalty=0.4),
               dict(), dict(repetition_penalty=0.8, frequency_penalty=1.0, min_new_tokens=6), dict(min_new_tokens=2),
               dict(stop_sequences=[free[5][2:4]]), dict()]
    if sampled:
        for o, sampling in zip(options, [dict(temperature=0.8), dict(temperature=1.2, top_k=20), dict(),
                                         dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.05)]):
            o.update(sampling)
    calls = count_compiled_calls(monkeypatch, None)
    runs, logprobs, decoded = [], [], 0
    for compile in (False, True):
        batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos, compile=compile,
                                    generator=torch.Generator().manual_seed(3))
        for p, o in zip(prompts, options):
            batcher.submit(p, max_new_tokens=10, output_logprobs=True, **o)
        calls.clear()
        out = {}
        while batcher.waiting or batcher.running:
            rows = [r for r in batcher.rows if r is not None]
            decoded += compile and bool(rows) and all(r.filled == len(r.prompt) for r in rows)
            out.update(batcher.step())
        runs.append(out)
        logprobs.append(batcher.logprobs)
    assert runs[0] == runs[1]
    for request in runs[0]:
        torch.testing.assert_close(torch.tensor(logprobs[1][request]), torch.tensor(logprobs[0][request]))
    for i, o in enumerate(options):
        if "temperature" not in o:
            assert runs[0][i] == _alone(model, prompts[i], 10, eos, **o), (i, o)
    assert decoded > len(prompts)
    assert calls == {("target", "_decode_going"): decoded}, calls  # (the decode step never runs alone)


@pytest.mark.parametrize("budget", [None, 4])
def test_compiled_steps_reuse_prefixes_split_prompts_and_cancel(budget):
    """Compiled steps (one call each once every running prompt is in) beside shared prefixes (an
    ended row's among them, whose cache also holds the last token the call decoded), prompts split
    across steps and a cancelled request: the eager batcher's tokens, log-probabilities and reused
    tokens, and each request that ran to its end equals generate on its prompt alone."""
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    g = torch.Generator().manual_seed(21)
    system = torch.randint(3, 97, (9,), generator=g).tolist()
    prompts = [system + torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 4, 1, 3)]
    prompts += [list(prompts[0]), torch.randint(3, 97, (6,), generator=g).tolist()]
    limits = (5, 3, 6, 2, 4, 5)
    runs = []
    for compile in (False, True):
        batcher = ContinuousBatcher(model, batch_size=2, max_length=24, eos_token_id=[], max_prefill_tokens=budget,
                                    reuse_prefixes=True, compile=compile)
        ids = [batcher.submit(p, max_new_tokens=n, output_logprobs=True) for p, n in zip(prompts, limits)]
        out = {}
        for _ in range(4):
            out.update(batcher.step())
        had = batcher.cancel(ids[2])
        out.update(batcher.run())
        runs.append((out, batcher.logprobs, batcher.reused_tokens, had))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] and runs[0][3] == runs[1][3]
    assert runs[1][2] >= 2 * 9 and ids[2] not in runs[1][0]
    for i in runs[0][0]:
        torch.testing.assert_close(torch.tensor(runs[1][1][i]), torch.tensor(runs[0][1][i]))
        tokens, logprobs = _alone(model, prompts[i], limits[i], [], logprobs=True)
        assert runs[1][0][i] == tokens, (budget, i)
        torch.testing.assert_close(torch.tensor(runs[1][1][i]), logprobs, atol=2e-4, rtol=1e-4)


def test_compiled_steps_serve_requests_that_fill_max_length():
    """Requests whose prompt and new tokens take all of max_length (a multiple of the kept cache's
    rounding, so the compiled batcher's cache has no slot to spare): the compiled step's call decodes
    each request's last token with its row as padding (no slot past the cache), and every request
    gets generate's tokens, compiled as eager."""
    from gptfast_kernels.generation.forward import CACHE_LEN_QUANTUM

    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    g = torch.Generator().manual_seed(14)
    length = CACHE_LEN_QUANTUM
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (length - 16, length - 6, length - 3)]
    limits = [length - len(p) + 1 for p in prompts]  # (prompt + new tokens - 1 == max_length)
    for compile in (False, True):
        batcher = ContinuousBatcher(model, batch_size=2, max_length=length, eos_token_id=[], compile=compile)
        assert batcher.cache.max_cache_len == length
        for p, n in zip(prompts, limits):
            batcher.submit(p, max_new_tokens=n)
        assert batcher.run() == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, limits))}
