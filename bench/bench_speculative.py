"""End-to-end speculative decoding.

Rows "speculative_e2e": the demo's trained byte-level target and draft (so acceptance is realistic;
trained and cached on first use, see gptfast_kernels/demo), greedy, at B = 1 and B = 8:
``speculative_generate`` and ``prompt_lookup_generate`` (no draft model) against the same patched
target decoding alone (``generate``), against transformers' plain greedy generate and, at B = 1,
transformers' assisted generation (batch 1 only).
Tokens/s count new tokens; acceptance is accepted / proposed drafts.

Rows "speculative_rounds" (GPU only): a random-weight target with Llama-3-8B shapes and a draft
with 1/8 of its layers (bf16 activations, int8 weights, compiled steps): rounds per second at
B = 1, 8, 32 and the fraction of a round spent outside the two models' forwards (target < 10%:
the run against its own forwards replayed back to back, and an upper bound from forwards timed
one by one; _timed_rounds; a compiled round's verification and bookkeeping run inside the
target's call, generation/verify_step.py, so they count as its forward's time); the same for
prompt_lookup_generate on that target (its rounds and overhead; random weights give its lookup
nothing to find).

Rows "hybrid_verify": what a speculative round's verification costs a hybrid model (Qwen3.5's
layout: three gated-delta-net layers to one attention layer; int8, random weights), where the
recurrent blocks leave their states after every token so that the round can roll them back (in one
pass, models/recurrent_columns.py, for these gated delta nets and Mamba-2 mixers): one forward of
k + 1 tokens under a checkpoint, plus the crop (``ours_verify_rollback``), against the same
forward without a checkpoint (``ours_verify_no_rollback``: transformers' multi-token path, which
cannot roll back), one decode step, and the k + 1 decode steps plain decoding spends on k + 1
tokens (the baseline). ``decode_steps_per_verify``: the verification's time in decode steps; a
round gains when its accepted tokens + 1 exceed that plus the draft's time. The same rows for an
attention-free model (case mamba2: Mamba-2 2.7B's shapes on a GPU, scaled down on the CPU), whose
every layer is recurrent, for LFM2 (case lfm2: LFM2-1.2B's shapes; short convolutions beside
attention) and for Mamba (case mamba: Mamba-2.8B's shapes; Mamba-1 mixers, attention-free).
Rows "assistant_rounds": drafting with a Gemma 4 assistant (generation/assistant.py) on random
weights: a Gemma 4 text target (transformers' default Gemma4TextConfig on a GPU, bf16, int8
weights, compiled steps; scaled down in float32 on the CPU) and a 4-layer assistant over its keys
and values, greedy, at B = 1 and 8: rounds per second, tokens/s and the fraction of a round outside
the two models' forwards, against the same target decoding alone and, at B = 1, transformers'
assisted generation with the same assistant (batch 1 only) and its plain generate. Random weights
accept few drafts: these rows time the rounds, not the speed-up a trained assistant gives.
Cases (``--cases``): demo, rounds, hybrid, mamba2, lfm2, mamba, assistant.
"""

from __future__ import annotations

import copy
import time

import torch
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_map
from transformers import (Lfm2Config, Lfm2ForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM,
                          MambaConfig, MambaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig)

import gptfast_kernels.generation.assistant as assistant_module
import gptfast_kernels.generation.speculative as speculative_module
from bench import cuda_graph_records
from bench.harness import best_seconds, default_dtype, synchronize
from gptfast_kernels import StaticKVCache, generate, patch_model, prompt_lookup_generate, speculative_generate
from gptfast_kernels.generation.forward import step_function
from gptfast_kernels.generation.verify_step import RoundState
from gptfast_kernels.models.patch import forward_with_cache

SPECULATE_K = 4
GPU_TARGET = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
DRAFT_LAYER_FRACTION = 8
# hybrid_verify: on a GPU transformers' default Qwen3.5 text config (4096 hidden, 32 layers, 3 gated
# delta nets : 1 attention); on the CPU the same layout scaled down
HYBRID_CPU = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=32000)
HYBRID_PROMPT = 128
# hybrid_verify for Mamba-2: 2.7B's shapes on a GPU (as bench_generate's mamba2 case), scaled down on the CPU
MAMBA2_GPU = dict(hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128, n_groups=1,
                  expand=2, vocab_size=50288)
