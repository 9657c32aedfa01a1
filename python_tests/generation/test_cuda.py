"""The whole stack on a GPU (skipped without one): patched tiny models on CUDA run the CUDA kernels
inside transformers' forward. Greedy generate equals transformers' generate (float32); the
compiled, CUDA-graph decode step gives the same tokens as eager decoding; batched speculative
decoding equals the target's own greedy output, eager and compiled; bf16 logits stay within twice
transformers' own bf16 error."""

import pytest
import torch

import gptfast_kernels.generation.speculative as speculative_module
from bench.cuda_graph_records import GraphRecords
from gptfast_kernels import StaticKVCache, _extension, generate, patch_model, speculative_generate
from gptfast_kernels.generation import forward
from gptfast_kernels.generation.stopping import token_bytes
from gptfast_kernels.generation.end_watch import EndWatch
from python_tests.tiny_models import PAD, draft_of, hf_greedy, patched_copy, ragged_prompts, tiny_model
from python_tests.tiny_tokenizers import byte_level_tokenizer, stop_string_from

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and not _extension.ops_without_kernel("CUDA")),
    reason="requires CUDA and an extension built with CUDA")

NEW = 16


def _on_cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.fixture
def graph_records(monkeypatch) -> GraphRecords:
    """The CUDA graphs that the test's compiled calls record (bench.cuda_graph_records)."""
    records = GraphRecords()
    for owner, name, replacement in records.patches():
        monkeypatch.setattr(owner, name, replacement)
    return records


def _assert_recorded_once(records: GraphRecords) -> None:
    """Some graph was recorded, and none twice: every later call of a compiled function replayed its
    graph (a static input that moved, or a state allocated anew per call, would record it again)."""
    assert records.recorded and records.again == 0, records.reasons


def _recorded_watches(monkeypatch) -> list:
    """The EndWatch instances made from now on, in order."""
    watches, init = [], EndWatch.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        watches.append(self)

    monkeypatch.setattr(EndWatch, "__init__", recording)
    return watches


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gpt2", "qwen3_5_text", "gemma4_text",
                                    "deepseek_v3", "deepseek_v2", "mimo_v2_flash", "gptj", "falcon", "bloom", "mpt",
                                    "beam", "mamba2", "zamba2"])
def test_greedy_equals_transformers(family):
    model = tiny_model(family).cuda()
    patched = patched_copy(model, int8=False)
    ids, mask = _on_cuda(*ragged_prompts(3, 7, "left"))
    want = hf_greedy(model, ids, mask, NEW, eos_token_id=None)
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_5_text", "lfm2", "falcon_h1", "stablelm", "dbrx",
                                    "gemma4_text", "gemma3n_text", "deepseek_v3", "mimo_v2_flash", "gptj",
                                    "falcon", "bloom", "mpt", "beam", "mamba", "mamba2", "zamba2"])
def test_compiled_cuda_graph_decode_equals_eager(family, graph_records):
    """compile=True: torch.compile(fullgraph=True) with CUDA graphs per step, so the decode
    step replays a CUDA graph holding the int8 and attention kernels; called twice (graph reuse).
    The hybrids' recurrent states (transformers' state layers, updated in place) must survive the
    graph's replays too, as must StableLM's per-attention-module cache hook, DBRX's Int8Experts
    on [B, T, H] hidden states, Gemma 4's layers attending over other layers' buffers and
    DeepSeek-V3's absorbed latent attention, and the attention-free Mamba models' states alone."""
    from torch._dynamo.utils import counters

    patched = patch_model(tiny_model(family).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(3, 7, "left"))
    eager = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    skips_before = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        assert torch.equal(generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True).sequences,
                           eager)
    # inductor did not fall back to eager launches (e.g. for a mutated input it cannot keep static)
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    _assert_recorded_once(graph_records)  # (the second call replayed the first's graphs)


