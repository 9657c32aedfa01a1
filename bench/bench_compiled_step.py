"""What dynamo's guards on a model's modules cost a compiled generation (generation/forward.py,
CompiledStep): the demo's trained byte-level target and early-exit draft (gptfast_kernels/demo;
trained and cached on first use), patched, greedy, one prompt, 128 new tokens, ``generate`` and
``speculative_generate`` (k = 4) with ``compile=True``, each twice: with the steps compiled as the
package compiles them (without the guards on the modules) and with every guard (the baseline,
``module_guards``). The models are small, so the per-call work on the host is a large share of a
step, on a CPU and on a GPU alike (where it is what the GPU waits on between CUDA-graph replays).
Both copies generate the same tokens (checked before timing). Then ``speculative_drafts``: a
compiled greedy round's k drafts in one call of the draft (the package's way) against one compiled
step per draft, on the package's copies; ``speculative_sampled_drafts`` the same at temperature 0.8,
``speculative_penalised_drafts`` greedy with a repetition and a frequency penalty (processed in the
call, over each row's text and the drafts before).
Then ``generate_pick``, ``generate_sampled_pick`` and ``generate_penalised_pick``: ``generate``'s step
with the next token picked (and the rows' state advanced) inside the compiled call
(generation/decode_step.py, the package's way) against a compiled forward followed by the same pick
run eagerly, greedy, at temperature 0.8, and greedy with a repetition and a frequency penalty.
Then ``speculative_verify`` and ``speculative_sampled_verify``: a compiled round after its drafts
(the target's forward, verification, the crop, the rows' state) in one call of the target
(generation/verify_step.py, the package's way) against the target's forward compiled alone and the
rest run eagerly after it; ``speculative_penalised_verify`` with the penalties (their record
written in the call); ``speculative_batcher_verify`` the same for a ``SpeculativeBatcher`` (the
demo's draft, 4 requests of 128 new tokens on 2 rows; its tokens/s counts every request's);
``speculative_batcher_merged`` its rounds that take new prompts in (16 requests of 12 new tokens
on 2 rows, so that many rounds take one), whose first forwards are as wide as the prompts: the
drafts after the draft's and the rest of the round after the target's in one call each (the
package's way) against the drafts step by step and the rest op by op.
``continuous_decode``: a compiled ``ContinuousBatcher``'s step, the pick from the kept logits and
the decode forward in one call (generation/continuous.py's ``_decode_going``, the package's way)
against the pick run eagerly and the forward compiled alone (the same requests, the target alone).
Then ``speculative_watch``: compiled greedy rounds whose host reads whether
every row has finished one round late (generation/end_watch.py's EndWatch, the package's way on
a GPU), queuing the next round while the last runs, against reading it after each round (the way
on a CPU, where nothing runs behind the host: there the two do the same work); ``generate_watch``
the same for ``generate``'s compiled steps (with a per-row limit, so that the rows' end is watched):
read a step late against after each step.
"""

from __future__ import annotations

import copy
import functools
import importlib

import torch

import gptfast_kernels.generation.speculative as speculative_module
from bench.bench_speculative import demo_models
from gptfast_kernels import ContinuousBatcher, SpeculativeBatcher, generate, patch_model, speculative_generate
from gptfast_kernels.generation.decode_step import decode_function
from gptfast_kernels.generation.forward import drafts_function, step_function
from gptfast_kernels.generation.end_watch import EndWatch
from gptfast_kernels.generation.verify_step import verify_function

# (the module: the package's generate function hides it as an attribute of gptfast_kernels.generation)
generate_module = importlib.import_module("gptfast_kernels.generation.generate")

NEW_TOKENS = 128
SPECULATE_K = 4
SAMPLED_TEMPERATURE = 0.8  # the sampled rows' (speculative_sampled_drafts, generate_sampled_pick)
# (greedy) generate_penalised_pick's, speculative_penalised_drafts' and speculative_penalised_verify's
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2)
BATCHER_REQUESTS, BATCHER_ROWS = 4, 2  # speculative_batcher_verify's and continuous_decode's
MERGED_REQUESTS, MERGED_PROMPT, MERGED_NEW_TOKENS = 16, 48, 12  # speculative_batcher_merged's (on BATCHER_ROWS)


