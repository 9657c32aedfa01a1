"""prompt_lookup_generate: the n-gram lookup itself, greedy output equal to the target's own greedy
decoding (any batch, padding side, eos per row), the sampled distribution equal to the target's,
compiled rounds, bad arguments."""

import pytest
import torch

from gptfast_kernels import generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation.continuous_speculative import SpeculativeBatcher
from gptfast_kernels.generation.prompt_lookup import lookup_continuations
from python_tests.generation.test_speculative import assert_samples_follow_the_target
from python_tests.tiny_models import RecordingStreamer, draft_of, patched_copy, ragged_prompts, tiny_model

NEW = 40


def _tokens(rows, width):
    """Rows of text packed from the left, -1 after; -> (tokens [B, width], lengths [B])."""
    tokens = torch.full((len(rows), width), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(row) for row in rows])


def test_lookup_takes_the_latest_longest_match():
    tokens, lengths = _tokens([
        [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 6, 7],  # tail (6, 7): latest earlier match at 6..7 -> 2, 3, 6
        [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3],         # tail (1, 2, 3) at 0 beats the later (2, 3) at 5
        [4, 5, 6],                                  # nothing earlier: the last token repeated
        [8, 9, 8, 9],                               # tail (8, 9) at 0 -> 8, 9, then copying on: 8
        [3],                                        # one token: nothing earlier
    ], width=14)
    got = lookup_continuations(tokens, lengths, k=3, max_ngram_size=3)
    assert got.tolist() == [[2, 3, 6], [4, 9, 2], [6, 6, 6], [8, 9, 8], [3, 3, 3]]
    # n limited to 1: row 1's tail (3) last occurred at 6 -> 5, 1, 2
    assert lookup_continuations(tokens, lengths, k=3, max_ngram_size=1)[1].tolist() == [5, 1, 2]


def test_lookup_ignores_the_padding():
    """-1 padding after the text never matches, and a match is never the tail itself."""
    tokens, lengths = _tokens([[7, 7], [2]], width=6)
    got = lookup_continuations(tokens, lengths, k=2, max_ngram_size=2)
    assert got.tolist() == [[7, 7], [2, 2]]


def _lookup_one_row(text, k, max_ngram_size):
    """The rule, one row in plain Python: the latest earlier occurrence of the longest tail."""
    for n in range(min(max_ngram_size, len(text) - 1), 0, -1):
        tail = text[-n:]
        for w in range(len(text) - n - 1, -1, -1):  # latest first; w + n < len(text)
            if text[w:w + n] == tail:
                proposal = list(text)
                for i in range(k):  # copying on past the end, as an overlapping copy does
                    proposal.append(proposal[w + n + i])
                return proposal[len(text):]
    return [text[-1]] * k


def test_lookup_equals_the_one_row_rule_on_random_texts():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(texts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
           k=st.integers(1, 6), max_ngram_size=st.integers(1, 4))
    def check(texts, k, max_ngram_size):
        tokens, lengths = _tokens(texts, width=max(len(t) for t in texts) + 3)
        got = lookup_continuations(tokens, lengths, k, max_ngram_size).tolist()
        assert got == [_lookup_one_row(t, k, max_ngram_size) for t in texts]

    check()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_greedy_equals_target_greedy(family, int8, side):
    patched = patched_copy(tiny_model(family, layers=3), int8=int8)
    ids, mask = ragged_prompts(4, 8, side, seed=2)
    out = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[])
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    assert torch.equal(out.sequences, want)
    assert torch.all(out.num_accepted <= out.num_proposed)
    # tiny random models fall into loops, which the lookup finds
    assert out.acceptance_rate > 0