def test_compiled_sampled_decode_picks_in_the_cuda_graph(monkeypatch, graph_records):
    """generate's compiled step with its pick in the graph: per-row sampling at the step's uniforms,
    eos held back by min_new_tokens, per-row limits and log-probabilities, on state buffers the
    graph updates in place (no CUDA-graph skip for them): the same tokens and log-probabilities as
    eager steps from the same seed, twice (the state's buffers reused), with the rows' end read a
    step late through pinned memory (EndWatch), eager steps and compiled alike."""
    from torch._dynamo.utils import counters

    watches = _recorded_watches(monkeypatch)
    patched = patch_model(tiny_model("llama", layers=3).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(3, 7, "left", seed=8))
    options = dict(max_new_tokens=[NEW, 5, NEW], min_new_tokens=3, eos_token_id=[4, 9], output_logprobs=True,
                   temperature=[0.0, 0.9, 1.2], top_k=[None, 8, None], top_p=[None, None, 0.9])

    def run(compile):
        return generate(patched, ids, mask, compile=compile, generator=torch.Generator("cuda").manual_seed(2),
                        **options)

    eager = run(False)
    skips_before = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        compiled = run(True)
        assert torch.equal(compiled.sequences, eager.sequences)
        torch.testing.assert_close(compiled.logprobs, eager.logprobs)
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    _assert_recorded_once(graph_records)
    assert hasattr(patched, "_gptfast_compiled_decode")
    assert len(watches) == 3 and all(watch.lagged and watch.copies[0].is_pinned() and watch.events[0] is not None
                                     for watch in watches)
    with pytest.raises(ValueError, match="generator must be on the model's device type"):
        generate(patched, ids, mask, max_new_tokens=2, temperature=1.0, generator=torch.Generator())


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "gpt_oss", "gemma4_text"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_ring_buffer_layers_equal_full_length_caches(family, compile, monkeypatch, graph_records):
    """Sliding-window layers as ring buffers of window + 2 slots (prompt chunks of 3), on the CUDA
    kernels, in CUDA graphs when compiled: the tokens equal those of full-length caches, float32."""
    patched = patch_model(tiny_model(family).cuda(), int8=False)
    ids, mask = _on_cuda(*ragged_prompts(3, 7, "left"))
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)
    got = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=compile).sequences
    assert torch.equal(got, want)
    if compile:
        _assert_recorded_once(graph_records)


# (rows, prompt length, seed) of each call in turn
TURNS = {
    # the smaller batch on the kept caches' first rows, a decode state per size (before 2026-11-30
    # every switch allocated the caches anew and recorded the graphs again)
    "batch_sizes": ((3, 7, 0), (2, 7, 1), (3, 7, 2), (2, 7, 3)),
    # one prompt longer than the short batch's cache: the model keeps both caches (forward.KEPT_CACHES;
    # before, each turn allocated a cache and recorded the graphs again)
    "short_batch_and_long_prompt": ((3, 7, 0), (1, forward.CACHE_LEN_QUANTUM + 8, 1)) * 2,
}


