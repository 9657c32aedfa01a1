"""stop_sequences: a row ends when its generated tokens end with one of them (kept, then padding):
transformers' greedy tokens cut by the rule written out in Python; not before min_new_tokens; the
speculative generators stop exactly where generate does; bad values name the argument."""

import pytest
import torch

from gptfast_kernels import generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation.stopping import StopMatcher
from python_tests.generation.test_speculative import count_compiled_calls
from python_tests.tiny_models import PAD, draft_of, hf_greedy, patched_copy, ragged_prompts, tiny_model

NEW, P = 16, 7


def cut_at_stops(sequences, prompt_length, stops, min_new_tokens=0):
    """``sequences`` [B, prompt_length + n] of free-running decoding -> each row cut after the first
    new token i >= min_new_tokens at which its new tokens end with one of ``stops`` (pad after it),
    the whole trimmed to the longest row that stopped (untrimmed if one never did)."""
    rows, ends = [], []
    for row in sequences[:, prompt_length:].tolist():
        end = next((i + 1 for i in range(min_new_tokens, len(row))
                    if any(row[:i + 1][-len(seq):] == seq for seq in stops)), None)
        ends.append(end)
        rows.append(row if end is None else row[:end] + [PAD] * (len(row) - end))
    width = len(rows[0]) if None in ends else max(ends)
    return torch.cat([sequences[:, :prompt_length], torch.tensor(rows)[:, :width]], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
@pytest.mark.parametrize("min_new_tokens", [0, 6])
def test_greedy_stops_as_transformers_tokens_cut_by_the_rule(family, min_new_tokens):
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = ragged_prompts(3, P, "left")
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    new = free[:, P:].tolist()
    row, token, first, later = _repeated_token(new, min_new_tokens)
    stops = [[token], new[(row + 1) % 3][2:4]]  # (from the outputs: they occur)
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], stop_sequences=stops,
                   min_new_tokens=min_new_tokens).sequences
    want = cut_at_stops(hf_greedy(model, ids, mask, NEW, eos_token_id=None, pad_token_id=PAD), P, stops,
                        min_new_tokens)
    assert torch.equal(got, want)
    if min_new_tokens == 0:  # the row ended at its first new token
        assert int(got[row, P]) == token and (got[row, P + 1:] == PAD).all()
    else:  # it made the token before min_new_tokens and went on
        assert int(got[row, P + first]) == token and (got[row, P:P + later + 1] != PAD).all()


def _repeated_token(new, min_new_tokens):
    """(row, token, its first index, a later index >= min_new_tokens) of a token some row made at
    index < min_new_tokens for the first time and again later (tiny models repeat themselves); without
    min_new_tokens, row 0's first new token."""
    if min_new_tokens == 0:
        return 0, new[0][0], 0, 0
    for row, tokens in enumerate(new):
        for first, token in enumerate(tokens[:min_new_tokens]):
            later = [i for i in range(min_new_tokens, len(tokens)) if tokens[i] == token]
            if tokens.index(token) == first and later:
                return row, token, first, later[0]
    raise AssertionError(f"no repeated token in {new}")


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("min_new_tokens", [0, 6])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_speculative_generators_stop_where_generate_does(k, min_new_tokens, compile, monkeypatch):
    """A round that completes a stop sequence keeps the tokens up to its end, whatever position of
    the round it ends at: output equal to generate's, with a draft model and with prompt lookup;
    compiled, the patterns are matched inside the target's round call (verify_step), and inside
    generate's compiled step (decode_step)."""
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    draft = patch_model(draft_of(target, 2), int8=False)
    ids, mask = ragged_prompts(4, P, "left", seed=2)
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    stops = [free[2, P + 2:P + 4].tolist(), [int(free[0, P + 7])]]  # (from the outputs: they occur)
    options = dict(max_new_tokens=NEW, eos_token_id=[], stop_sequences=stops, min_new_tokens=min_new_tokens)
    want = generate(patched, ids, mask, **options).sequences
    assert (want[:, P:] == PAD).any()
    calls = count_compiled_calls(monkeypatch, draft)
    out = speculative_generate(patched, draft, ids, mask, speculate_k=k, compile=compile, **options)
    assert torch.equal(out.sequences, want) and 0 < out.acceptance_rate
    assert torch.equal(prompt_lookup_generate(patched, ids, mask, speculate_k=k, compile=compile,
                                              **options).sequences, want)
    assert calls[("target", "_forward")] == 0 and (calls[("target", "_verify_round")] > 0) == compile
    if compile:  # and generate's compiled step, which matches them in its call too
        assert torch.equal(generate(patched, ids, mask, compile=True, **options).sequences, want)
        assert calls[("target", "_decode_step")] > 0 and calls[("target", "_forward")] == 0