def test_greedy_with_repetition_penalty_or_min_new_tokens_equals_generate():
    """With a repetition penalty (or min_new_tokens) the lookup's proposals meet a penalised target
    (one that suppresses early eos ids): the output is still generate's with the same argument, as
    are the log-probabilities output_logprobs gives."""
    patched = patched_copy(tiny_model("llama", layers=3), int8=False)
    ids, mask = ragged_prompts(4, 8, "left", seed=3)
    out = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=3, repetition_penalty=1.4,
                                 eos_token_id=[])
    want = generate(patched, ids, mask, max_new_tokens=NEW, repetition_penalty=1.4, eos_token_id=[]).sequences
    assert torch.equal(out.sequences, want)
    assert out.acceptance_rate > 0
    # and min_new_tokens: an eos the free run emits early waits
    stop = int(want[1, 8 + 2])
    out = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=3, min_new_tokens=12,
                                 eos_token_id=stop)
    want = generate(patched, ids, mask, max_new_tokens=NEW, min_new_tokens=12, eos_token_id=stop).sequences
    assert torch.equal(out.sequences, want) and not (want[:, 8:20] == stop).any()
    # and output_logprobs: the target's raw log-probabilities, as generate's
    out = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[],
                                 output_logprobs=True)
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], output_logprobs=True)
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)


def _bigram_model():
    """A target whose next token depends on the current token only (every attention output zeroed):
    its greedy text soon cycles, and then every lookup of the last token finds the exact
    continuation."""
    model = tiny_model("llama", layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return patched_copy(model, int8=False)


def test_a_cycling_text_is_proposed_exactly_and_eos_stops_rows():
    patched = _bigram_model()
    ids, mask = ragged_prompts(3, 8, "left", seed=2)
    plain = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, speculate_k=4, eos_token_id=[])
    assert torch.equal(out.sequences, plain)
    # with the cycle already in the prompt, every round accepts all 4 proposals
    cycled = plain[:, :8 + 20]
    assert torch.equal(cycled[:, -4:-2], cycled[:, -2:])  # each row has entered its cycle (length 1 or 2)
    out = prompt_lookup_generate(patched, cycled, max_new_tokens=NEW, speculate_k=4, eos_token_id=[])
    assert torch.equal(out.sequences, generate(patched, cycled, max_new_tokens=NEW, eos_token_id=[]).sequences)
    assert out.acceptance_rate == 1.0
    stop = int(plain[1, 8 + 5])
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop).sequences
    got = prompt_lookup_generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=stop).sequences
    assert torch.equal(got, want)


def test_sampling_follows_the_target_distribution():
    """20000 rows sample 3 tokens; the proposals are point masses, so every accept / reject path
    runs; the joint distribution of (t1, t2, t3) fits the target's exact one (chi-square)."""
    vocab, rows, steps, temperature = 6, 20000, 3, 1.0
    target = patched_copy(tiny_model("llama", vocab=vocab, seed=1), int8=False)
    prompt = torch.tensor([[2, 3, 2, 4, 2]])
    g = torch.Generator().manual_seed(0)
    out = prompt_lookup_generate(target, prompt.expand(rows, -1).contiguous(), max_new_tokens=steps,
                                 speculate_k=2, max_ngram_size=2, temperature=temperature, generator=g,
                                 eos_token_id=[])
    assert 0.05 < out.acceptance_rate < 0.95
    assert_samples_follow_the_target(target, prompt, out.sequences[:, prompt.shape[1]:], vocab, temperature)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prompt_ids_past_the_output_vocabulary_are_never_proposed(sampled):
    """Apertus 1.5's head (81 ids) is narrower than its embeddings (97): a prompt may hold ids the
    model cannot emit, which lookup would copy as drafts (verify_draft refused them, the penalties'
    record and the one-hot drafts indexed past their ends). Greedy rounds give generate's tokens, in
    prompt_lookup_generate and in the lookup SpeculativeBatcher; sampled rounds emit only ids < 81."""
    model = patched_copy(tiny_model("apertus1p5_text"), int8=False)
    vocab = model.config.output_vocab_size
    # every id the model can emit is followed by one it cannot: whatever it emits, lookup drafts one of those
    prompt = [token for emitted in range(vocab) for token in (emitted, vocab + emitted % 16)]
    options = dict(temperature=1.0, top_k=20, repetition_penalty=1.3, generator=torch.Generator().manual_seed(0)) \
        if sampled else {}
    out = prompt_lookup_generate(model, torch.tensor([prompt]), max_new_tokens=8, speculate_k=3, eos_token_id=[],
                                 **options).sequences[0, len(prompt):]
    batcher = SpeculativeBatcher(model, None, speculate_k=3, batch_size=2, max_length=len(prompt) + 8, eos_token_id=[],
                                 generator=options.get("generator"))
    request = batcher.submit(prompt, max_new_tokens=8, **{k: v for k, v in options.items() if k != "generator"})
    served = batcher.run()[request]
    if sampled:
        assert out.max() < vocab and len(served) == 8 and max(served) < vocab
    else:
        want = generate(model, torch.tensor([prompt]), max_new_tokens=8, eos_token_id=[]).sequences[0, len(prompt):]
        assert out.tolist() == want.tolist() == served