@pytest.mark.parametrize("turns", TURNS)
def test_calls_in_turn_replay_their_cuda_graphs(graph_records, turns):
    """Compiled generate and speculative rounds whose shapes take turns: each shape's graphs are
    recorded once and then replayed, each call equal to eager generate."""
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    for B, length, seed in TURNS[turns]:
        ids, mask = _on_cuda(*ragged_prompts(B, length, "left", seed=seed))
        want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
        assert torch.equal(generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True).sequences,
                           want)
        assert torch.equal(speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=3,
                                                eos_token_id=[], compile=True).sequences, want)
    _assert_recorded_once(graph_records)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text", "falcon_h1", "mamba2", "zamba2", "lfm2"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_speculative_equals_target_greedy(family, compile, graph_records):
    """Hybrids too: their recurrent states roll back through the cache's state history, whose slots
    a CUDA graph replays writes into (compiled)."""
    target = tiny_model(family, layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(4, 6, "left", seed=4))
    want = generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
    out = speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=4, eos_token_id=[],
                               compile=compile)
    assert torch.equal(out.sequences, want)
    assert 0 < out.acceptance_rate < 1
    if compile:
        _assert_recorded_once(graph_records)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_penalised_speculative_equals_penalised_generate(compile, graph_records):
    """The penalties' per-row state (seen tokens, generated counts) and the stop patterns' states live
    on the GPU beside the compiled steps: penalised speculative greedy equals penalised generate, and
    both stop at the same stop sequence and stop string. Compiled, the record is written inside the
    decode step's and the round's CUDA graphs (kept static: no CUDA-graph skip)."""
    from torch._dynamo.utils import counters

    skips_before = counters["inductor"]["cudagraph_skips"]
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(4, 6, "left", seed=4))
    options = dict(max_new_tokens=NEW, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.8,
                   eos_token_id=[])
    free = generate(patched, ids, mask, compile=compile, **options).sequences
    options["stop_sequences"] = [free[1, 6 + 4:6 + 6].tolist()]  # (row 1 makes it: it stops by new token 5)
    tokenizer = byte_level_tokenizer()  # and a stop string row 2 makes (the automaton's tables on the GPU)
    options.update(stop_strings=[stop_string_from(token_bytes(tokenizer), free[2, 6:].tolist())], tokenizer=tokenizer)
    want = generate(patched, ids, mask, compile=compile, **options).sequences
    assert want.shape[1] < free.shape[1] or bool((want[1, 6 + 6:] == PAD).all())
    assert bool((want[2, 6:] == PAD).any())
    out = speculative_generate(patched, draft, ids, mask, speculate_k=4, compile=compile, **options)
    assert torch.equal(out.sequences, want)
    if compile:
        _assert_recorded_once(graph_records)
        assert counters["inductor"]["cudagraph_skips"] == skips_before
        assert hasattr(patched, "_gptfast_compiled_verify") and hasattr(draft, "_gptfast_compiled_drafts")


def test_stops_are_matched_inside_the_cuda_graphs(graph_records):
    """Without penalties the stop automata run inside generate's compiled step and the speculative
    round's call (their states in the state buffers, marked static: no CUDA-graph skip): both stop
    where eager generate does, at a stop sequence and a stop string."""
    from torch._dynamo.utils import counters

    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(4, 6, "left", seed=4))
    options = dict(max_new_tokens=NEW, eos_token_id=[], min_new_tokens=2)
    free = generate(patched, ids, mask, **options).sequences
    tokenizer = byte_level_tokenizer()
    options.update(stop_sequences=[free[1, 6 + 4:6 + 6].tolist()], tokenizer=tokenizer,
                   stop_strings=[stop_string_from(token_bytes(tokenizer), free[2, 6:].tolist())])
    want = generate(patched, ids, mask, **options).sequences
    assert bool((want[1, 6 + 6:] == PAD).all()) and bool((want[2, 6:] == PAD).any())
    skips_before = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        assert torch.equal(generate(patched, ids, mask, compile=True, **options).sequences, want)
        assert torch.equal(speculative_generate(patched, draft, ids, mask, speculate_k=4, compile=True,
                                                **options).sequences, want)
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    _assert_recorded_once(graph_records)
    assert hasattr(patched, "_gptfast_compiled_decode") and hasattr(patched, "_gptfast_compiled_verify")


