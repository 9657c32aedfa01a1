"""One model forward on a StaticKVCache, eager or compiled.

Compiled (``compile=True``): one ``torch.compile(fullgraph=True)`` function per model, kept on the
model so later calls reuse it; on CUDA with inductor's CUDA graphs ("reduce-overhead"), i.e. replayed as a CUDA graph
(the cache buffers and lengths have static addresses, and no step synchronises with the host).
Each distinct token count T (1 for decode, 2 and k + 1 for speculation) is its own graph; a draft
model's round of drafts (its k forwards and the picks between them) is one more (drafts_function).
Prefill, whose length changes from call to call, runs eagerly. The step is compiled without dynamo's guards
on the model's modules, which cost more per call than a small model's step takes to run on a CPU
(CompiledStep says what is checked instead, and when ``forget_compiled`` is needed).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import types
import warnings
import weakref

import torch

from gptfast_kernels.generation.sampling import (KEPT_NAMES, DraftProcessing, keep_on, logits_to_probs,
                                                 sample_by_uniform)
from gptfast_kernels.models.families import family_of
from gptfast_kernels.models.patch import forward_with_cache
from gptfast_kernels.modules.static_kv_cache import StaticKVCache

# Cache lengths are rounded up to a multiple of this when a compiled model allocates its cache, so
# later calls with somewhat longer prompts reuse the same cache (and the same compiled graphs).
CACHE_LEN_QUANTUM = 256
# Every (batch size, token count, cache) of a model is a graph of its own, all compiled from that
# model's code object (see _own_forward), whose default recompile limit (8) one model at three batch
# sizes and three token counts already exceeds; under fullgraph=True that is a hard error.
# step_function raises the limit to at least this; a call past it starts the step afresh (CompiledStep).
RECOMPILE_LIMIT = 64
# Prompt tokens per prefill forward when the model has sliding-window layers: the caches generation
# allocates keep those layers as ring buffers of window + PREFILL_CHUNK - 1 slots (StaticKVCache's
# max_step_tokens), so longer prompts go through in chunks of this many tokens.
PREFILL_CHUNK = 2048


# Torch 2.11's C++ code generator (CPU) vectorises a hybrid model's speculative steps (their copies
# of recurrent states into the state history) into code that does not compile ("'tmp12' was not
# declared") or that corrupts the heap (the continuous batcher's steps of a Qwen3.5); 2.14.1's does
# neither. Before this release such models' steps compile unvectorised (releases between not tried).
CPU_VECTORISES_RECURRENT_STATES = "2.14"

# Ops that synchronise with the host and so cannot be captured in a CUDA graph, which inductor runs
# outside the graphs (its graph partitions) instead: transformers' grouped matmul for mixture-of-experts
# weights in any dtype but bfloat16 under torch.compile loops over a host copy of its offsets.
HOST_SYNCING_OPS = ("transformers::grouped_mm_fallback",)


def _partition_host_syncing_ops() -> None:
    import torch._inductor.config as inductor_config
    if hasattr(inductor_config, "custom_should_partition_ops"):
        missing = [op for op in HOST_SYNCING_OPS if op not in inductor_config.custom_should_partition_ops]
        inductor_config.custom_should_partition_ops = [*inductor_config.custom_should_partition_ops, *missing]


def _forward(tokens: torch.Tensor, attention_mask: torch.Tensor, cache: StaticKVCache, model=None) -> torch.Tensor:
    return forward_with_cache(model, tokens, cache, attention_mask=attention_mask).logits


def _forward_with_hidden(tokens: torch.Tensor, attention_mask: torch.Tensor, cache: StaticKVCache,
                         model=None) -> tuple[torch.Tensor, torch.Tensor]:
    out = forward_with_cache(model, tokens, cache, attention_mask=attention_mask, output_hidden_states=True)
    return out.logits, out.hidden_states[-1]


def _drafts(first_input: torch.Tensor, first_mask: torch.Tensor, active: torch.Tensor, cache: StaticKVCache,
            k: int, sampling: tuple | None, processing: DraftProcessing | None = None,
            model=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A speculative round's k drafts per row in one call (one compiled graph instead of k steps,
    each with its host work between them): the round's first draft forward over ``first_input``
    [B, 2] under ``first_mask`` [B, 2], then k - 1 one-token forwards over each draft under
    ``active`` [B]; each draft picked as ``picked_drafts`` picks (``sampling``, ``processing``) ->
    (drafts [B, k], their distributions [B, k, V] float32, or None when greedy)."""
    logits = _forward(first_input, first_mask, cache, model=model)[:, -1]
    return _drafts_after(logits, active, cache, k, sampling, processing, model=model)


