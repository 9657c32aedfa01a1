"""Every compiled call of the generation loops is a graph that CUDA graph trees can capture whole,
checked on any device. On a GPU inductor replays a graph only if every input it writes in place
is static (a parameter, a buffer or a tensor marked with torch._dynamo.mark_static_address); one
unmarked state tensor written in the graph and inductor runs that graph without CUDA graphs, with
nothing but a logged warning (the step then pays every kernel's launch again). A static input must
also keep its address from call to call, or the tree records the graph again. Both follow from
inductor's own bookkeeping of each compiled graph (its mutated and static input indices), which is
the same on a CPU: it is read here, for each way the package compiles a model's calls."""

import dataclasses
import inspect

import pytest
import torch
import torch._inductor.output_code as output_code

from gptfast_kernels import (ContinuousBatcher, SpeculativeBatcher, generate, prompt_lookup_generate,
                             speculative_generate)
from gptfast_kernels.generation.forward import CACHE_LEN_QUANTUM
from python_tests.tiny_models import draft_of, patched_copy, ragged_prompts, tiny_model

NEW = 6


@dataclasses.dataclass
class Graph:
    """One graph inductor compiled: its inputs' names, which it writes in place, which are static,
    the kinds of its inputs that are not tensors, and per static tensor input the addresses it was
    called with."""
    names: list[str]
    mutated: set[int]
    static: set[int]
    not_tensors: list[str]
    addresses: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    calls: int = 0

    def problems(self) -> list[str]:
        unmarked = [self.names[i] for i in sorted(self.mutated - self.static)]
        moved = [self.names[i] for i, seen in sorted(self.addresses.items()) if len(seen) > 1]
        return ([f"writes inputs that are not static: {unmarked}"] * bool(unmarked)
                + [f"inputs that are not tensors: {self.not_tensors}"] * bool(self.not_tensors)
                + [f"static inputs whose address changed between calls: {moved}"] * bool(moved))


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The graphs inductor compiles in the test (its FX graph and AOT caches off, so that each is
    compiled here, not loaded), each with the addresses of its static inputs at every call."""
    graphs: list[Graph] = []
    init, call = output_code.CompiledFxGraph.__init__, output_code.CompiledFxGraph.__call__
    signature = inspect.signature(init)
    assert "static_input_idxs" in signature.parameters, "inductor's CompiledFxGraph no longer says its static inputs"

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        names = [node.name for node in arguments["gm"].graph.nodes if node.op == "placeholder"]
        not_tensors = [type(value).__name__ for value in arguments["example_inputs"]
                       if not isinstance(value, (torch.Tensor, torch.SymInt, torch.Generator))]
        self._recorded = Graph(names, set(self.mutated_input_idxs), set(arguments["static_input_idxs"]), not_tensors)
        graphs.append(self._recorded)

    def recording_call(self, inputs):
        recorded = self._recorded
        recorded.calls += 1
        for index in recorded.static:
            if isinstance(inputs[index], torch.Tensor):
                recorded.addresses.setdefault(index, set()).add(inputs[index].data_ptr())
        return call(self, inputs)

    monkeypatch.setattr(output_code.CompiledFxGraph, "__init__", recording_init)
    monkeypatch.setattr(output_code.CompiledFxGraph, "__call__", recording_call)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield graphs


def _assert_captured_whole(graphs: list[Graph]) -> None:
    assert graphs and all(graph.calls for graph in graphs), [graph.calls for graph in graphs]
    problems = [(i, problem) for i, graph in enumerate(graphs) for problem in graph.problems()]
    assert not problems, problems


def _prompts():
    return ragged_prompts(2, 6, "left")


def _submitted(batcher, ids, mask, **options):
    """One request more than the batch's rows (a finished row's slot is refilled), greedy and sampled
    in turn; the last, greedy, outlives the others, so that greedy rows run beside sampled ones and
    alone (a step's call is a graph of its own for each) whatever the prompts.
    ``options``: each request's too."""
    B = ids.shape[0]
    for row in range(B + 1):
        batcher.submit(ids[row % B][mask[row % B].bool()].tolist(), max_new_tokens=4 if row < B else 16,
                       temperature=0.5 * (row % 2), **options)
    batcher.run()


def _merging(batcher, ids, mask):
    """A speculative batcher's every kind of round: a greedy request that outlives the others (its
    rounds beside them and alone); beside it, requests that end with their first token free their
    rows at once, so that the next prompt goes in through a round of its own (merged), one per step:
    a greedy one, a sampled one, then a sampled request that goes on decoding beside the first."""
    B = ids.shape[0]
    prompts = [ids[row][mask[row].bool()].tolist() for row in range(B)]
    batcher.submit(prompts[0], max_new_tokens=30)
    for row in range(1, B):
        batcher.submit(prompts[row], max_new_tokens=1, temperature=0.5)
    batcher.step()
    for temperature, new_tokens in ((0.0, 1), (0.5, 1), (0.5, 4)):
        batcher.submit(prompts[-1], max_new_tokens=new_tokens, temperature=temperature)
        batcher.step()
    batcher.run()


SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.2, stop_sequences=[[3, 4]],
               eos_token_id=[5])