MAMBA2_CPU = dict(hidden_size=1024, num_hidden_layers=8, num_heads=32, head_dim=64, state_size=64, n_groups=1,
                  expand=2, vocab_size=32000)
# hybrid_verify for LFM2 (short convolutions beside attention): LFM2-1.2B's shapes on a GPU, scaled down on the CPU
LFM2_GPU = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=65536, full_attn_idxs=[2, 5, 8, 10, 12, 14])
LFM2_CPU = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=4096, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000, full_attn_idxs=[2, 5])
# hybrid_verify for Mamba (attention-free, Mamba-1 mixers): Mamba-2.8B's shapes on a GPU, scaled down on the CPU
MAMBA_GPU = dict(hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2, vocab_size=50280)
MAMBA_CPU = dict(hidden_size=1024, num_hidden_layers=8, state_size=16, expand=2, vocab_size=32000)
# assistant_rounds on the CPU: a Gemma 4 text layout scaled down (5 sliding layers to 1 global, as
# transformers' default config), its 4-layer assistant at half the width
GEMMA4_CPU = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, global_head_dim=128, sliding_window=128, vocab_size=32000,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
ASSISTANT_LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


def demo_models(h):
    """(target, draft, corpus, code_prompts): the demo's default trained models on h.device (trained
    there and cached on first use, in the demo's cache), its corpus and its prompt maker."""
    from gptfast_kernels.demo.data import code_prompts, load_corpus
    from gptfast_kernels.demo.training import TrainSettings, default_cache_dir, load_or_train

    corpus = load_corpus()
    settings = TrainSettings(corpus=corpus.fingerprint)  # the demo's default models (shared cache)
    target, draft, _ = load_or_train(settings, corpus, default_cache_dir(), h.device, progress_bar=False)
    return target.eval(), draft.eval(), corpus, code_prompts


def _e2e_rows(h):
    target, draft, corpus, code_prompts = demo_models(h)
    on_gpu = h.device.type == "cuda"
    patched_target = patch_model(copy.deepcopy(target), int8=True)
    patched_draft = patch_model(copy.deepcopy(draft), int8=True)
    new_tokens = 48 if h.quick else 96
    from gptfast_kernels.demo.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    for rows in (1, 8):
        ids, mask = tokenizer.batch(code_prompts(corpus, rows), h.device)  # left-padded
        eos = []
        case = {"op": "speculative_e2e", "model": "demo byte-level (trained)", "batch": rows,
                "new_tokens": new_tokens, "speculate_k": SPECULATE_K, **h.meta}
        with torch.no_grad():
            candidates = {
                "hf_generate": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                       min_new_tokens=new_tokens, do_sample=False,
                                                       pad_token_id=tokenizer.PAD),
                "ours_target_alone": lambda: generate(patched_target, ids, mask, max_new_tokens=new_tokens,
                                                      eos_token_id=eos, compile=on_gpu).sequences,
                "ours_speculative": lambda: speculative_generate(patched_target, patched_draft, ids, mask,
                                                                 max_new_tokens=new_tokens, speculate_k=SPECULATE_K,
                                                                 eos_token_id=eos, compile=on_gpu),
                "ours_prompt_lookup": lambda: prompt_lookup_generate(patched_target, ids, mask,
                                                                     max_new_tokens=new_tokens,
                                                                     speculate_k=SPECULATE_K, eos_token_id=eos,
                                                                     compile=on_gpu),
            }
            if rows == 1:
                candidates["hf_assisted"] = lambda: target.generate(
                    ids, attention_mask=mask, assistant_model=draft, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.PAD)
            timings = {name: best_seconds(fn, h.device, repeats=2) for name, fn in candidates.items()}
        base = timings["ours_target_alone"][0]
        for name, (seconds, out) in timings.items():
            row = {**case, "impl": name, "tokens_per_s": rows * new_tokens / seconds,
                   "speedup_vs_target_alone": base / seconds}
            if name in ("ours_speculative", "ours_prompt_lookup"):
                row["acceptance_rate"] = out.acceptance_rate
                row["greedy_equals_target_alone"] = bool(torch.equal(out.sequences,
                                                                     timings["ours_target_alone"][1]))
            h.rows.append(row)


