"""Per-row sampling arguments (vLLM's per-request temperature / top-k / top-p / min-p and
repetition / presence / frequency penalties): each row of a batch samples exactly as it would with
its own values for the whole batch, from the same generator, greedy rows beside sampled ones
included, in generate and in the speculative generators; one value for every row samples as that
number; bad values name the argument and row."""

import pytest
import torch

from gptfast_kernels import generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation.sampling import logits_to_probs
from python_tests.tiny_models import PAD, draft_of, patched_copy, ragged_prompts, tiny_model

NEW, P = 12, 6
# per row: temperature, top_k, top_p, min_p (greedy, top-k, top-p, min-p, all three)
ROWS = [(0.0, None, None, None), (0.8, 5, None, None), (1.3, None, 0.7, None), (1.0, None, None, 0.2),
        (0.6, 20, 0.9, 0.05)]


def _columns(rows):
    return {name: [row[i] for row in rows] for i, name in enumerate(("temperature", "top_k", "top_p", "min_p"))}


def _alone(row):
    return dict(zip(("temperature", "top_k", "top_p", "min_p"), row))


def test_per_row_distributions_equal_each_row_alone_bit_for_bit():
    logits = torch.randn(len(ROWS) + 1, 3, 97, generator=torch.Generator().manual_seed(0)) * 3
    rows = [*ROWS, (0.9, 500, None, None)]  # (top_k past the vocabulary: off)
    # a peaked last row: its float32 mass reaches 1 after the first token, so a top-p of 1 applied
    # (not off) would drop the rest
    logits[-1] = 0.0
    logits[-1, :, 0] = 80.0
    columns = _columns(rows)
    per_row = logits_to_probs(logits, torch.tensor(columns["temperature"]),
                              torch.tensor([k or 0 for k in columns["top_k"]]),
                              torch.tensor([1.0 if p is None else p for p in columns["top_p"]]),
                              torch.tensor([m or 0.0 for m in columns["min_p"]]))
    for b, row in enumerate(rows):
        assert torch.equal(per_row[b], logits_to_probs(logits[b:b + 1], *row)[0])
    assert (per_row[0].sum(-1) == 1).all() and ((per_row[1] > 0).sum(-1) == 5).all()
    assert (per_row[-1] > 0).all()


def _run(fn, rows, seed=7, **kwargs):
    return fn(generator=torch.Generator().manual_seed(seed), **_columns(rows), **kwargs).sequences


@pytest.mark.parametrize("generator_name", ["generate", "speculative", "prompt_lookup"])
def test_each_row_samples_as_it_would_alone(generator_name):
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    draft = patch_model(draft_of(target, 2), int8=False)
    ids, mask = ragged_prompts(len(ROWS), P, "left", seed=2)
    options = dict(max_new_tokens=NEW, eos_token_id=[])

    def run(**kw):
        if generator_name == "generate":
            return generate(patched, ids, mask, **options, **kw)
        if generator_name == "speculative":
            return speculative_generate(patched, draft, ids, mask, speculate_k=3, **options, **kw)
        return prompt_lookup_generate(patched, ids, mask, speculate_k=3, **options, **kw)

    mixed = _run(run, ROWS)
    for b, row in enumerate(ROWS):
        alone = _run(run, [row] * len(ROWS))
        assert torch.equal(mixed[b], alone[b]), (b, row)
    greedy = generate(patched, ids, mask, **options).sequences
    assert torch.equal(mixed[0], greedy[0])  # (the greedy row: the target's own greedy decoding)
    assert not torch.equal(mixed[1:], greedy[1:])  # (the others sampled)