def _drafts_after(logits: torch.Tensor, active: torch.Tensor, cache: StaticKVCache, k: int, sampling: tuple | None,
                  processing: DraftProcessing | None = None, model=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As ``_drafts`` after the round's first draft forward, run outside the call (a batcher's, as
    wide as the new prompts in it): from its last column's ``logits`` [B, V], the k drafts and the
    k - 1 one-token forwards between them -> (drafts [B, k], distributions [B, k, V] or None)."""
    return picked_drafts(logits, lambda token: _forward(token[:, None], active[:, None], cache, model=model)[:, -1],
                         k, sampling, processing)


def picked_drafts(logits: torch.Tensor, advance, k: int, sampling: tuple | None,
                  processing: DraftProcessing | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k drafts per row inside one compiled call of a drafter: the first picked from ``logits``
    [B, V], each next one from ``advance(draft [B])`` -> logits [B, V]. Each is the argmax
    (``sampling`` None), or sampled from its distribution: ``sampling`` = (uniforms [B, k] float64,
    draft i of a row taking column i; temperature, top_k, top_p, min_p as [B] tensors, a filter that
    is off None; see SpeculativeRounds.draft_sampling); with ``processing``, from the logits after
    the penalties over the row's text and the drafts before, and with its eos held back (None: the
    logits as they are) -> (drafts [B, k], their distributions [B, k, V] float32, or None when
    greedy)."""
    uniforms, *filters = (None,) if sampling is None else sampling
    record = None if processing is None else processing.record.map(torch.clone)
    drafts, distributions = [], []
    for i in range(k):
        if i:
            logits = advance(drafts[-1])
        if processing is not None:
            logits = processing.process(logits, record, i)
        if uniforms is None:
            drafts.append(logits.argmax(dim=-1))
        else:
            distributions.append(logits_to_probs(logits, *filters))
            drafts.append(sample_by_uniform(distributions[-1], uniforms[:, i]))
        if processing is not None and i < k - 1:
            record.add(drafts[-1][:, None])
    return torch.stack(drafts, dim=1), torch.stack(distributions, dim=1) if distributions else None


def drafts_function(model, *, module_guards: bool = False):
    """``model``'s compiled ``(first_input, first_mask, active, cache, k, sampling, processing) ->
    (drafts [B, k], distributions or None)`` (see _drafts), kept on the model like its steps
    (``module_guards``: as step_function's)."""
    return compiled_function(model, _drafts, "drafts", module_guards=module_guards)


def _bound(function, model):
    """``function`` with ``model`` bound, on a code object of its own: dynamo counts graphs against
    the recompile limit per code object, so a process that compiles many models (an evaluation
    sweep, a test suite) never adds one model's graphs to another's (a functools.partial would:
    dynamo compiles every partial through one shared wrapper)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__, (model,))


COMPILED_PREFIX = "_gptfast_compiled_"  # the attributes a model keeps its compiled steps in


class CompiledStep:
    """``function(..., model=model)`` through torch.compile(fullgraph=True), CUDA graphs on CUDA.

    Dynamo guards every attribute of every module a traced forward reads (thousands of guards: a
    4-layer Llama has about 3,000) and evaluates them on every call: on a slow CPU core 0.2 ms a
    call for 4 layers, 0.5 ms for 32, a fifth of the demo's compiled decode step. The model's
    modules do not change between the steps of a generation, so the step is compiled without the
    guards on them (torch.compiler.skip_guard_on_all_nn_modules_unsafe: the guards on the inputs,
    the cache and the global state stay; parameters are still read at every call, so weights
    loaded in place are seen). What can change in normal use is checked here instead, and the step
    compiled anew when it has: train / eval mode, the parameters' dtype and device (``model.to``),
    and which modules are passed as arguments (a Gemma 4 assistant's target embedding).
    patch_model drops a model's compiled steps (``forget_compiled``); other changes to its modules
    after a compiled call (replacing one, adding a hook, editing the config) need
    ``forget_compiled(model)``."""

    def __init__(self, model, function, *, module_guards: bool = False, recurrent: bool = False):
        self.model, self.function, self.module_guards = model, function, module_guards  # (True: every guard)
        self.recurrent = recurrent  # whether the model has recurrent layers (compile_options)
        self.first_parameter = next(model.parameters())
        self.compiled, self.signature = None, None

    def compile_options(self, on_cuda: bool) -> dict:
        """torch.compile's options: CUDA graphs on CUDA (all that mode="reduce-overhead" sets; a
        mode beside any options is refused), dynamo's guards on the modules skipped unless
        ``module_guards``; on a CPU under torch before CPU_VECTORISES_RECURRENT_STATES, a model with
        recurrent layers compiled without vectorisation (see there)."""
        options = {"triton.cudagraphs": True} if on_cuda else {}
        if not self.module_guards and _MODULE_GUARDS_SKIPPED is not None:
            options["guard_filter_fn"] = _MODULE_GUARDS_SKIPPED
        if not on_cuda and self.recurrent and torch.__version__ < CPU_VECTORISES_RECURRENT_STATES:
            options["cpp.simdlen"] = 1
        return options

    def _signature(self, args) -> tuple:
        first = self.first_parameter
        return (self.model.training, first.dtype, first.device,
                tuple(id(a) for a in args if isinstance(a, torch.nn.Module)))

    def __call__(self, *args):
        signature = self._signature(args)
        if signature != self.signature:
            self._compile()
            self.signature = signature
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # (raised before the call runs anything)
            # A call unlike the last RECOMPILE_LIMIT kinds compiled (batch sizes, token counts,
            # options: each a graph of its own): the step starts afresh, on a code object of its
            # own, where under fullgraph dynamo would fail every such call from now on.
            warnings.warn(f"gptfast_kernels: {self.function.__name__} of this {type(self.model).__name__} was "
                          f"compiled for {torch._dynamo.config.recompile_limit} kinds of call (batch sizes, token "
                          "counts, options); those are dropped and each compiled again when next called",
                          stacklevel=2)
            self._compile()
            return self.compiled(*args)

    def _compile(self) -> None:
        on_cuda = self.first_parameter.device.type == "cuda"
        if on_cuda:
            _partition_host_syncing_ops()
        # (_bound: a code object of its own, whose recompiles count against no other step's limit)
        self.compiled = torch.compile(_bound(self.function, self.model), fullgraph=True, dynamic=False,
                                      options=self.compile_options(on_cuda))


# (torch >= 2.8; before it the steps keep every guard)
_MODULE_GUARDS_SKIPPED = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)


def forget_compiled(model) -> None:
    """Drops ``model``'s compiled steps, so the next compiled call traces the model as it is then."""
    for name in [name for name in vars(model) if name.startswith(COMPILED_PREFIX)]:
        delattr(model, name)