def test_per_row_sampling_rows_sample_as_alone(graph_records):
    """Per-row temperature / top-k / top-p on the GPU, compiled rounds: each row of a batch of greedy
    and sampled rows samples as it would with its values for the whole batch (the GPU's
    multinomial draws the same noise whatever the distributions)."""
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(3, 6, "left", seed=6))
    rows = [(0.0, None, None), (0.8, 5, None), (1.2, None, 0.8)]

    def run(per_row):
        columns = dict(zip(("temperature", "top_k", "top_p"), map(list, zip(*per_row))))
        return speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[],
                                    compile=True, generator=torch.Generator("cuda").manual_seed(5),
                                    **columns).sequences

    mixed = run(rows)
    for b, row in enumerate(rows):
        assert torch.equal(mixed[b], run([row] * 3)[b])
    assert torch.equal(mixed[0], generate(patched, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences[0])
    _assert_recorded_once(graph_records)


def test_sampled_compiled_rounds_draft_in_one_cuda_graph(monkeypatch, graph_records):
    """Compiled and sampled, a round's drafts are one call of the draft (one CUDA graph, sampling at
    uniforms drawn outside it): the same tokens and acceptances as compiled rounds drafting step by
    step from the same generator seed."""
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(3, 6, "left", seed=7))

    def run():
        return speculative_generate(patched, draft, ids, mask, max_new_tokens=NEW, speculate_k=3, eos_token_id=[],
                                    compile=True, generator=torch.Generator("cuda").manual_seed(9),
                                    temperature=[0.0, 0.9, 1.1], top_k=[None, 12, None], top_p=[None, None, 0.85])

    calls = []
    original = speculative_module.drafts_function

    def counted(model):
        drafts = original(model)
        return lambda *args: calls.append(args) or drafts(*args)

    monkeypatch.setattr(speculative_module, "drafts_function", counted)
    in_one_call = run()
    assert calls and all(args[-1] is not None for args in calls)  # (sampled: the uniforms and filters)
    monkeypatch.setattr(speculative_module, "drafts_function", lambda model: None)
    step_by_step = run()
    assert torch.equal(in_one_call.sequences, step_by_step.sequences)
    assert torch.equal(in_one_call.num_accepted, step_by_step.num_accepted) and 0 < in_one_call.acceptance_rate < 1
    _assert_recorded_once(graph_records)


def test_compiled_rounds_verify_in_one_cuda_graph(monkeypatch, graph_records):
    """A compiled round after its drafts in one CUDA graph (verify_step: the target's forward,
    verification and the rows' state): per-row sampling, eos held back by min_new_tokens, per-row
    limits and log-probabilities, on state buffers the graph updates in place (no CUDA-graph skip
    for them): the same tokens, acceptances and log-probabilities as eager rounds from the same
    seed, twice (the state's buffers reused), with the rows' end read a round late through pinned
    memory (EndWatch)."""
    from torch._dynamo.utils import counters

    watches = _recorded_watches(monkeypatch)
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patch_model(draft_of(target, 2).cuda(), int8=True)
    ids, mask = _on_cuda(*ragged_prompts(3, 7, "left", seed=8))
    options = dict(max_new_tokens=[NEW, 5, NEW], min_new_tokens=3, eos_token_id=[4, 9], output_logprobs=True,
                   temperature=[0.0, 0.9, 1.2], top_k=[None, 8, None], top_p=[None, None, 0.9], speculate_k=3)

    def run(compile):
        return speculative_generate(patched, draft, ids, mask, compile=compile,
                                    generator=torch.Generator("cuda").manual_seed(2), **options)

    eager = run(False)
    skips_before = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        compiled = run(True)
        assert torch.equal(compiled.sequences, eager.sequences)
        assert torch.equal(compiled.num_accepted, eager.num_accepted)
        torch.testing.assert_close(compiled.logprobs, eager.logprobs)
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    _assert_recorded_once(graph_records)
    assert hasattr(patched, "_gptfast_compiled_verify")
    assert [watch.lagged for watch in watches] == [False, True, True]  # (eager rounds read each round's end)
    assert all(watch.copies[0].is_pinned() and watch.events[0] is not None for watch in watches[1:])