PENALTIES = [(None, 0.0, 0.0), (1.3, 0.0, 0.0), (None, 0.5, 0.0), (1.1, -0.2, 0.7)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("generator_name", ["generate", "speculative", "prompt_lookup"])
def test_per_row_penalties_penalise_each_row_as_alone(generator_name, temperature):
    """Repetition / presence / frequency penalties per row (vLLM's per-request penalties)."""
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    draft = patch_model(draft_of(target, 2), int8=False)
    ids, mask = ragged_prompts(len(PENALTIES), P, "left", seed=4)
    options = dict(max_new_tokens=NEW, eos_token_id=[], temperature=temperature)

    def run(rows):
        names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
        kw = dict(options, generator=torch.Generator().manual_seed(9), **dict(zip(names, map(list, zip(*rows)))))
        if generator_name == "generate":
            return generate(patched, ids, mask, **kw).sequences
        if generator_name == "speculative":
            return speculative_generate(patched, draft, ids, mask, speculate_k=3, **kw).sequences
        return prompt_lookup_generate(patched, ids, mask, speculate_k=3, **kw).sequences

    mixed = run(PENALTIES)
    alone = [run([row] * len(PENALTIES)) for row in PENALTIES]
    for b in range(len(PENALTIES)):
        assert torch.equal(mixed[b], alone[b][b])
    assert not all(torch.equal(alone[0][b], alone[1][b]) for b in range(len(PENALTIES)))  # (penalties bite)


def _generators(target, patched, k=3):
    draft = patch_model(draft_of(target, 2), int8=False)
    return {"generate": lambda *a, **kw: generate(patched, *a, **kw),
            "speculative": lambda *a, **kw: speculative_generate(patched, draft, *a, speculate_k=k, **kw),
            "prompt_lookup": lambda *a, **kw: prompt_lookup_generate(patched, *a, speculate_k=k, **kw)}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_per_row_max_new_tokens_end_each_row_at_its_own_limit(temperature):
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    ids, mask = ragged_prompts(4, P, "left", seed=3)
    limits = [3, 0, 9, 5]
    for name, run in _generators(target, patched).items():
        if name != "generate" and temperature:  # (sampled: generate's rows as alone suffice below)
            continue
        got = run(ids, mask, max_new_tokens=limits, eos_token_id=[], temperature=temperature,
                  generator=torch.Generator().manual_seed(2))
        assert got.sequences.shape[1] == P + max(limits), name
        if not temperature:  # (greedy: the speculative generators equal generate)
            assert torch.equal(got.sequences, generate(patched, ids, mask, max_new_tokens=limits,
                                                       eos_token_id=[]).sequences), name
        for b, limit in enumerate(limits):
            alone = run(ids, mask, max_new_tokens=limit, eos_token_id=[], temperature=temperature,
                        generator=torch.Generator().manual_seed(2)).sequences
            assert torch.equal(got.sequences[b, :P + limit], alone[b]), (name, b)
            assert (got.sequences[b, P + limit:] == PAD).all(), (name, b)


def test_a_tiny_temperature_samples_the_argmax():
    """A temperature so small that a logit over it overflows: the largest took inf and the softmax
    NaN, and every such row emitted token 0 (silently). Now each row's largest logit is brought to 0
    first: such rows sample the argmax, as the greedy row does. One below float32's smallest (0 in
    float32, where logits are divided: 0 / 0) is taken as 0, greedy; the speculative generators and
    the batcher emitted token 0 for it."""
    from gptfast_kernels import ContinuousBatcher

    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    ids, mask = ragged_prompts(3, P, "left", seed=3)
    greedy = generate(patched, ids, mask, max_new_tokens=6, eos_token_id=[]).sequences
    for name, run in _generators(target, patched).items():
        for temperature in ([0.0, 1e-30, 1e-40], 1e-45, 1e-46, 1e-300, [1e-300, 1e-46, 0.0]):
            got = run(ids, mask, max_new_tokens=6, eos_token_id=[], temperature=temperature,
                      generator=torch.Generator().manual_seed(0)).sequences
            assert torch.equal(got, greedy), (name, temperature)
    batcher = ContinuousBatcher(patched, batch_size=3, max_length=16, eos_token_id=[])
    requests = [batcher.submit(row[m.bool()].tolist(), max_new_tokens=6, temperature=t)
                for row, m, t in zip(ids, mask, (1e-46, 1e-300, 0.0))]
    done = batcher.run()
    assert [done[r] for r in requests] == greedy[:, P:].tolist()


def test_rows_ending_early_leave_the_output_as_wide_as_generates():
    """The longest limit's row ends at an eos, while a round (k + 1 tokens a row, every draft taken:
    the target drafts for itself) carries a short limit's row past its own limit: the tokens past it
    are dropped and the output is as wide as generate's, the longest row that is left (before
    2026-11-30 the speculative generators kept the overshoot's width, in pad columns)."""
    patched = patched_copy(tiny_model("llama", layers=3), int8=False)
    ids, mask = ragged_prompts(2, P, "left", seed=3)
    limits = [2, 9]
    eos = [generate(patched, ids, mask, max_new_tokens=9, eos_token_id=[]).sequences[1, P + 2].item()]
    want = generate(patched, ids, mask, max_new_tokens=limits, eos_token_id=eos).sequences
    assert want.shape[1] <= P + 3  # (the case: row 1 ends within three tokens, row 0 at two)
    for name, run in (("speculative", lambda: speculative_generate(patched, patched, ids, mask, speculate_k=5,
                                                                   max_new_tokens=limits, eos_token_id=eos)),
                      ("prompt_lookup", lambda: prompt_lookup_generate(patched, ids, mask, speculate_k=5,
                                                                       max_new_tokens=limits, eos_token_id=eos))):
        got = run()
        assert torch.equal(got.sequences, want), (name, got.sequences[:, P:].tolist(), want[:, P:].tolist())


def test_per_row_min_new_tokens_hold_each_rows_eos_and_stops_back_as_alone():
    target = tiny_model("llama", layers=3)
    patched = patched_copy(target, int8=False)
    ids, mask = ragged_prompts(4, P, "left", seed=5)
    free = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences[:, P:]
    eos = int(free[1, 1])  # (row 1 makes it before its minimum)
    stops = [free[2, 0:2].tolist()]  # (row 2 completes it before its minimum)
    minimums = [0, 6, 3, 0]
    options = dict(max_new_tokens=NEW, eos_token_id=eos, stop_sequences=stops)
    want = generate(patched, ids, mask, min_new_tokens=minimums, **options).sequences
    for name, run in _generators(target, patched).items():
        got = run(ids, mask, min_new_tokens=minimums, **options).sequences
        assert torch.equal(got, want), name  # (greedy: the speculative generators equal generate)
        for b, minimum in enumerate(minimums):
            alone = run(ids, mask, min_new_tokens=minimum, **options).sequences
            width = min(got.shape[1], alone.shape[1])
            assert torch.equal(got[b, :width], alone[b, :width]), (name, b)
            assert (got[b, width:] == PAD).all() and (alone[b, width:] == PAD).all(), (name, b)
    held = generate(patched, ids, mask, min_new_tokens=minimums, **options).sequences
    unheld = generate(patched, ids, mask, **options).sequences
    assert (unheld[1:3, P + 2:] == PAD).all() and not (held[1:3, P + 2:] == PAD).all(dim=1).any()  # (held back)


def test_one_value_for_every_row_samples_as_that_number():
    patched = patched_copy(tiny_model("llama", layers=2), int8=False)
    ids, mask = ragged_prompts(3, P, "left", seed=1)
    number = generate(patched, ids, mask, max_new_tokens=NEW, temperature=0.9, top_k=7, top_p=0.8,
                      generator=torch.Generator().manual_seed(3)).sequences
    rows = generate(patched, ids, mask, max_new_tokens=NEW, temperature=torch.tensor([0.9] * 3), top_k=[7] * 3,
                    top_p=(0.8, 0.8, 0.8), generator=torch.Generator().manual_seed(3)).sequences
    assert torch.equal(number, rows)
    greedy = generate(patched, ids, mask, max_new_tokens=NEW).sequences
    assert torch.equal(generate(patched, ids, mask, max_new_tokens=NEW, temperature=[0, 0, 0], top_k=[3, None, 5]
                                ).sequences, greedy)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=[0.5, 1.0]), "temperature has 2 values"),
    (dict(temperature=[0.5, -1.0, 1.0]), r"temperature\[1\]"),
    (dict(temperature=[0.5, float("nan"), 1.0]), r"temperature\[1\]"),
    # (past float32's largest: the scalar crashed in torch.full, a row's became inf and its masked
    # eos logit -inf / inf = NaN, which emitted token 0)
    (dict(temperature=1e300), "temperature must be a number in"),
    (dict(temperature=[1e300, 1.0, 1.0], min_new_tokens=2), r"temperature\[0\]"),
    (dict(temperature=1.0, top_k=[1, 0, 2]), r"top_k\[1\]"),
    (dict(temperature=1.0, top_k=[1, 2.0, 2]), r"top_k\[1\]"),
    (dict(temperature=1.0, top_p=[0.5, 0.5, 1.5]), r"top_p\[2\]"),
    (dict(temperature=1.0, min_p=[True, 0.1, 0.1]), r"min_p\[0\]"),
    (dict(temperature=torch.ones(3, 1)), "temperature as a tensor must be 1-D"),
    (dict(temperature=torch.ones(3, dtype=torch.bool)), "temperature as a tensor must be 1-D and real"),
    (dict(temperature=torch.ones(3, device="meta")), "temperature as a tensor .* on the meta device"),
    (dict(repetition_penalty=[1.0, 0.0, 1.0]), r"repetition_penalty\[1\]"),
    (dict(max_new_tokens=[2, -1, 2]), r"max_new_tokens\[1\]"),
    (dict(max_new_tokens=[2, 2]), "max_new_tokens has 2 values"),
    (dict(min_new_tokens=[0, 1, 2.0]), r"min_new_tokens\[2\]"),
    (dict(presence_penalty=[0.1, 0.2]), "presence_penalty has 2 values"),
    (dict(frequency_penalty=[0.1, float("inf"), 0.0]), r"frequency_penalty\[1\]"),
])
def test_bad_per_row_values_name_the_argument_and_row(kwargs, words):
    patched = patched_copy(tiny_model("llama"), int8=False)
    ids = torch.tensor([[3, 4, 5]] * 3)
    for run in (lambda **kw: generate(patched, ids, **kw),
                lambda **kw: speculative_generate(patched, patched, ids, **kw),
                lambda **kw: prompt_lookup_generate(patched, ids, **kw)):
        with pytest.raises(ValueError, match=words):
            run(**{"max_new_tokens": 2, **kwargs})