class _PatchedSteps:
    """Inside a with block, the generators' step functions are ``wrapped``'s: the target's and a
    draft model's steps (``speculative.step_function``), a draft's round of drafts in one
    call (``speculative.drafts_function``), the target's forward with the round's verification and
    bookkeeping in one call (``speculative.verify_function``; their time counts as the forward's)
    and a Gemma 4 assistant's steps (``assistant.assistant_step_function``)."""

    PATCHED = ((speculative_module, "step_function"), (speculative_module, "drafts_function"),
               (speculative_module, "verify_function"), (assistant_module, "assistant_step_function"))

    def __init__(self):
        self.originals = [getattr(module, name) for module, name in self.PATCHED]

    def wrapped(self) -> tuple:
        """-> the four functions to use, in PATCHED's order."""
        raise NotImplementedError

    def __enter__(self):
        for (module, name), function in zip(self.PATCHED, self.wrapped()):
            setattr(module, name, function)
        return self

    def __exit__(self, *exc):
        for (module, name), function in zip(self.PATCHED, self.originals):
            setattr(module, name, function)


class _ForwardClock(_PatchedSteps):
    """Wraps the per-round step functions and adds up the time spent inside them."""

    def __init__(self, device):
        super().__init__()
        self.device, self.seconds = device, 0.0

    def wrapped(self) -> tuple:
        def clocked(original):
            def timed(model, *options, **keywords):
                step = original(model, *options, **keywords)

                def run(*args):
                    synchronize(self.device)
                    start = time.perf_counter()
                    out = step(*args)
                    synchronize(self.device)
                    self.seconds += time.perf_counter() - start
                    return out
                return run
            return timed

        return tuple(clocked(original) for original in self.originals)


class _ForwardRecorder(_PatchedSteps):
    """Records every forward a generation makes through ``speculative.step_function`` (the target's
    and a draft model's), ``speculative.drafts_function`` (a round's drafts in one call) and
    ``speculative.verify_function`` (the target's forward and the rest of its round in one call):
    the function, copies of its tensor arguments, and the values before the call of what it updates
    in place (its cache's lengths, a round's state), so that ``replay`` can run the same calls
    again, back to back without the rounds' other work. ``replayable`` is False when the run also
    drafted through another step (a Gemma 4 assistant's, whose arguments include the previous
    step's outputs) or used a cache with recurrent layers (whose states a replay would not restore)."""

    def __init__(self):
        super().__init__()
        self.calls, self.replayable = [], True

    def wrapped(self) -> tuple:
        def recorded(original):
            def recording(model, *options, **keywords):
                step = original(model, *options, **keywords)

                def run(*args):
                    cache = next(arg for arg in args if isinstance(arg, StaticKVCache))
                    self.replayable &= not cache.has_recurrent_layers
                    restores = [(buffer, buffer.clone()) for buffer in _updated_in_place(args)]
                    copies = tree_map(lambda arg: arg.clone() if isinstance(arg, torch.Tensor) else arg, args)
                    self.calls.append((step, copies, restores))
                    return step(*args)
                return run
            return recording

        def unreplayable(assistant, compile):
            self.replayable = False
            return self.originals[3](assistant, compile)

        return recorded(self.originals[0]), recorded(self.originals[1]), recorded(self.originals[2]), unreplayable

    def replay(self) -> None:
        """The recorded calls in order, each on its cache and state with the values they had then."""
        for step, args, restores in self.calls:
            for buffer, value in restores:
                buffer.copy_(value)
            step(*args)