# each way a model's calls are compiled: (name, run(target, draft, ids, mask))
CALLS = {
    "generate": lambda target, draft, ids, mask: generate(target, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                                          compile=True),
    "generate_sampled": lambda target, draft, ids, mask: generate(
        target, ids, mask, max_new_tokens=NEW, min_new_tokens=2, output_logprobs=True, compile=True, **SAMPLED),
    "speculative": lambda target, draft, ids, mask: speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True),
    "speculative_sampled": lambda target, draft, ids, mask: speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, compile=True, **SAMPLED),
    "prompt_lookup": lambda target, draft, ids, mask: prompt_lookup_generate(
        target, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True),
    "continuous": lambda target, draft, ids, mask: _submitted(
        ContinuousBatcher(target, batch_size=ids.shape[0], max_length=28, eos_token_id=[], compile=True), ids, mask),
    # (the penalties' record and the kept logits, which the step's call writes, kept beside the cache)
    "continuous_penalised": lambda target, draft, ids, mask: _submitted(
        ContinuousBatcher(target, batch_size=ids.shape[0], max_length=28, eos_token_id=[], compile=True), ids, mask,
        repetition_penalty=1.2, frequency_penalty=0.5),
    "speculative_batcher": lambda target, draft, ids, mask: _merging(
        SpeculativeBatcher(target, draft, speculate_k=3, batch_size=ids.shape[0], max_length=40, eos_token_id=[],
                           compile=True), ids, mask),
    "speculative_batcher_lookup": lambda target, draft, ids, mask: _merging(
        SpeculativeBatcher(target, None, speculate_k=3, batch_size=ids.shape[0], max_length=40, eos_token_id=[],
                           compile=True), ids, mask),
}


def _models(family: str, draft_layers: int):
    model = tiny_model(family)
    return patched_copy(model, int8=True), patched_copy(draft_of(model, draft_layers), int8=True)


@pytest.mark.parametrize("name", CALLS)
def test_each_compiled_call_is_captured_whole(compiled_graphs, name):
    """Greedy and sampled generate (penalties, stop sequences, log-probabilities), speculative
    rounds (the drafts call and the target's verify call), prompt lookup and both batchers (the
    speculative one with a draft model and with prompt lookup). Called again with other prompts
    (longer, as a second request would be), the model's graphs serve it: none compiled anew, each
    static input where it was (on a GPU: the recorded CUDA graphs replayed, none recorded again)."""
    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    with torch.no_grad():
        CALLS[name](target, draft, ids, mask)
        compiled = len(compiled_graphs)
        calls = [graph.calls for graph in compiled_graphs]
        CALLS[name](target, draft, *ragged_prompts(2, 9, "left", seed=3))
    assert len(compiled_graphs) == compiled
    assert all(graph.calls > before for graph, before in zip(compiled_graphs, calls))
    _assert_captured_whole(compiled_graphs)


