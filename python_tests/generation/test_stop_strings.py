"""stop_strings: each token's text is what its tokenizer decodes; a row stops at the token within
which its generated text comes to contain a stop string. The matcher equals transformers'
StopStringCriteria and the rule written out in Python on three kinds of tokenizer; generate's tokens
are transformers' greedy tokens cut by that rule; the speculative generators stop where generate
does; bad values name the argument."""

import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gptfast_kernels import generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation.stopping import StopMatcher, token_bytes
from python_tests.generation.test_speculative import count_compiled_calls
from python_tests.tiny_models import PAD, draft_of, hf_greedy, patched_copy, ragged_prompts, tiny_model
from python_tests.tiny_tokenizers import TOKENIZERS, byte_level_tokenizer, rule_hits, stop_string_from

NEW, P = 16, 7
STRINGS = ["stop", "é", "日本", "\n\n", "the st", "<|end|>", "! ", "lo"]


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_token_text_is_what_the_tokenizer_decodes_mid_text(kind):
    tokenizer = TOKENIZERS[kind]()
    pieces = token_bytes(tokenizer)
    prefix = tokenizer.encode("abcdef", add_special_tokens=False)
    ids = torch.randint(3, len(tokenizer), (300, 6), generator=torch.Generator().manual_seed(0)).tolist()
    checked = 0
    for row in ids:
        try:
            text = b"".join(pieces[i] for i in row).decode("utf-8")
        except UnicodeDecodeError:  # (half a character: decode would show U+FFFD)
            continue
        assert tokenizer.decode(prefix + row) == "abcdef" + text
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_matching_equals_transformers_stop_string_criteria_and_the_text_rule(kind):
    from transformers.generation.stopping_criteria import StopStringCriteria

    tokenizer = TOKENIZERS[kind]()
    pieces = token_bytes(tokenizer)
    matcher = StopMatcher.build([], STRINGS, tokenizer, len(tokenizer) + 3, torch.device("cpu"))
    criteria = StopStringCriteria(tokenizer, STRINGS)
    ids = torch.randint(3, len(tokenizer), (48, 12), generator=torch.Generator().manual_seed(1))
    hits, _ = matcher.scan(matcher.start(48), ids)
    for b in range(48):
        row = ids[b].tolist()
        assert hits[b].tolist() == rule_hits(row, pieces, STRINGS)
        # transformers' criterion on each prefix of the generated tokens alone
        assert hits[b].tolist() == [bool(criteria(ids[b:b + 1, :n + 1], None)[0]) for n in range(len(row))]
    assert 50 < int(hits.sum()) < hits.numel() / 2  # (a test with matches and misses)
    # ids past the tokenizer's have no text: they neither match nor break a match
    past = len(tokenizer)
    stop = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("stop")) if kind != "words" else []
    if stop and len(stop) > 1:
        gapped = torch.tensor([stop[:1] + [past, past + 2] + stop[1:]])
        assert matcher.scan(matcher.start(1), gapped)[0].tolist() == [[False] * (gapped.shape[1] - 1) + [True]]


def test_a_string_ending_mid_token_stops_at_that_token_and_halves_of_characters_join():
    tokenizer = byte_level_tokenizer()
    vocab = tokenizer.get_vocab()
    opera, st, las, topper = (vocab[t] for t in ("opera", "st", "las", "topper"))
    alphabet = bytes_to_unicode()
    half, rest = vocab[alphabet[0xC3]], vocab[alphabet[0xA9]]  # "é" in two tokens
    matcher = StopMatcher.build([], ["stop", "é"], tokenizer, len(tokenizer), torch.device("cpu"))
    hits, _ = matcher.scan(matcher.start(3), torch.tensor([[st, opera], [las, topper], [half, rest]]))
    assert hits.tolist() == [[False, True], [False, True], [False, True]]


def cut_at_strings(sequences, prompt_length, pieces, strings, min_new_tokens=0):
    """``sequences`` [B, prompt_length + n] of free-running decoding -> each row cut after its first
    new token i >= min_new_tokens within which a stop string ends (pad after it), the whole trimmed
    to the longest row that stopped (untrimmed if one never did)."""
    rows, ends = [], []
    for row in sequences[:, prompt_length:].tolist():
        hits = rule_hits(row, pieces, strings)
        end = next((i + 1 for i in range(min_new_tokens, len(row)) if hits[i]), None)
        ends.append(end)
        rows.append(row if end is None else row[:end] + [PAD] * (len(row) - end))
    width = len(rows[0]) if None in ends else max(ends)
    return torch.cat([sequences[:, :prompt_length], torch.tensor(rows)[:, :width]], dim=1)