def test_compiled_steps_with_penalties_and_stops_equal_eager():
    """The penalties' record and the stop sequences' tails live outside the compiled steps: compiled
    generate and speculative rounds give the eager tokens."""
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2), int8=True)
    ids, mask = ragged_prompts(3, P, "left", seed=5)
    options = dict(max_new_tokens=NEW, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.6,
                   eos_token_id=[])
    free = generate(patched, ids, mask, **options).sequences
    options["stop_sequences"] = [free[1, P + 3:P + 5].tolist()]
    want = generate(patched, ids, mask, **options).sequences
    assert (want[1, P + 5:] == PAD).all() and not torch.equal(want[:, :free.shape[1]], free[:, :want.shape[1]])
    assert torch.equal(generate(patched, ids, mask, compile=True, **options).sequences, want)
    assert torch.equal(speculative_generate(patched, draft, ids, mask, speculate_k=3, compile=True,
                                            **options).sequences, want)


def test_a_one_token_stop_ends_a_row_at_its_first_token():
    patched = patched_copy(tiny_model("llama", layers=3), int8=False)
    ids, mask = ragged_prompts(2, P, "left")
    first = generate(patched, ids, mask, max_new_tokens=1, eos_token_id=[]).sequences[0, P]
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], stop_sequences=[[int(first)]])
    assert torch.equal(want.sequences[0, P + 1:], torch.full_like(want.sequences[0, P + 1:], PAD))
    out = speculative_generate(patched, patched, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                               stop_sequences=[[int(first)]])
    assert torch.equal(out.sequences, want.sequences)


def test_matching_counts_the_token_that_completes_a_sequence_and_never_reaches_before_the_first():
    stop = StopMatcher.build([[5, 6, 7], [9], [6, 6]], [], None, 12, torch.device("cpu"))
    state = stop.start(3)
    state = stop.after(*reversed(stop.scan(state, torch.tensor([[4], [5], [4]]))), torch.tensor([0, 1, 1]))
    # row 0 has generated nothing (a 5 before its first token would be its prompt's): 6, 7 does not complete
    hits, states = stop.scan(state, torch.tensor([[6, 7, 9], [6, 7, 1], [6, 6, 6]]))
    assert hits.tolist() == [[False, False, True], [False, True, False], [False, True, True]]
    # the state after each row's first n tokens: what the next round starts from
    later = stop.after(states, state, torch.tensor([1, 0, 2]))
    assert stop.scan(later, torch.tensor([[7], [6], [6]]))[0].tolist() == [[False], [False], [True]]


def test_a_sequence_inside_another_is_found_by_the_automaton():
    """Aho-Corasick's failure links: after 1, 2, 1, 2 the text ends with [2, 1, 2] too."""
    stop = StopMatcher.build([[1, 2, 1, 3], [2, 1, 2]], [], None, 4, torch.device("cpu"))
    hits, _ = stop.scan(stop.start(1), torch.tensor([[1, 2, 1, 2, 1, 3]]))
    assert hits.tolist() == [[False, False, False, True, False, True]]
    # a state deep in one sequence whose tokens end with another: [1, 2] ends with [2]
    stop = StopMatcher.build([[1, 2, 3], [2]], [], None, 4, torch.device("cpu"))
    assert stop.scan(stop.start(1), torch.tensor([[1, 2, 3]]))[0].tolist() == [[False, True, True]]


def test_kept_tables_match_as_their_own_and_are_shared_by_similar_sizes():
    """kept_on: a table is copied into one the model keeps per place and size (states rounded up to
    a power of two, at least MIN_KEPT_STATES), static; the states past its own, stale rows of a
    larger table, are never reached: it matches as the matcher it came from."""
    from gptfast_kernels.generation.stopping import KEPT_TABLES_ATTRIBUTE, MIN_KEPT_STATES

    model, cpu, V = torch.nn.Module(), torch.device("cpu"), 12
    tokens = torch.randint(0, V, (4, 200), generator=torch.Generator().manual_seed(0))
    tokens[0, 50:70] = torch.arange(1, 21) % V  # (long matches too: the 20-token stop below)

    def kept_matches(sequences):
        own = StopMatcher.build(sequences, [], None, V, cpu)
        kept = own.kept_on(model)
        for got, want in zip(kept.scan(kept.start(4), tokens), own.scan(own.start(4), tokens)):
            assert torch.equal(got, want)
        return own.tables[0].shape[0], kept.tables[0]

    states, long_table = kept_matches([(torch.arange(1, 21) % V).tolist(), [3, 4]])
    assert states == 23 and long_table.shape == (32, V)
    states, table = kept_matches([(torch.arange(1, 19) % V).tolist()])  # 19 states: the same kept table
    assert states == 19 and table is long_table
    states, short_table = kept_matches([[5, 6, 7], [9]])
    assert states == 5 and short_table.shape == (MIN_KEPT_STATES, V)
    assert len(getattr(model, KEPT_TABLES_ATTRIBUTE)) == 2


@pytest.mark.parametrize("bad", [[[]], [[-1]], [[97]], [1, 2], "stop", [[1.0]], [[True]]])
def test_bad_stop_sequences_name_the_argument(bad):
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids = torch.tensor([[2, 3, 4]])
    for run in (lambda: generate(patched, ids, max_new_tokens=2, stop_sequences=bad),
                lambda: speculative_generate(patched, patched, ids, max_new_tokens=2, stop_sequences=bad),
                lambda: prompt_lookup_generate(patched, ids, max_new_tokens=2, stop_sequences=bad)):
        with pytest.raises(ValueError, match="stop_sequences must be None or a list of non-empty lists"):
            run()