@pytest.mark.parametrize("name", CALLS)
def test_batch_sizes_in_turn_keep_their_graphs_inputs(compiled_graphs, name):
    """Batches of 3 rows and of 2 in turn, as a service's requests come: the smaller batch takes the
    kept cache's first rows and each size keeps its own decode state, so once both sizes have been
    compiled, no call compiles anew and every static input stays where it was (on a GPU: each
    size's CUDA graphs recorded once, then replayed; a cache allocated per size would move them)."""
    target, draft = _models("llama", 1)
    with torch.no_grad():
        CALLS[name](target, draft, *ragged_prompts(3, 6, "left"))
        CALLS[name](target, draft, *ragged_prompts(2, 6, "left", seed=1))
        compiled = len(compiled_graphs)
        CALLS[name](target, draft, *ragged_prompts(3, 8, "left", seed=2))
        CALLS[name](target, draft, *ragged_prompts(2, 9, "left", seed=3))
    assert len(compiled_graphs) == compiled
    _assert_captured_whole(compiled_graphs)


@pytest.mark.parametrize("name", ["generate", "speculative_sampled"])
def test_short_batches_and_a_long_prompt_in_turn_keep_their_graphs_inputs(compiled_graphs, name):
    """Three short prompts, then one prompt longer than their cache, in turn: neither call's cache
    serves the other, so the model keeps both (forward.KEPT_CACHES). After each has run once, no
    call compiles anew or brings a static input to an address it was not called with before (on a
    GPU: each call's CUDA graphs replayed; a cache allocated at every turn records them again)."""
    target, draft = _models("llama", 1)
    long = CACHE_LEN_QUANTUM + 8
    turns = [ragged_prompts(3, 6, "left"), ragged_prompts(1, long, "left", seed=1)]
    with torch.no_grad():
        for prompts in turns:
            CALLS[name](target, draft, *prompts)
        compiled = len(compiled_graphs)
        seen = [{index: set(addresses) for index, addresses in graph.addresses.items()} for graph in compiled_graphs]
        for prompts in turns * 2:
            CALLS[name](target, draft, *prompts)
    assert len(compiled_graphs) == compiled
    moved = [(i, graph.names[index]) for i, graph in enumerate(compiled_graphs)
             for index, addresses in graph.addresses.items() if not addresses <= seen[i].get(index, set())]
    assert not moved, moved


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_next"])
def test_batch_sizes_in_turn_decode_as_eager(family):
    """Compiled generate and speculative rounds with batches of 3, 2, 3 and 2 rows, the smaller on
    the kept caches' first rows (Gemma 2: ring buffers too; Qwen3-Next: recurrent states, a cache
    per call's size), each equal to eager generate."""
    target, draft = _models(family, 2)
    with torch.no_grad():
        for B, seed in ((3, 0), (2, 1), (3, 2), (2, 3)):
            ids, mask = ragged_prompts(B, 7, "left", seed=seed)
            want = generate(target, ids, mask, max_new_tokens=NEW, eos_token_id=[]).sequences
            assert torch.equal(generate(target, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                        compile=True).sequences, want)
            assert torch.equal(speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                                    compile=True).sequences, want)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma2", "deepseek_v3", "mamba2"])
def test_each_kind_of_cache_is_captured_whole(compiled_graphs, family):
    """The caches beside keys and values: a hybrid's recurrent states and their history (Qwen3-Next),
    sliding-window ring buffers (Gemma 2), latents (DeepSeek-V3), an attention-free model (Mamba 2)."""
    target, draft = _models(family, 2)
    ids, mask = _prompts()
    with torch.no_grad():
        CALLS["generate"](target, draft, ids, mask)
        CALLS["speculative"](target, draft, ids, mask)
    _assert_captured_whole(compiled_graphs)