def _text_prompts(tokenizer, batch, seed):
    """Left-padded prompts of tokens with text (ids the tokenizer has)."""
    ids, mask = ragged_prompts(batch, P, "left", seed=seed, vocab=len(tokenizer))
    return ids.clamp(min=3) * mask, mask


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
@pytest.mark.parametrize("min_new_tokens", [0, 6])
def test_greedy_stops_as_transformers_tokens_cut_by_the_text_rule(family, min_new_tokens):
    tokenizer = byte_level_tokenizer()
    pieces = token_bytes(tokenizer)
    model = tiny_model(family)
    patched = patched_copy(model, int8=False)
    ids, mask = _text_prompts(tokenizer, 3, 0)
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    strings = [stop_string_from(pieces, free[1, P:].tolist()), "\n\n"]
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], stop_strings=strings,
                   tokenizer=tokenizer, min_new_tokens=min_new_tokens).sequences
    want = cut_at_strings(hf_greedy(model, ids, mask, NEW, eos_token_id=None, pad_token_id=PAD), P, pieces, strings,
                          min_new_tokens)
    assert torch.equal(got, want)
    if min_new_tokens == 0:  # (row 1's string is in its first new tokens)
        assert (got[1, P:] == PAD).any()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_speculative_generators_stop_where_generate_does(k, compile, monkeypatch):
    """Stop strings and sequences together (two automata), eager and compiled (matched inside the
    target's round call, verify_step, and generate's compiled step, decode_step)."""
    tokenizer = byte_level_tokenizer()
    pieces = token_bytes(tokenizer)
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    draft = patch_model(draft_of(target, 2), int8=False)
    ids, mask = _text_prompts(tokenizer, 4, 3)
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    options = dict(max_new_tokens=NEW, eos_token_id=[], tokenizer=tokenizer, min_new_tokens=2,
                   stop_strings=[stop_string_from(pieces, free[0, P:].tolist()),
                                 stop_string_from(pieces, free[2, P + 5:].tolist())],
                   stop_sequences=[free[3, P + 6:P + 8].tolist()])
    want = generate(patched, ids, mask, **options).sequences
    assert (want == PAD).any(dim=1)[[0, 2, 3]].all()  # (every kind of stop ends a row)
    calls = count_compiled_calls(monkeypatch, draft)
    assert torch.equal(speculative_generate(patched, draft, ids, mask, speculate_k=k, compile=compile,
                                            **options).sequences, want)
    assert torch.equal(prompt_lookup_generate(patched, ids, mask, speculate_k=k, compile=compile,
                                              **options).sequences, want)
    assert calls[("target", "_forward")] == 0 and (calls[("target", "_verify_round")] > 0) == compile
    if compile:  # and generate's compiled step, which matches them in its call too
        assert torch.equal(generate(patched, ids, mask, compile=True, **options).sequences, want)
        assert calls[("target", "_decode_step")] > 0 and calls[("target", "_forward")] == 0


def test_tables_are_kept_per_tokenizer_and_rebuilt_when_it_grows():
    tokenizer = byte_level_tokenizer()
    first = StopMatcher.build([], ["stop"], tokenizer, 97, torch.device("cpu")).tables[0]
    assert StopMatcher.build([], ["stop"], tokenizer, 97, torch.device("cpu")).tables[0].data_ptr() == first.data_ptr()
    tokenizer.add_tokens(["stop!"])
    grown = StopMatcher.build([], ["stop"], tokenizer, 97, torch.device("cpu"))
    added = tokenizer.convert_tokens_to_ids("stop!")
    assert grown.scan(grown.start(1), torch.tensor([[added]]))[0].item()


@pytest.mark.parametrize("bad, tokenizer, error, words", [
    (["stop"], None, ValueError, "tokenizer"),
    ("", "tok", ValueError, "stop_strings"),
    ([""], "tok", ValueError, "stop_strings"),
    ([1], "tok", ValueError, "stop_strings"),
    ([["s"]], "tok", ValueError, "stop_strings"),
    (["stop"], object(), TypeError, "tokenizer"),
])
def test_bad_stop_strings_name_the_argument(bad, tokenizer, error, words):
    patched = patched_copy(tiny_model("llama"), int8=False)
    tokenizer = byte_level_tokenizer() if tokenizer == "tok" else tokenizer
    ids = torch.tensor([[3, 4, 5]])
    for run in (lambda **kw: generate(patched, ids, **kw),
                lambda **kw: speculative_generate(patched, patched, ids, **kw),
                lambda **kw: prompt_lookup_generate(patched, ids, **kw)):
        with pytest.raises(error, match=words):
            run(max_new_tokens=2, stop_strings=bad, tokenizer=tokenizer)