def _patched_pair(target, draft, module_guards: bool):
    """Patched copies of the demo's models whose compiled steps keep every guard (``module_guards``)
    or those on the inputs, the cache and the global state only (the package's default)."""
    patched = [patch_model(copy.deepcopy(model)) for model in (target, draft)]
    if module_guards:
        for model in patched:
            step_function(model, True, module_guards=True)  # the steps generation then takes
            decode_function(model, module_guards=True)  # (generate's, its pick in the call)
            drafts_function(model, module_guards=True)  # (a speculative round's drafts in one call)
            verify_function(model, module_guards=True)  # (and the round after its drafts)
    return patched


def run(h) -> None:
    target, draft, corpus, code_prompts = demo_models(h)
    ids = torch.tensor([list(code_prompts(corpus, 1)[0].encode())], device=h.device)
    pairs = {name: _patched_pair(target, draft, name == "module_guards") for name in ("module_guards", "default")}
    calls = {
        "generate": lambda t, d: generate(t, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], compile=True).sequences,
        "speculative": lambda t, d: speculative_generate(t, d, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                         speculate_k=SPECULATE_K, compile=True).sequences,
    }
    for call, fn in calls.items():
        candidates = {name: (lambda pair=pair: fn(*pair)) for name, pair in pairs.items()}
        _compare_ways(h, call, candidates, baseline="module_guards")
    # a compiled round's k drafts, then the round after its drafts, each in one call (the package's
    # way) against k draft steps / op by op (its own fallback, the call not made), greedy and sampled
    # (each run drawing from a generator seeded alike: the same tokens either way)
    target_model, draft_model = pairs["default"]

    def sampled(t, d):
        generator = torch.Generator(h.device).manual_seed(0)
        return speculative_generate(t, d, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculate_k=SPECULATE_K,
                                    compile=True, temperature=SAMPLED_TEMPERATURE, generator=generator).sequences

    def penalised(t, d):
        return speculative_generate(t, d, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculate_k=SPECULATE_K,
                                    compile=True, **PENALTIES).sequences

    for ways, name, one_call, stepped in (("drafts", "drafts_function", "drafts_in_one_call", "drafts_step_by_step"),
                                          ("verify", "verify_function", "verify_in_one_call", "verify_op_by_op")):
        for call, speculative in ((f"speculative_{ways}", calls["speculative"]),
                                  (f"speculative_sampled_{ways}", sampled),
                                  (f"speculative_penalised_{ways}", penalised)):
            candidates = {one_call: lambda fn=speculative: fn(target_model, draft_model),
                          stepped: lambda fn=speculative, name=name: _without(
                              speculative_module, name, lambda: fn(target_model, draft_model))}
            _compare_ways(h, call, candidates, baseline=stepped)
    prompts = [list(prompt.encode()) for prompt in code_prompts(corpus, BATCHER_REQUESTS)]

    def batched(make, attributes: tuple, one_call: bool, requests: list, new_tokens: int):
        # (``attributes``: the batcher's compiled calls, each None without one_call; "proposer.x": its proposer's)
        batcher = make(target_model, batch_size=BATCHER_ROWS, max_length=max(map(len, requests)) + new_tokens,
                       eos_token_id=[], compile=True)
        if not one_call:
            for attribute in attributes:
                owner, _, name = attribute.rpartition(".")
                setattr(getattr(batcher, owner) if owner else batcher, name, None)
        for prompt in requests:
            batcher.submit(prompt, max_new_tokens=new_tokens)
        return torch.tensor(list(batcher.run().values()))

    speculative_batcher = functools.partial(SpeculativeBatcher, draft_model=draft_model, speculate_k=SPECULATE_K)
    # speculative_batcher_merged's: many short requests, so that many rounds take a new prompt in
    arriving = [list(prompt.encode())[:MERGED_PROMPT] for prompt in code_prompts(corpus, MERGED_REQUESTS)]
    for call, make, attributes, (one_call, stepped), requests, new_tokens in (
            # a SpeculativeBatcher's round after its drafts in one call of the target (the package's way)
            # against its forward compiled alone and the rest op by op
            ("speculative_batcher_verify", speculative_batcher, ("verify_going",),
             ("verify_in_one_call", "verify_op_by_op"), prompts, NEW_TOKENS),
            # its rounds that take new prompts in (their first forwards as wide as the prompts): the drafts
            # after the draft's and the rest after the target's in one call each, against step by step and
            # op by op
            ("speculative_batcher_merged", speculative_batcher, ("verified_going", "proposer.drafts_after"),
             ("after_the_forwards_in_one_call", "step_by_step"), arriving, MERGED_NEW_TOKENS),
            # a ContinuousBatcher's step, its pick and the decode forward in one call, against the pick run
            # eagerly and the forward compiled alone
            ("continuous_decode", ContinuousBatcher, ("decode_going",), ("pick_in_the_call", "pick_eagerly"), prompts,
             NEW_TOKENS)):
        _compare_ways(h, call, {way: functools.partial(batched, make, attributes, way == one_call, requests, new_tokens)
                                for way in (one_call, stepped)},
                      baseline=stepped, new_tokens=new_tokens * len(requests))
    # the rows' end read a round late (the package's way on a GPU) against after each round
    lagged_on_this_device = (torch.device(h.device).type,)
    candidates = {"read_a_round_late": lambda: _watched(lagged_on_this_device, calls["speculative"], pairs["default"]),
                  "read_each_round": lambda: _watched((), calls["speculative"], pairs["default"])}
    _compare_ways(h, "speculative_watch", candidates, baseline="read_each_round")

    def limited(t, d):  # (a per-row limit, so that generate watches the rows' end)
        return generate(t, ids, max_new_tokens=[NEW_TOKENS], eos_token_id=[], compile=True).sequences

    candidates = {"read_a_step_late": lambda: _watched(lagged_on_this_device, limited, pairs["default"]),
                  "read_each_step": lambda: _watched((), limited, pairs["default"])}
    _compare_ways(h, "generate_watch", candidates, baseline="read_each_step")
    # generate's pick inside its compiled step (the package's way) against after it, greedy and sampled

    def generated(options):
        generator = torch.Generator(h.device).manual_seed(0)
        return generate(target_model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], compile=True,
                        generator=generator, **options).sequences

    for call, options in (("generate_pick", {}), ("generate_sampled_pick", dict(temperature=SAMPLED_TEMPERATURE)),
                          ("generate_penalised_pick", PENALTIES)):
        candidates = {"pick_in_the_step": lambda o=options: generated(o),
                      "pick_after_the_step": lambda o=options: _picking_after_the_step(generated, o)}
        _compare_ways(h, call, candidates, baseline="pick_after_the_step")