@pytest.mark.parametrize("drafter", ["mtp", "assistant"])
def test_each_drafter_model_is_captured_whole(compiled_graphs, drafter):
    """Speculative rounds drafted by the target's MTP layer (GLM-4 MoE) or by a Gemma 4 assistant
    (which reads the target's keys and values): their own compiled draft steps too, with batches of
    3 rows and of 2 in turn (nothing compiled anew once both sizes were, no static input moved)."""
    from python_tests.generation import test_assistant, test_mtp

    if drafter == "mtp":
        _, _, target, draft = test_mtp._with_mtp("glm4_moe", int8=True)
        vocab = test_mtp.VOCAB
    else:
        model, target = test_assistant._target()
        draft, vocab = test_assistant._assistant_for(model), test_assistant.VOCAB
    compiled = []
    with torch.no_grad():
        for i, B in enumerate((3, 2, 3, 2)):
            ids, mask = ragged_prompts(B, 6 + i, "left", vocab=vocab, seed=i)
            speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True)
            compiled.append(len(compiled_graphs))
    assert compiled[1:] == [compiled[1]] * 3
    _assert_captured_whole(compiled_graphs)


def _graphs_after_each(graphs: list[Graph], target, draft, ids, mask, option_sets: list[dict]) -> list[int]:
    """Compiled generate and speculative_generate with each of ``option_sets`` in turn, each equal to
    eager generate -> the graphs compiled so far after each set."""
    compiled = []
    with torch.no_grad():
        for options in option_sets:
            want = generate(target, ids, mask, **options).sequences
            assert torch.equal(generate(target, ids, mask, compile=True, **options).sequences, want)
            assert torch.equal(speculative_generate(target, draft, ids, mask, compile=True, **options).sequences, want)
            compiled.append(len(graphs))
    return compiled


def test_stop_patterns_of_other_lengths_reuse_the_compiled_calls(compiled_graphs):
    """Compiled generate and speculative rounds with stop sequences and strings of other lengths
    (automata of 2 to 16 states: one size of kept table) reuse the graphs compiled for the first
    (the tables static inputs), each stopping where eager generate does; only longer patterns (a
    table of another size) compile the decode step and the round's call once more."""
    from gptfast_kernels.generation.stopping import token_bytes
    from python_tests.tiny_tokenizers import byte_level_tokenizer, stop_string_from

    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    tokenizer, P, new = byte_level_tokenizer(), ids.shape[1], 12
    free = generate(target, ids, mask, max_new_tokens=new, eos_token_id=[]).sequences
    patterns = [dict(stop_sequences=[free[1, P + 2:P + 4].tolist()], stop_strings=["q"]),
                dict(stop_sequences=[[3, 4, 5, 6, 7]],
                     stop_strings=[stop_string_from(token_bytes(tokenizer), free[0, P:].tolist()), "abcdefghijk"]),
                dict(stop_sequences=[[9], [10, 11]], stop_strings=["xy", "zw"]),
                dict(stop_sequences=[[9]], stop_strings=["a much longer stop string, of forty bytes"])]
    compiled = _graphs_after_each(compiled_graphs, target, draft, ids, mask,
                                  [dict(max_new_tokens=new, eos_token_id=[], tokenizer=tokenizer, **stops)
                                   for stops in patterns])
    assert compiled[1:] == [compiled[0], compiled[0], compiled[0] + 2]
    _assert_captured_whole(compiled_graphs)