def _updated_in_place(args) -> list[torch.Tensor]:
    """The buffers a step call updates in place among its arguments: a cache's lengths (and a ring
    cache's written lengths), a round's state (verify_step.RoundState)."""
    buffers = []
    for arg in args:
        if isinstance(arg, StaticKVCache):
            buffers += [arg.seq_lengths, *([arg.written_lengths] if arg.has_ring_layers else [])]
        elif isinstance(arg, RoundState):
            buffers += arg.buffers()
    return buffers


@torch.no_grad()  # (the replay calls the compiled steps directly: with grad on they were compiled anew
# for it, and failed tracing kv_cache_attention's backward; eager, they ran slower than the run)
def _timed_rounds(h, generate_fn, rows: int, new_tokens: int, prefill_seconds: float) -> tuple[dict, object]:
    """Rounds/s and tokens/s of ``generate_fn`` (best of 2), and the share of a round outside the
    models' forwards -> (row fields, its output), measured two ways:

    * ``fraction_outside_forwards``: the run's forwards recorded and replayed back to back, as the
      run issues them but with none of the rounds' other work between them (drafts' sampling,
      verification, bookkeeping, the host's waits), against the run itself: 1 - (replay + the
      prefills) / run. Both unsynchronised, so host work that the GPU's queue hides costs nothing,
      as in the run. The replay's restores of the cache lengths (one small copy a forward) count as
      forward time, so the share is understated by about that. None where the run cannot be
      replayed (_ForwardRecorder).
    * ``fraction_outside_forwards_upper``: the forwards timed in a run of their own, synchronised
      around every step, against that run's own length: an upper bound, since every host
      operation between the forwards then waits for the GPU and counts in full.

    The eager prefills, outside the step functions, are timed apart (``prefill_seconds``)."""
    seconds, out = best_seconds(generate_fn, h.device, repeats=2)
    with _ForwardClock(h.device) as clock:
        synchronize(h.device)
        start = time.perf_counter()
        generate_fn()
        synchronize(h.device)
        clocked_seconds = time.perf_counter() - start
    with _ForwardRecorder() as recorder:
        generate_fn()
    outside = None
    if recorder.replayable:
        replay_seconds, _ = best_seconds(recorder.replay, h.device, repeats=2)
        outside = 1 - (replay_seconds + prefill_seconds) / seconds
    fields = {"batch": rows, "speculate_k": SPECULATE_K,
              "rounds_per_s": int(out.num_proposed.max()) // SPECULATE_K / seconds,
              "tokens_per_s": rows * new_tokens / seconds,
              "step_calls_per_run": len(recorder.calls),  # (a round of drafts in one call counts once)
              "fraction_outside_forwards": outside,
              "fraction_outside_forwards_upper": 1 - (clock.seconds + prefill_seconds) / clocked_seconds,
              "cudagraph_skips_so_far": counters["inductor"]["cudagraph_skips"],
              "cudagraph_recorded_again_so_far": cuda_graph_records.recorded_again()}
    return fields, out