def forget_kept(model) -> None:
    """Drops what ``model`` keeps for compiled calls: its caches (as a target and as a draft), its
    decode and round states, penalty records and stop tables. Their memory is freed once nothing
    else refers to them (a living batcher keeps its caches); the next compiled call allocates them
    anew (on a GPU its CUDA graphs are then recorded again; nothing is compiled again)."""
    for name in vars(model).pop(KEPT_NAMES, ()):
        vars(model).pop(name, None)


def compiled_function(model, function, name: str, *, family_model=None,
                      module_guards: bool = False) -> CompiledStep:
    """``function(..., model=model)`` compiled (CompiledStep; ``module_guards``: keeping every guard),
    once, and kept on ``model`` as COMPILED_PREFIX + ``name``. Its family's compile check runs on
    ``family_model`` (default ``model``: a Gemma 4 assistant passes its text model)."""
    attribute = COMPILED_PREFIX + name
    compiled = getattr(model, attribute, None)
    if compiled is None:
        family_model = model if family_model is None else family_model
        family = family_of(family_model.config)
        family.check_compile(family_model)
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        compiled = CompiledStep(model, function, module_guards=module_guards,
                                recurrent=bool(family.recurrent_layer_types))
        setattr(model, attribute, compiled)
    return compiled


def step_function(model, compile: bool, *, hidden: bool = False, module_guards: bool = False):
    """(tokens [B, T], attention_mask [B, T], cache) -> logits [B, T, V]; with ``hidden``, (logits,
    the last hidden states [B, T, H]: the final norm's output, which the output head takes).
    ``module_guards``: a step compiled by this call keeps dynamo's guards on the model's modules
    (bench_compiled_step's baseline; an already compiled step is returned as it is)."""
    function = _forward_with_hidden if hidden else _forward
    if not compile:
        return functools.partial(function, model=model)
    name = "forward" + ("_hidden" if hidden else "")
    return compiled_function(model, function, name, module_guards=module_guards)


# cache_for keeps this many caches per model and role, most recently used first: calls whose shapes
# take turns (a batch of short prompts, then one long prompt, and again) each find theirs kept, so a
# GPU replays each one's CUDA graphs instead of recording them again at every call (torch 2.11 counts
# such recordings and, past its limit of 128, runs the step without CUDA graphs from then on).
KEPT_CACHES = 2
KEPT_SUFFIX = "_kept"  # cache_for: the list of _KeptCache under the role's attribute + this


@dataclasses.dataclass
class _KeptCache:
    cache: StaticKVCache
    holder: object  # a weak reference to what holds the cache (a batcher), or _nobody

    def held(self, by) -> bool:
        """Whether something other than ``by`` holds the cache."""
        return self.holder() not in (None, by)