def _compare_ways(h, call: str, candidates: dict, baseline: str, new_tokens: int = NEW_TOKENS) -> None:
    """Rows timing two ways of the same generation (``candidates``: name -> a run returning its tokens,
    ``new_tokens`` in all), after a first run of each (which also compiles) has shown they generate
    the same tokens."""
    outputs = [fn() for fn in candidates.values()]
    if not torch.equal(outputs[0], outputs[1]):
        raise RuntimeError(f"bench_compiled_step: {call}: {' and '.join(candidates)} generated other tokens")
    rows = h.compare("compiled_step", {"call": call, "new_tokens": new_tokens, "model": "demo"}, candidates,
                     baseline=baseline)
    for row in rows:
        row["tokens_per_s"] = new_tokens / (row["ms_median"] * 1e-3)


def _picking_after_the_step(generated, options: dict):
    """``generated(options)`` with generate's compiled step a forward alone, its pick run eagerly after it."""
    return _without(generate_module, "decode_function", lambda: generated(options))


def _watched(lagged_devices: tuple, generation, pair):
    """``generation(*pair)`` (speculative or not) with its loop on ``lagged_devices`` reading the rows' end a
    call late."""
    original = EndWatch.LAGGED_DEVICES
    EndWatch.LAGGED_DEVICES = lagged_devices
    try:
        return generation(*pair)
    finally:
        EndWatch.LAGGED_DEVICES = original


def _without(module, name: str, run):
    """``run()`` while ``module.name`` (a function making a compiled call) gives None, as when the call is
    not to be made."""
    original = getattr(module, name)
    setattr(module, name, lambda model: None)
    try:
        return run()
    finally:
        setattr(module, name, original)