def _rounds_rows(h):
    torch.manual_seed(0)
    draft_cfg = dict(GPU_TARGET, num_hidden_layers=GPU_TARGET["num_hidden_layers"] // DRAFT_LAYER_FRACTION)
    with torch.device(h.device), default_dtype(torch.bfloat16):
        target = patch_model(LlamaForCausalLM(LlamaConfig(**GPU_TARGET)).eval())
        draft = patch_model(LlamaForCausalLM(LlamaConfig(**draft_cfg)).eval())
    new_tokens = 64
    for rows in (1, 8, 32):
        ids = torch.randint(0, GPU_TARGET["vocab_size"], (rows, 16), device=h.device)

        def prefill(model):  # eager, outside the step functions: timed on its own
            with torch.no_grad():
                forward_with_cache(model, ids, StaticKVCache(model.config, rows, 32, device=h.device,
                                                             dtype=torch.bfloat16), logits_to_keep=1)

        target_prefill, _ = best_seconds(lambda: prefill(target), h.device, repeats=2)
        draft_prefill, _ = best_seconds(lambda: prefill(draft), h.device, repeats=2)
        fields, _ = _timed_rounds(
            h, lambda: speculative_generate(target, draft, ids, max_new_tokens=new_tokens, speculate_k=SPECULATE_K,
                                            eos_token_id=[], compile=True),
            rows, new_tokens, target_prefill + draft_prefill)
        h.rows.append({"op": "speculative_rounds", "model": "llama-8B-shape random + 4-layer draft",
                       "impl": "ours_speculative_compiled", **fields, **h.meta})
        # Prompt lookup on the same target: random weights leave nothing to find, so this times its
        # rounds (the target's k + 1-token forward plus the lookup), not its acceptance.
        fields, out = _timed_rounds(
            h, lambda: prompt_lookup_generate(target, ids, max_new_tokens=new_tokens, speculate_k=SPECULATE_K,
                                              eos_token_id=[], compile=True),
            rows, new_tokens, target_prefill)
        h.rows.append({"op": "speculative_rounds", "model": "llama-8B-shape random, prompt lookup",
                       "impl": "ours_prompt_lookup_compiled", **fields, "acceptance_rate": out.acceptance_rate,
                       **h.meta})


def _hybrid_rows(h, config, model_class, name: str):
    """hybrid_verify rows for a random-weight ``model_class(config)`` (int8, patched)."""
    on_gpu = h.device.type == "cuda"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.device(h.device), default_dtype(dtype):
        model = patch_model(model_class(config).eval())
    T = SPECULATE_K + 1
    for rows in ((1, 8) if not h.quick else (1,)):
        ids = torch.randint(0, config.vocab_size, (rows, HYBRID_PROMPT), device=h.device)
        cache = StaticKVCache(config, rows, HYBRID_PROMPT + 64, device=h.device, dtype=dtype, rollback_tokens=T)
        with torch.no_grad():
            forward_with_cache(model, ids, cache, logits_to_keep=1)
        start = cache.seq_lengths.clone()
        tokens = torch.randint(0, config.vocab_size, (rows, T), device=h.device)

        # Each call starts at the prompt's length again. The rollback candidate restores the states
        # too; the others reset the lengths only (the same work per call, on states that drift). On a
        # GPU the forwards are the compiled steps generation runs (CUDA graphs), on the CPU eager.
        step = step_function(model, compile=on_gpu)
        real = torch.ones_like(tokens, dtype=torch.bool)

        def forward(width):
            step(tokens[:, :width], real[:, :width], cache)
            cache.seq_lengths.copy_(start)

        def decode_steps():
            for t in range(T):
                step(tokens[:, t:t + 1], real[:, t:t + 1], cache)
            cache.seq_lengths.copy_(start)

        def verify_rollback():
            cache.checkpoint()
            step(tokens, real, cache)
            cache.crop(start + 2, check=False)  # (a round that kept 2 tokens)

        case = {"model": f"{name} random, hidden {config.hidden_size}, {config.num_hidden_layers} layers, int8",
                "batch": rows, "prompt": HYBRID_PROMPT, "speculate_k": SPECULATE_K, "compiled": on_gpu}
        with torch.no_grad():
            timed = {row["impl"]: row for row in h.compare(
                "hybrid_verify", case, {"ours_decode_steps_k+1": decode_steps, "ours_decode_step": lambda: forward(1),
                                        "ours_verify_no_rollback": lambda: forward(T),
                                        "ours_verify_rollback": verify_rollback},
                baseline="ours_decode_steps_k+1")}
        step_ms = timed["ours_decode_step"]["ms_median"]
        for row in timed.values():
            row["decode_steps_per_verify"] = row["ms_median"] / step_ms


def _gemma4_pair(h):
    """(a Gemma 4 text target, patched, int8 on a GPU; the same unpatched; a 4-layer assistant for it)."""
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                              Gemma4TextConfig)

    on_gpu = h.device.type == "cuda"
    config = Gemma4TextConfig(**({} if on_gpu else GEMMA4_CPU))
    (sliding_heads, sliding_dim), (full_heads, full_dim) = (
        assistant_module.kv_geometry(config, config.layer_types.index(kind))
        for kind in ("sliding_attention", "full_attention"))
    width = 1024 if on_gpu else GEMMA4_CPU["hidden_size"] // 2
    text = Gemma4TextConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=len(ASSISTANT_LAYERS),
        num_attention_heads=config.num_attention_heads, num_key_value_heads=sliding_heads, head_dim=sliding_dim,
        num_global_key_value_heads=full_heads, global_head_dim=full_dim, sliding_window=config.sliding_window,
        layer_types=ASSISTANT_LAYERS,
        vocab_size=config.vocab_size, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=len(ASSISTANT_LAYERS))
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)
    with torch.device(h.device), default_dtype(dtype):
        target = Gemma4ForCausalLM(config).eval()
        assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
            text_config=text, backbone_hidden_size=config.hidden_size)).eval()
    assistant.generation_config.num_assistant_tokens = SPECULATE_K
    return patch_model(copy.deepcopy(target), int8=on_gpu), target, assistant


