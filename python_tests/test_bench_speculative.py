"""bench/bench_speculative.py's measure of a round's time outside the forwards: the recorder
replays exactly the forwards a speculative run made, each seeing the cache it saw then, and
refuses runs it cannot replay faithfully."""

import types

import pytest
import torch
from torch.utils._pytree import tree_map

import gptfast_kernels.generation.speculative as speculative_module
from bench import bench_speculative
from gptfast_kernels import patch_model, speculative_generate
from python_tests.tiny_models import VOCAB, draft_of, tiny_model


def _pair(family: str):
    target = tiny_model(family)
    draft = draft_of(target)  # (before patch_model swaps the target's layers)
    return patch_model(target), patch_model(draft)


def _run(target, draft, ids, new_tokens: int = 10):
    return speculative_generate(target, draft, ids, max_new_tokens=new_tokens,
                                speculate_k=bench_speculative.SPECULATE_K, eos_token_id=[])


def _logging(original, logged: list):
    """``original`` (a step_function-like maker) whose functions also append a copy of each output
    to ``logged``."""
    def make(model, *options, **keywords):
        step = original(model, *options, **keywords)

        def run(*args):
            out = step(*args)
            logged.append(tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out))
            return out
        return run
    return make


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral's tiny config: ring-buffer (window) layers
def test_replay_repeats_the_runs_forwards(monkeypatch, family):
    target, draft = _pair(family)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    logged = []
    logging = _logging(speculative_module.step_function, logged)
    monkeypatch.setattr(speculative_module, "step_function", logging)
    with torch.no_grad():
        with bench_speculative._ForwardRecorder() as recorder:
            out = _run(target, draft, ids)
        run_logits, logged[:] = list(logged), []
        rounds = int(out.num_proposed.max()) // bench_speculative.SPECULATE_K
        # each round: k draft forwards (the first of two tokens) and the target's of k + 1
        assert recorder.replayable
        assert len(recorder.calls) == rounds * (bench_speculative.SPECULATE_K + 1)
        assert [args[0].shape[1] for _, args, *_ in recorder.calls[:5]] == [2, 1, 1, 1, 5]
        recorder.replay()
    assert speculative_module.step_function is logging  # restored
    assert len(logged) == len(run_logits)
    for replayed, original_logits in zip(logged, run_logits):
        torch.testing.assert_close(replayed, original_logits, rtol=0, atol=0)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_compiled_rounds_replay_their_drafts_call(monkeypatch, sampling):
    """Compiled, a round drafts in one call (speculative.drafts_function), greedy or sampled: the
    recorder and the clock see it beside the target's call (its forward and the round's
    verification: speculative.verify_function; two calls a round), and the replay, each call on the
    cache lengths and round state it had, gives the run's drafts (sampled: at the run's uniforms)
    and the target call's outputs exactly."""
    target, draft = _pair("llama")
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    logged = []
    for name in ("step_function", "drafts_function", "verify_function"):
        monkeypatch.setattr(speculative_module, name, _logging(getattr(speculative_module, name), logged))

    def run():
        return speculative_generate(target, draft, ids, max_new_tokens=10, speculate_k=bench_speculative.SPECULATE_K,
                                    eos_token_id=[], compile=True, generator=torch.Generator().manual_seed(3),
                                    **sampling)

    with torch.no_grad():
        run()  # (compiles)
        logged[:] = []
        with bench_speculative._ForwardRecorder() as recorder:
            out = run()
        run_outputs, logged[:] = list(logged), []
        rounds = int(out.num_proposed.max()) // bench_speculative.SPECULATE_K
        assert recorder.replayable and len(recorder.calls) == 2 * rounds
        # (the drafts call's first two tokens a row; the target's call takes the k drafts)
        assert [args[0].shape[1] for _, args, *_ in recorder.calls[:2]] == [2, bench_speculative.SPECULATE_K]
        recorder.replay()
        assert len(logged) == len(run_outputs) == 2 * rounds
        for replayed, original in zip(logged, run_outputs):
            torch.testing.assert_close(replayed, original, rtol=0, atol=0)
    # (with gradients on, as _rounds_rows calls it: the replay compiled the steps again with grad and
    # failed tracing kv_cache_attention's backward, before any row was written)
    h = types.SimpleNamespace(device=torch.device("cpu"))
    fields, _ = bench_speculative._timed_rounds(h, run, 2, 10, 0.0)
    assert fields["step_calls_per_run"] == 2 * rounds and 0 <= fields["fraction_outside_forwards_upper"] < 1
    assert fields["fraction_outside_forwards"] is not None


def test_recurrent_caches_are_not_replayed():
    target, draft = (patch_model(tiny_model("qwen3_5_text", seed=seed)) for seed in (0, 1))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), bench_speculative._ForwardRecorder() as recorder:
        _run(target, draft, ids, new_tokens=4)
    assert recorder.calls and not recorder.replayable


def test_timed_rounds_reports_both_measures():
    target, draft = _pair("llama")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    h = types.SimpleNamespace(device=torch.device("cpu"))
    with torch.no_grad():
        fields, out = bench_speculative._timed_rounds(h, lambda: _run(target, draft, ids), 1, 10, 0.0)
    rounds = int(out.num_proposed.max()) // bench_speculative.SPECULATE_K
    assert fields["step_calls_per_run"] == rounds * (bench_speculative.SPECULATE_K + 1)
    for name in ("fraction_outside_forwards", "fraction_outside_forwards_upper"):
        assert fields[name] is not None and fields[name] < 1


def test_assistant_steps_are_not_replayed():
    """A Gemma 4 assistant's steps take the previous step's outputs: the recorder says so rather than
    replay the target's forwards alone."""
    from python_tests.generation.test_assistant import _assistant_for

    model = tiny_model("gemma4_text", layers=4, vocab=97)
    assistant = _assistant_for(model)  # (before patch_model swaps the target's layers)
    patched = patch_model(model, int8=False)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), bench_speculative._ForwardRecorder() as recorder:
        _run(patched, assistant, ids, new_tokens=4)
    assert recorder.calls and not recorder.replayable