def test_eos_ids_of_other_counts_reuse_the_compiled_calls(compiled_graphs):
    """One to four eos ids (padded to four by repeating the first) share generate's compiled step and
    the round's call, each row ending where eager generate ends it; five compile them once more."""
    from gptfast_kernels.generation.sampling import eos_id_tensor

    assert eos_id_tensor([4, 9, 11], torch.device("cpu")).tolist() == [4, 9, 11, 4]
    assert eos_id_tensor([], torch.device("cpu")) is None
    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    P, new = ids.shape[1], 12
    free = generate(target, ids, mask, max_new_tokens=new, eos_token_id=[]).sequences[:, P:]
    ends = [int(free[0, 3]), int(free[1, 5])]  # (each ends a row early)
    compiled = _graphs_after_each(compiled_graphs, target, draft, ids, mask,
                                  [dict(max_new_tokens=new, eos_token_id=eos)
                                   for eos in ([ends[0]], ends, ends + [1, 2], [1, 2, 3, 2, ends[1]])])
    assert compiled[1:] == [compiled[0], compiled[0], compiled[0] + 2]
    _assert_captured_whole(compiled_graphs)


def test_penalties_of_other_values_reuse_the_compiled_calls(compiled_graphs):
    """With penalties, generate's compiled step and the speculative round's two calls (its drafts,
    and the target's call after them) are one call each too (the record kept static on the model,
    the penalties as [B] values): other values, as numbers or per row, share them, each equal to
    eager generate; another penalty turned on makes each a graph of its own."""
    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    compiled = _graphs_after_each(compiled_graphs, target, draft, ids, mask,
                                  [dict(max_new_tokens=8, eos_token_id=[], **penalties) for penalties in (
                                      dict(repetition_penalty=1.2), dict(repetition_penalty=1.5),
                                      dict(repetition_penalty=[1.2, 0.8]),
                                      dict(repetition_penalty=1.2, frequency_penalty=0.5))])
    # (the graphs more: generate's step, the round's drafts and the target's call, each with the counts)
    assert compiled[1:] == [compiled[0], compiled[0], compiled[0] + 3]
    _assert_captured_whole(compiled_graphs)


def test_forget_kept_frees_what_compiled_calls_keep(compiled_graphs):
    """forget_kept drops the caches, states, penalty records and stop tables a model keeps for its
    compiled calls (as a target and as a draft), freed once nothing else holds them; the patch's own
    attributes stay, and the next compiled calls allocate anew and reuse the compiled graphs."""
    import gc
    import weakref

    from gptfast_kernels.generation import forget_kept

    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    options = dict(max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.2, stop_sequences=[[3, 4]])
    before = {model: set(vars(model)) for model in (target, draft)}
    with torch.no_grad():
        generate(target, ids, mask, compile=True, **options)
        speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, eos_token_id=[], stop_sequences=[[3, 4]],
                             compile=True)
    kept = {model: {name for name in set(vars(model)) - before[model] if not name.startswith("_gptfast_compiled")}
            for model in (target, draft)}
    assert {"_gptfast_cache", "_gptfast_decode_state", "_gptfast_round_state", "_gptfast_token_record",
            "_gptfast_stop_tables"} <= kept[target] and "_gptfast_cache_draft" in kept[draft]
    caches = [weakref.ref(target._gptfast_cache), weakref.ref(draft._gptfast_cache_draft)]
    compiled = len(compiled_graphs)
    for model in (target, draft):
        forget_kept(model)
        assert not kept[model] & set(vars(model)) and before[model] <= set(vars(model))
    gc.collect()
    assert [cache() for cache in caches] == [None, None]
    with torch.no_grad():
        want = generate(target, ids, mask, **options).sequences
        assert torch.equal(generate(target, ids, mask, compile=True, **options).sequences, want)
    assert len(compiled_graphs) == compiled


def test_the_check_sees_a_state_tensor_left_unmarked(compiled_graphs, monkeypatch):
    """The check can fail: with nothing marked static (the cache's tensors, the decode state's
    buffers), generate's compiled step writes inputs that are not static (on a GPU: a step without
    CUDA graphs)."""
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda tensor, guard=False: None)
    target, draft = _models("llama", 1)
    ids, mask = _prompts()
    with torch.no_grad():
        CALLS["generate"](target, draft, ids, mask)
    with pytest.raises(AssertionError, match="writes inputs that are not static"):
        _assert_captured_whole(compiled_graphs)