def _assistant_rows(h):
    on_gpu = h.device.type == "cuda"
    patched, target, assistant = _gemma4_pair(h)
    new_tokens = 32 if h.quick or not on_gpu else 64
    vocab = target.config.vocab_size
    for rows in ((1,) if h.quick else (1, 8)):
        ids = torch.randint(2, vocab, (rows, 16), device=h.device)
        case = {"op": "assistant_rounds", "model": "gemma4 random + 4-layer assistant", "batch": rows,
                "new_tokens": new_tokens, **h.meta}
        with torch.no_grad():
            fields, out = _timed_rounds(
                h, lambda: speculative_generate(patched, assistant, ids, max_new_tokens=new_tokens,
                                                speculate_k=SPECULATE_K, eos_token_id=[], compile=on_gpu),
                rows, new_tokens, 0.0)
            h.rows.append({**case, "impl": "ours_assistant", **fields, "acceptance_rate": out.acceptance_rate,
                           "greedy_equals_target_alone": bool(torch.equal(out.sequences, generate(
                               patched, ids, max_new_tokens=new_tokens, eos_token_id=[]).sequences))})
            others = {"ours_target_alone": lambda: generate(patched, ids, max_new_tokens=new_tokens, eos_token_id=[],
                                                            compile=on_gpu)}
            if rows == 1:
                hf = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                others["hf_assisted"] = lambda: target.generate(ids, assistant_model=assistant, **hf)
                others["hf_generate"] = lambda: target.generate(ids, **hf)
            for name, fn in others.items():
                seconds, _ = best_seconds(fn, h.device, repeats=2)
                h.rows.append({**case, "impl": name, "tokens_per_s": rows * new_tokens / seconds})
        base = next(row["tokens_per_s"] for row in h.rows[::-1] if row.get("impl") == "ours_target_alone")
        for row in h.rows:
            if row.get("op") == "assistant_rounds" and row["batch"] == rows:
                row["speedup_vs_target_alone"] = row["tokens_per_s"] / base


def run(h) -> None:
    if h.wants("demo"):
        _e2e_rows(h)
    if h.device.type == "cuda" and h.wants("rounds"):
        _rounds_rows(h)
    on_gpu = h.device.type == "cuda"
    if h.wants("hybrid"):
        _hybrid_rows(h, Qwen3_5TextConfig(**({} if on_gpu else HYBRID_CPU)), Qwen3_5ForCausalLM, "qwen3.5 layout")
    if h.wants("mamba2"):
        _hybrid_rows(h, Mamba2Config(**(MAMBA2_GPU if on_gpu else MAMBA2_CPU)), Mamba2ForCausalLM, "mamba2")
    if h.wants("lfm2"):
        _hybrid_rows(h, Lfm2Config(**(LFM2_GPU if on_gpu else LFM2_CPU)), Lfm2ForCausalLM, "lfm2")
    if h.wants("mamba"):
        _hybrid_rows(h, MambaConfig(**(MAMBA_GPU if on_gpu else MAMBA_CPU)), MambaForCausalLM, "mamba")
    if h.wants("assistant"):
        _assistant_rows(h)