def test_compiled_rounds_give_the_same_tokens():
    patched = patched_copy(tiny_model("llama", layers=3), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    eager = prompt_lookup_generate(patched, ids, mask, max_new_tokens=12, speculate_k=3, eos_token_id=[])
    compiled = prompt_lookup_generate(patched, ids, mask, max_new_tokens=12, speculate_k=3, eos_token_id=[],
                                      compile=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch.equal(compiled.num_accepted, eager.num_accepted)


def test_bad_arguments_name_the_argument():
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids = torch.tensor([[2, 3, 4]])
    with pytest.raises(ValueError, match="max_ngram_size"):
        prompt_lookup_generate(patched, ids, max_new_tokens=4, max_ngram_size=0)
    with pytest.raises(ValueError, match="speculate_k"):
        prompt_lookup_generate(patched, ids, max_new_tokens=4, speculate_k=0)
    with pytest.raises(ValueError, match="model"):
        prompt_lookup_generate(tiny_model("llama"), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="input_ids"):
        prompt_lookup_generate(patched, torch.tensor([[2, 300]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        prompt_lookup_generate(patched, ids, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        prompt_lookup_generate(patched, ids, max_new_tokens=4, repetition_penalty=float("nan"))
    out = prompt_lookup_generate(patched, ids, max_new_tokens=0)
    assert torch.equal(out.sequences, ids) and out.acceptance_rate == 0.0


@pytest.mark.parametrize("generator", ["prompt_lookup", "draft_model"])
def test_streamer_gets_each_rounds_new_tokens(generator):
    """One prompt (as transformers' assisted generation): put(prompt [1, P]), put(first token
    [1, 1]), then each round's new tokens [1, n], cut at max_new_tokens; then end()."""
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    draft = patch_model(draft_of(target, 2), int8=False)

    def run(ids, **kwargs):
        if generator == "draft_model":
            return speculative_generate(patched, draft, ids, max_new_tokens=13, speculate_k=4, eos_token_id=[],
                                        **kwargs)
        return prompt_lookup_generate(patched, ids, max_new_tokens=13, speculate_k=4, eos_token_id=[], **kwargs)

    ids, _ = ragged_prompts(1, 6, "left", seed=4)
    streamer = RecordingStreamer()
    out = run(ids, streamer=streamer)
    assert streamer.ended == 1 and torch.equal(streamer.puts[0], ids)
    assert all(p.dim() == 2 and p.shape[0] == 1 for p in streamer.puts[1:])
    assert torch.equal(torch.cat(streamer.puts[1:], dim=1), out.sequences[:, 6:])
    assert len(streamer.puts) < 2 + 13  # rounds emitted several tokens at once
    batch, _ = ragged_prompts(2, 6, "left")
    with pytest.raises(ValueError, match="streamer"):
        run(batch, streamer=RecordingStreamer())