def _nobody() -> None:
    return None


def _serves(cache: StaticKVCache, batch_size: int, needed: int, dtype, chunk: int, rollback: int) -> bool:
    """Whether ``cache`` (its first rows) can take a call of ``batch_size`` rows needing ``needed`` slots."""
    if cache.has_recurrent_layers and (cache.batch_size != batch_size or cache.rollback_tokens < rollback):
        return False  # (recurrent states are made per cache, for its batch size)
    return (cache.batch_size >= batch_size and cache.max_cache_len >= needed and cache.dtype == dtype
            and cache.max_step_tokens == chunk)


def cache_for(model, batch_size: int, needed: int, device, dtype, *, reuse: bool,
              step_tokens: int = 1, role: str = "", holder=None) -> StaticKVCache:
    """A StaticKVCache with room for ``needed`` tokens per row, its rows emptied, whose sliding-window
    layers are ring buffers taking up to max(PREFILL_CHUNK, ``step_tokens``) tokens a forward
    (``step_tokens``: the most a decoding round writes and rolls back; above 1, a hybrid model's
    cache keeps its recurrent states for as many tokens: ``rollback_tokens``). With ``reuse`` the
    model keeps up to KEPT_CACHES caches (rounded-up lengths) and hands one out again while it fits,
    so compiled graphs, which are specialised on the cache's buffers, are not rebuilt on every call;
    one set per ``role`` ("draft": a model drafting for itself must not share its cache as the
    target). A smaller batch takes a kept cache's first rows (StaticKVCache.first_rows), so batch
    sizes in turn neither allocate nor move a graph's buffers (on a GPU: no CUDA graph recorded
    again); a larger one, a longer call, or a hybrid model's batch of another size (recurrent states
    are per cache) allocates a cache anew, which is kept first: those it makes useless (no larger in
    batch or length) are dropped, and the least recently used beyond KEPT_CACHES (all that no holder
    needs, when the device is out of memory for the new one). A ``holder`` (a batcher, whose rows
    live between its steps) keeps its cache for itself while it lives: another call meanwhile takes
    another kept cache or a new one (a generate call between the batcher's steps would otherwise
    empty its rows). Its per-forward position check is off: the caller writes at most ``needed``
    tokens per row, and the check would make every eager decode step wait for the GPU."""
    chunk = max(PREFILL_CHUNK, step_tokens)
    rollback = step_tokens if step_tokens > 1 else 0

    def new_cache(length: int) -> StaticKVCache:
        return StaticKVCache(model.config, batch_size, length, device=device, dtype=dtype, max_step_tokens=chunk,
                             rollback_tokens=rollback)

    if not reuse:
        cache = new_cache(needed)
    else:
        attribute = "_gptfast_cache" + (f"_{role}" if role else "")
        kept = list(getattr(model, attribute + KEPT_SUFFIX, ()))
        serving = [entry for entry in kept if _serves(entry.cache, batch_size, needed, dtype, chunk, rollback)]
        if serving and all(entry.held(holder) for entry in serving):
            gc.collect()  # (a holder that is garbage in a reference cycle waits for the collector)
        chosen = next((entry for entry in serving if not entry.held(holder)), None)
        if chosen is None:
            length = -(-needed // CACHE_LEN_QUANTUM) * CACHE_LEN_QUANTUM
            try:
                cache = new_cache(length)
            except torch.OutOfMemoryError:  # the kept ones that no holder needs give their memory first
                kept = [entry for entry in kept if entry.held(holder)]
                keep_on(model, attribute + KEPT_SUFFIX, kept)
                vars(model).pop(attribute, None)
                gc.collect()
                torch.cuda.empty_cache()
                cache = new_cache(length)
            chosen = _KeptCache(cache, _nobody)
            kept = [entry for entry in kept
                    if not _serves(cache, entry.cache.batch_size, entry.cache.max_cache_len, entry.cache.dtype,
                                   entry.cache.max_step_tokens, entry.cache.rollback_tokens)]
        chosen.holder = _nobody if holder is None else weakref.ref(holder)
        kept = [chosen] + [entry for entry in kept if entry is not chosen][:KEPT_CACHES - 1]
        keep_on(model, attribute + KEPT_SUFFIX, kept)
        keep_on(model, attribute, chosen.cache)  # (the one handed out last)
        cache = chosen.cache.first_rows(batch_size)
        if cache.state_history is not None:  # (a call that stopped mid-round left it open)
            cache.state_history.close()
        cache.crop(torch.zeros_like(cache.seq_lengths), check=False)
    cache.check_positions = False
    return cache