def _served_as_alone(batcher, patched, seed: int) -> None:
    """Five requests of different lengths and limits through ``batcher`` (two rows: reused
    mid-batch): each gets the tokens generate gives its prompt alone."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4)]
    limits = (6, 3, 9, 4, 7)
    for p, n in zip(prompts, limits):
        batcher.submit(p, max_new_tokens=n)
    out = batcher.run()
    for i, (p, n) in enumerate(zip(prompts, limits)):
        alone = generate(patched, torch.tensor([p], device="cuda"), max_new_tokens=n, eos_token_id=[]).sequences
        assert out[i] == alone[0, len(p):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_continuous_batching_requests_equal_generate_alone(family, graph_records):
    """ContinuousBatcher on the GPU, compiled (CUDA-graph) decode steps: rows reused mid-batch give
    every greedy request the tokens generate gives its prompt alone (a hybrid's recurrent states,
    which the graphs update in place, kept per row); a step's pick and forward are one call
    (_decode_going), with no CUDA-graph skip."""
    from torch._dynamo.utils import counters

    from gptfast_kernels import ContinuousBatcher

    skips_before = counters["inductor"]["cudagraph_skips"]
    patched = patched_copy(tiny_model(family, layers=3).cuda(), int8=True)
    _served_as_alone(ContinuousBatcher(patched, batch_size=2, max_length=24, eos_token_id=[], compile=True), patched, 3)
    _assert_recorded_once(graph_records)
    assert hasattr(patched, "_gptfast_compiled_decode_going")
    assert counters["inductor"]["cudagraph_skips"] == skips_before


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_speculative_batching_requests_equal_generate_alone(proposer, graph_records):
    """SpeculativeBatcher on the GPU, compiled (CUDA-graph) rounds of int8 models: rows reused
    mid-batch give every greedy request the tokens generate gives its prompt alone; the rounds
    after their drafts are the target's calls (_verify_going; those that take a new prompt in,
    after their wide forwards: _verified_going, and the draft's _drafts_after), with no CUDA-graph
    skip."""
    from torch._dynamo.utils import counters

    from gptfast_kernels import SpeculativeBatcher

    skips_before = counters["inductor"]["cudagraph_skips"]
    target = tiny_model("llama", layers=3).cuda()
    patched = patched_copy(target, int8=True)
    draft = patched_copy(draft_of(target).cuda(), int8=True) if proposer == "draft" else None
    _served_as_alone(SpeculativeBatcher(patched, draft, speculate_k=3, batch_size=2, max_length=24, eos_token_id=[],
                                        compile=True), patched, 4)
    _assert_recorded_once(graph_records)
    called = [patched._gptfast_compiled_verify_going, patched._gptfast_compiled_verified_going]
    if draft is not None:
        called.append(draft._gptfast_compiled_drafts_after)
    assert all(step.compiled is not None for step in called)  # (each compiled at its first call)
    assert counters["inductor"]["cudagraph_skips"] == skips_before


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_logits_within_twice_transformers_error(family):
    """Prefill then two decode steps in bf16 through the CUDA kernels, against float64: our error is
    at most twice transformers' own bf16 error on the same model (plus a small floor)."""
    model = tiny_model(family)
    ids, mask = ragged_prompts(2, 9, "left")
    # each row's real tokens at positions 0.. (as generate and the patched model place them; a plain
    # transformers forward would count GPT-2's absolute positions from the padding)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model.double()(ids, attention_mask=mask, position_ids=position_ids).logits
        hf = model.to("cuda", torch.bfloat16)(ids.cuda(), attention_mask=mask.cuda(),
                                              position_ids=position_ids.cuda()).logits.double().cpu()
        patched = patched_copy(model, int8=False)
        cache = StaticKVCache(patched.config, 2, 16, device="cuda", dtype=torch.bfloat16)
        parts = [patched(ids[:, :7].cuda(), attention_mask=mask[:, :7].cuda(), past_key_values=cache).logits,
                 patched(ids[:, 7:8].cuda(), past_key_values=cache).logits,
                 patched(ids[:, 8:].cuda(), past_key_values=cache).logits]
    got = torch.cat(parts, dim=1).double().cpu()
    real = mask.bool()  # padded positions' logits are not part of the contract
    hf_error = (hf - want)[real].abs().max().item()
    our_error = (got - want)[real].abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2, (our_error, hf_error)
