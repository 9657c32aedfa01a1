"""Continuous batching: requests join a running batch as soon as a row frees up.

``generate`` decodes one batch until its last row ends; rows that end early idle. A
``ContinuousBatcher`` keeps ``batch_size`` rows of one StaticKVCache busy instead (the scheduling of
Orca and vLLM, on a static cache): each ``step`` samples one token for every running request,
retires the requests that ended (an eos id, or their own ``max_new_tokens``), puts waiting requests
into the freed rows (their cache rows emptied) and runs one forward: each going row's new token and
each new row's prompt, left-padded into one [B, W] input (idle rows are padding, which writes
nothing). With ``compile``, a step that starts with every running prompt in is one compiled call
(a CUDA graph; ``_decode_going``): the pick from the kept logits, the penalties' record, then the
decode step's forward, whose logits it keeps in place; the host then reads the tokens, and prompts
that come in go through a forward of their own, the going rows as padding.

Each request keeps its own options, as ``generate`` takes them for a call: sampling arguments
(per-row temperature / top-k / top-p / min-p), penalties (repetition / presence / frequency, each
row's record emptied when a request takes it), ``min_new_tokens``, ``max_new_tokens``, stop
sequences, stop strings and ``output_logprobs``. Greedy requests get the tokens ``generate`` gives
each prompt alone with the same options. Every step reads the sampled tokens on the host (to retire
requests and free rows), so the stops are matched there, per request, by generate's rule (a match
ends within the new token; the prompt is never part of one). With ``max_prefill_tokens`` a step's
forward takes at most that many prompt tokens (chunked prefill): a long prompt goes in over several
steps while the going rows decode beside it.

Hybrid models (linear-attention, Mamba or short-convolution layers beside attention, or alone) are
served too, but a step that takes new prompts runs two forwards: padding before a going row's token
would still advance its recurrent state (a decay applies to any input). The decode step comes first
(the new rows as padding); then the new rows are emptied (their recurrent states zeroed) and their
prompts run with the going rows as padding, whose states are put back as they were after it.

Speculative rounds in place of single tokens: ``SpeculativeBatcher`` (generation/continuous_speculative.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.forward import _forward, cache_for, compiled_function, step_function
from gptfast_kernels.generation.sampling import (TokenRecord, check_penalties, check_sampling_args, eos_columns,
                                                 penalty_rows, pick_at, pick_tokens, pick_uniforms, process_logits,
                                                 sampling_rows, token_logprobs)
from gptfast_kernels.generation.stopping import check_stop_sequences, check_stop_strings, token_bytes
from gptfast_kernels.modules.state_history import row_mask
from gptfast_kernels.ops._dispatch import check_int


BUFFERS_ATTRIBUTE = "_gptfast_batcher_buffers"  # where a compiled batcher's cache keeps its row buffers (a dict)
MASKS_KEPT = 64  # the most row masks a batcher keeps (_rows)


def _decode_going(logits: torch.Tensor, going: torch.Tensor, uniforms: torch.Tensor | None,
                  early: torch.Tensor | None, cache, record: TokenRecord, rule: tuple, model=None) -> tuple:
    """A ContinuousBatcher step whose running prompts are all in, as one call: each row's next token
    from ``logits`` [B, V] (the kept next-token logits: the penalties over ``record``, the eos held
    back where ``early`` [B], then the argmax, or with ``uniforms`` [B] float64 a sample at them),
    the ``going`` [B] rows' tokens into ``record``, then the decode forward over them (other rows:
    padding), whose logits go into ``logits``, in place. A going row whose cache is full is padding
    too: its new token is its request's last (max_length's), which ends it before anything reads
    its logits. ``rule``: (sampling filters as sampling_rows gives them, penalty_rows's penalties,
    the eos columns [V], whether to return log-probabilities). -> (tokens [B], their
    log-probabilities under the raw logits [B] or None)."""
    filters, penalties, is_eos, logprobs = rule
    tokens = pick_at(process_logits(logits, record, penalties[0], is_eos, early, *penalties[1:]), uniforms, *filters)
    record.add(torch.where(going, tokens, logits.shape[-1])[:, None])
    chosen = token_logprobs(logits, tokens) if logprobs else None
    fits = going & (cache.seq_lengths < cache.max_cache_len)
    new = _forward(torch.where(fits, tokens, 0)[:, None], fits[:, None], cache, model=model)[:, -1]
    logits.copy_(torch.where(fits[:, None], new.float(), logits))
    return tokens, chosen


@dataclass
class Request:
    """One submitted prompt: its id (submission order), tokens, limits and options."""
    id: int
    prompt: list[int]
    max_new_tokens: int
    min_new_tokens: int
    sampling: tuple  # (temperature, top_k, top_p, min_p), numbers / None
    penalties: tuple  # (repetition, presence, frequency), numbers (repetition None: off)
    stop_sequences: list[list[int]]
    stop_strings: list[bytes]  # (UTF-8)
    logprobs: list[float] | None  # with output_logprobs: each new token's, under the raw logits (else None)
    tokens: list[int] = field(default_factory=list)  # what it has generated so far
    filled: int = 0  # how many of its prompt's tokens its cache row holds
    text: bytes = b""  # their text, with stop strings

    def held(self) -> list[int]:
        """The tokens its cache row holds, from position 0: its prompt as far as it went in, then
        (once it is all in) what it generated but the last token (not yet written)."""
        return self.prompt[:self.filled] + (self.tokens[:-1] if self.filled == len(self.prompt) else [])

    def stops_at(self, token_text: bytes) -> bool:
        """Whether the token just appended (``token_text``: its bytes) completes a stop sequence or
        string (one ending within it), counted from new token number ``min_new_tokens`` on."""
        if len(self.tokens) <= self.min_new_tokens:
            return False
        before = len(self.text) - len(token_text)
        return (any(self.tokens[-len(seq):] == seq for seq in self.stop_sequences)
                or any(s in self.text[max(0, before - len(s) + 1):] for s in self.stop_strings))


class ContinuousBatcher:
    """``ContinuousBatcher(model, batch_size=8, max_length=None)``; ``submit(prompt_ids, ...)`` ->
    request id; ``step()`` -> the requests that ended in it, as {id: new token ids}; ``run()`` steps
    until every submitted request has ended and returns {id: new token ids} for all of them.

    ``max_length``: the most cache slots one request may take (its prompt + max_new_tokens - 1);
    None: 2048, or fewer where the model's position table holds fewer (GPT-2's learned positions).
    ``eos_token_id`` None: the model's generation_config's, as in ``generate``; a request's tokens
    end with the eos (or stop) that ended it. ``tokenizer``: the model's, for requests with stop
    strings. ``compile``: decode steps, each with its pick, through torch.compile (CUDA graphs).
    After each step, ``last_tokens`` holds {id: token} of every request that got one (for
    streaming), and
    ``last_logprobs`` {id: log-probability} of those submitted with ``output_logprobs``; when such a
    request ends, ``logprobs[id]`` holds its tokens' log-probabilities (as generate's ``logprobs``:
    under the model's raw distribution). ``cancel(id)`` ends a request before its time.

    ``max_prefill_tokens`` (chunked prefill, as vLLM's): the most prompt tokens one step's forward
    takes (None: every new prompt whole). A longer prompt goes into its row over several steps, in
    admission order, while the going rows go on decoding beside it: a long prompt no longer stalls
    every other request for its whole prefill. (Not for hybrid models: a recurrent state cannot be
    carried from one part of a prompt to the next here.)

    ``reuse_prefixes`` (prefix caching, as vLLM's): a new request whose prompt begins as the tokens
    some cache row holds (a running request's, or what an ended one left) takes their keys and values
    by a copy (or keeps them, in its own row) and runs only the rest of its prompt: a system prompt
    shared by many requests is computed once. ``reused_tokens`` counts the prompt tokens so skipped.
    Not for caches with ring-buffer layers or recurrent states, whose first positions do not stay."""

    extra_slots = 0  # cache slots per row past max_length (a speculative round's drafts)
    position_models = ()  # other models whose position tables bound the default max_length (a draft)

    def __init__(self, model, *, batch_size: int = 8, max_length: int | None = None,
                 eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
                 compile: bool = False, tokenizer=None, max_prefill_tokens: int | None = None,
                 reuse_prefixes: bool = False):
        op = type(self).__name__
        common.check_model(op, "model", model)
        self.batch_size = check_int(op, "batch_size", batch_size, 1)
        self.max_prefill_tokens = None if max_prefill_tokens is None else check_int(
            op, "max_prefill_tokens", max_prefill_tokens, 1)
        if max_length is None:
            max_length = common.default_max_length([model, *self.position_models], self.extra_slots)
        self.max_length = check_int(op, "max_length", max_length, 1)
        common.check_flag(op, "compile", compile)
        self.model, self.generator = model, generator
        self.device, dtype = common.model_device_dtype(model)
        common.check_generator(op, generator, self.device)
        self.eos, _ = common.resolve_special_tokens(op, model, eos_token_id)
        self.vocab_size = common.input_vocab_size(model)
        common.check_positions_fit(op, "model", model, max_length + self.extra_slots,
                                   "max_length + speculate_k" if self.extra_slots else "max_length")
        self.cache = cache_for(model, batch_size, max_length + self.extra_slots, self.device, dtype, reuse=compile,
                               step_tokens=self.extra_slots + 1, holder=self)
        if self.max_prefill_tokens is not None and self.cache.has_recurrent_layers:
            raise ValueError(f"{op}: max_prefill_tokens splits prompts across forwards, but {model.config.model_type} "
                             "is a hybrid model, whose recurrent states are not carried from one part of a prompt "
                             "to the next here; leave max_prefill_tokens None")
        common.check_flag(op, "reuse_prefixes", reuse_prefixes)
        if reuse_prefixes and (self.cache.has_ring_layers or self.cache.has_recurrent_layers):
            raise ValueError(f"{op}: reuse_prefixes copies a row's first positions, but this {model.config.model_type} "
                             "cache's ring-buffer layers or recurrent states do not keep them; leave reuse_prefixes "
                             "False")
        self.reuse_prefixes = reuse_prefixes
        self.residue: list[list[int]] = [[] for _ in range(batch_size)]  # what an idle row's cache still holds
        self.reused_tokens = 0
        self.compile = compile
        self.step_forward = step_function(model, compile)
        # compiled, a step whose running prompts are all in is one call (_decode_going; not a subclass's rounds)
        self.decode_going = (compiled_function(model, _decode_going, "decode_going")
                             if compile and type(self).step is ContinuousBatcher.step else None)
        self.masks: dict[tuple, torch.Tensor] = {}  # _rows's
        self.made_for_rows = (None, {})  # (the arguments, what was made with them: _for_rows)
        self.output_vocab = common.output_vocab_size(model)
        self.tokenizer = tokenizer
        self.token_text = None  # each token id's bytes (token_bytes), read when a stop string first comes
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * batch_size  # the request in each cache row
        self.logits = None  # [B, V]: each running row's next-token logits
        self.record = TokenRecord()  # what the penalties read, per row (each part made when first needed)
        self.is_eos = eos_columns(torch.tensor(self.eos, dtype=torch.int64, device=self.device), self.output_vocab)
        self.last_tokens: dict[int, int] = {}
        self.last_logprobs: dict[int, float] = {}
        self.logprobs: dict[int, list[float]] = {}  # of the ended requests that asked for them
        self.arguments = None  # (sampling, penalties) per row, as _sample reads them; None: to be built
        self.submitted = 0

    def submit(self, prompt_ids, *, max_new_tokens: int, min_new_tokens: int = 0, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, stop_sequences: list[list[int]] | None = None,
               stop_strings: str | list[str] | None = None, output_logprobs: bool = False) -> int:
        """Queues one prompt (a list of token ids or a 1-D tensor) -> its request id. The options
        are ``generate``'s, for this request alone (stop strings need the batcher's ``tokenizer``)."""
        op = f"{type(self).__name__}.submit"
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
                raise ValueError(f"{op}: prompt_ids as a tensor must be 1-D token ids, got {tuple(prompt_ids.shape)} "
                                 f"{prompt_ids.dtype}")
            prompt_ids = prompt_ids.tolist()
        if (not isinstance(prompt_ids, (list, tuple)) or not prompt_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                           for t in prompt_ids)):
            raise ValueError(f"{op}: prompt_ids must be a non-empty list of token ids in [0, {self.vocab_size})")
        max_new_tokens = check_int(op, "max_new_tokens", max_new_tokens, 1)
        if len(prompt_ids) + max_new_tokens - 1 > self.max_length:
            raise ValueError(f"{op}: the prompt ({len(prompt_ids)} tokens) and max_new_tokens ({max_new_tokens}) "
                             f"need {len(prompt_ids) + max_new_tokens - 1} cache slots, more than max_length "
                             f"({self.max_length})")
        min_new_tokens = check_int(op, "min_new_tokens", min_new_tokens, 0)
        sampling = check_sampling_args(op, temperature, top_k, top_p, min_p, 1, self.device)
        penalties = check_penalties(op, repetition_penalty, presence_penalty, frequency_penalty, 1, self.device)
        sequences = check_stop_sequences(op, stop_sequences, self.output_vocab)
        strings = check_stop_strings(op, stop_strings, self.tokenizer)
        common.check_flag(op, "output_logprobs", output_logprobs)
        if strings and self.token_text is None:
            self.token_text = token_bytes(self.tokenizer)
        request = Request(self.submitted, list(prompt_ids), max_new_tokens, min_new_tokens, sampling, penalties,
                          sequences, [s.encode("utf-8") for s in strings], [] if output_logprobs else None)
        self.submitted += 1
        self.waiting.append(request)
        return request.id

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """One token for every running request whose prompt is in; the requests that ended, new ones
        in their rows, and the next part of the prompts going in."""
        ended, self.last_tokens, self.last_logprobs = {}, {}, {}
        going = [b for b, r in enumerate(self.rows) if r is not None and r.filled == len(r.prompt)]
        decoded = bool(going) and self.decode_going is not None and len(going) == self.running
        if going:
            tokens, logprobs = self._decoded(going) if decoded else self._sample(going)
            for b in going:
                request = self.rows[b]
                self._take(b, [tokens[b]], None if logprobs is None else [logprobs[b]], ended)
                self.last_tokens[request.id] = tokens[b]
                if request.logprobs is not None:
                    self.last_logprobs[request.id] = logprobs[b]
            going = [b for b in going if self.rows[b] is not None]
        self._admit()
        spans = self._prompt_spans()
        if decoded:
            if spans:  # (the going rows are decoded)
                self._fill(spans, going)
        elif going or spans:
            self._forward(going, spans)
        return ended

    def _prompt_spans(self) -> dict[int, tuple[int, int]]:
        """Per row whose prompt is not all in its cache, the part this step's forward takes, (start,
        stop): the rest of it, within max_prefill_tokens for the step, in admission order."""
        spans, budget = {}, self.max_prefill_tokens
        for request in sorted((r for r in self.rows if r is not None and r.filled < len(r.prompt)),
                              key=lambda r: r.id):
            stop = len(request.prompt) if budget is None else min(len(request.prompt), request.filled + budget)
            if stop == request.filled:
                break
            spans[self.rows.index(request)] = (request.filled, stop)
            if budget is not None:
                budget -= stop - request.filled
        return spans

    def _take(self, b: int, tokens: list[int], logprobs: list[float] | None, ended: dict) -> int:
        """Row ``b``'s request gets ``tokens`` in turn (and their ``logprobs`` if it asked) until one
        ends it (an eos, a stop, or its own limit: the request goes to ``ended`` and the row is
        freed) -> how many it took."""
        request = self.rows[b]
        for i, token in enumerate(tokens):
            request.tokens.append(token)
            if request.logprobs is not None:
                request.logprobs.append(logprobs[i])
            text = b""
            if request.stop_strings:
                text = self.token_text[token] if token < len(self.token_text) else b""
                request.text += text
            if token in self.eos or len(request.tokens) >= request.max_new_tokens or request.stops_at(text):
                ended[request.id] = request.tokens
                if request.logprobs is not None:
                    self.logprobs[request.id] = request.logprobs
                self._leave(b)
                return i + 1
        return len(tokens)

    def cancel(self, request_id: int) -> list[int]:
        """Ends a request now, waiting or running (a client went away) -> the tokens it had; its row
        is free for the next step. KeyError for an id that is neither waiting nor running."""
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                return request.tokens
        for b, request in enumerate(self.rows):
            if request is not None and request.id == request_id:
                self._leave(b)
                return request.tokens
        raise KeyError(f"{type(self).__name__}.cancel: request_id {request_id!r} is neither waiting nor running")

    def run(self) -> dict[int, list[int]]:
        """Steps until every submitted request has ended -> {id: new token ids}, in submission order."""
        done = {}
        while self.waiting or self.running:
            done.update(self.step())
        return dict(sorted(done.items()))

    def _leave(self, b: int) -> None:
        """Row ``b``'s request goes; what its cache row holds stays for a later prompt to reuse."""
        self.residue[b] = self.rows[b].held()
        self.rows[b] = None
        self.arguments = None

    def _reuse_prefix(self, b: int, taken: list[int]) -> None:
        """Row ``b``'s new request takes the longest start of its prompt (all but its last token at
        most) that some cache row holds: copied from that row, or kept in its own. Rows that took
        requests in this step (``taken``) are no source: their old contents are about to go."""
        prompt = self.rows[b].prompt
        best, source = 0, None
        for c, request in enumerate(self.rows):
            if c in taken and c != b:
                continue
            held = self.residue[c] if request is None or c == b else request.held()
            n = 0
            for x, y in zip(held, prompt[:-1]):
                if x != y:
                    break
                n += 1
            if n > best:
                best, source = n, c
        if source is not None:
            best = self._take_prefix(source, b, best, [self.cache])
            self.rows[b].filled = best
            self.reused_tokens += best

    def _take_prefix(self, source: int, b: int, length: int, caches: list) -> int:
        """Row ``b`` of each of ``caches`` takes row ``source``'s first ``length`` positions (copied,
        or kept where ``source`` is ``b``) -> ``length``."""
        for cache in caches:
            if source == b:
                lengths = cache.seq_lengths.clone()
                lengths[b] = length
                cache.crop(lengths, check=False)
            else:
                cache.copy_prefix(source, b, length)
        return length

    def _admit(self) -> list[int]:
        """Waiting requests into free rows, those rows' caches emptied -> the rows taken."""
        free = [b for b, r in enumerate(self.rows) if r is None]
        taken = []
        while free and self.waiting:
            b = free.pop(0)
            self.rows[b] = self.waiting.popleft()
            taken.append(b)
        if taken:
            self._reset_records(taken)
            self.arguments = None
            if self.reuse_prefixes:
                for b in taken:
                    self._reuse_prefix(b, taken)
        return taken

    def _rows(self, rows: list[int]) -> torch.Tensor:
        """[B] bool on the device: True at ``rows``; read only (the masks are kept and handed out
        again: a step's going rows are mostly the last step's, and on a GPU each new mask is a copy
        from the host)."""
        key = tuple(rows)
        if key not in self.masks:
            if len(self.masks) >= MASKS_KEPT:
                self.masks.clear()
            mask = torch.zeros(self.batch_size, dtype=torch.bool)
            mask[list(rows)] = True
            self.masks[key] = mask.to(self.device)
        return self.masks[key]

    def _reset_records(self, rows: list[int]) -> None:
        """The penalties' record of new rows: their prompts seen, nothing generated (each part made,
        for every row, when the first request that reads it arrives)."""
        V = self.output_vocab
        if self.record.seen is None and any(self.rows[b].penalties[0] is not None for b in rows):
            self.record.seen = self._buffer("seen", (self.batch_size, V + 1), torch.bool)
        if self.record.counts is None and any(any(self.rows[b].penalties[1:]) for b in rows):
            self.record.counts = self._buffer("counts", (self.batch_size, V + 1), torch.int32)
        for b in rows:
            if self.record.seen is not None:
                prompt = torch.tensor(self.rows[b].prompt, device=self.device)
                self.record.seen[b] = False
                self.record.seen[b, prompt.clamp(max=V)] = True  # (ids past the output vocabulary: column V)
            if self.record.counts is not None:
                self.record.counts[b] = 0

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer of the batcher's rows that compiled calls write in place (the kept logits,
        the penalties' record). Compiled, it is kept beside the cache, marked static: the cache is
        the model's, held by one living batcher at a time (cache_for), so the next batcher on it
        finds the buffer where the last one left it (on a GPU: the CUDA graphs replayed, not
        recorded again)."""
        if not self.compile:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        kept = vars(self.cache).setdefault(BUFFERS_ATTRIBUTE, {})
        key = (name, tuple(shape), dtype)
        if key not in kept:
            kept[key] = torch.zeros(shape, dtype=dtype, device=self.device)
            torch._dynamo.mark_static_address(kept[key])
        return kept[key].zero_()

    def _forward(self, going: list[int], spans: dict[int, tuple[int, int]]) -> None:
        """The next-token logits of the going rows (after their last token) and of the rows whose
        prompts go in (after their ``spans``; a span from 0 in an emptied row): one forward, or for a
        hybrid model with both, the decode step and then the prompts, the going rows' recurrent
        states kept through the second."""
        if going and spans and self.cache.has_recurrent_layers:
            self._keep_logits(going, self._run(self.model, self.cache, self.step_forward, going, {}))
            self._fill(spans, going)
        else:
            self._keep_logits(going + list(spans), self._run(self.model, self.cache, self.step_forward, going, spans))

    def _fill(self, spans: dict[int, tuple[int, int]], going: list[int]) -> None:
        """The parts of prompts ``spans`` in a forward of their own, their rows' next-token logits
        kept; the ``going`` rows are padding, their recurrent states (a hybrid's) kept through it."""
        self._keep_logits(list(spans), self._run(self.model, self.cache, self.step_forward, [], spans, going))

    def _keep_logits(self, rows: list[int], logits: torch.Tensor) -> None:
        """``rows``' next-token logits (from ``logits`` [B, V]) for the next sampling."""
        if self.logits is None:  # (a decoded step writes it in place)
            self.logits = self._buffer("logits", tuple(logits.shape), torch.float32)
        self.logits.copy_(torch.where(self._rows(rows)[:, None], logits.float(), self.logits))

    def _run(self, model, cache, step, going: list[int], spans: dict[int, tuple[int, int]],
             kept: list[int] = ()) -> torch.Tensor:
        """One forward of ``model`` on ``cache``: each going row's last token and the parts of prompts
        ``spans`` ({row: (start, stop)}), left-padded so that every row ends in the last column
        (other rows are padding: nothing written) -> the last column's logits [B, V]. A part from a
        prompt's start goes into an emptied cache row. Without prompts, ``step`` (the decode step,
        compiled with ``compile``). ``kept``: rows whose recurrent states (a hybrid cache's) are put
        back as they were before the forward, whose padding would otherwise advance them."""
        last = torch.zeros(self.batch_size, 1, dtype=torch.int64)
        for b in going:
            last[b, 0] = self.rows[b].tokens[-1]
        ids, mask = self.with_prompts(spans, last.to(self.device), self._rows(going)[:, None])
        if not spans:
            return step(ids, mask, cache)[:, -1]
        self._empty_started([cache], spans)
        states = cache.recurrent_state_tensors() if kept and cache.has_recurrent_layers else []
        before, keep = [state.clone() for state in states], self._rows(list(kept))
        # (a ring-buffer cache takes at most max_step_tokens a forward: chunks, the going rows' in the last)
        prompt = common.Prompt(ids, mask, mask.sum(dim=1).tolist())
        for start, stop in common.prompt_chunks(prompt, cache):
            logits, _ = common._prefill_chunk(model, prompt, cache, start, stop, 1)
        for state, old in zip(states, before):
            state.copy_(torch.where(row_mask(keep, state), old, state))
        for b, (_, stop) in spans.items():
            self.rows[b].filled = stop
        return logits[:, -1]

    def _empty_started(self, caches, spans: dict[int, tuple[int, int]]) -> None:
        """Empties, in each of ``caches``, the rows whose prompt parts ``spans`` start at the prompt's
        start (a hybrid cache's recurrent states of those rows zeroed too)."""
        started = self._rows([b for b, (start, _) in spans.items() if start == 0])
        for cache in caches:
            cache.crop(torch.where(started, 0, cache.seq_lengths), check=False)

    def _for_rows(self, name: str, make):
        """``make()``, made once while the rows keep their requests (as the arguments): what every
        step reads of the requests' options (on a GPU, each [B] tensor is a launch or a copy)."""
        if self.made_for_rows[0] is not self._arguments():
            self.made_for_rows = (self.arguments, {})
        made = self.made_for_rows[1]
        if name not in made:
            made[name] = make()
        return made[name]

    def _arguments(self) -> tuple:
        """(sampling arguments, penalties) per row, as check_sampling_args and check_penalties give
        them, built when the rows change. Idle rows take the first running row's options, so a batch
        whose requests all sample alike samples as with numbers (all greedy: an argmax)."""
        if self.arguments is None:
            op, spare = type(self).__name__, next(r for r in self.rows if r is not None)
            rows = [r if r is not None else spare for r in self.rows]
            self.arguments = (
                check_sampling_args(op, *map(list, zip(*[r.sampling for r in rows])), self.batch_size, self.device),
                check_penalties(op, *map(list, zip(*[r.penalties for r in rows])), self.batch_size, self.device))
        return self.arguments

    def with_prompts(self, spans: dict[int, tuple[int, int]], tail: torch.Tensor, tail_mask: torch.Tensor):
        """[B, W] ids and mask: ``tail`` [B, T] (mask ``tail_mask``) in the last T columns, and in the
        rows of ``spans`` the parts (start, stop) of their requests' prompts instead, left-padded to
        end in the last column."""
        if not spans:
            return tail, tail_mask
        parts = {b: self.rows[b].prompt[start:stop] for b, (start, stop) in spans.items()}
        B, T = tail.shape
        width = max([T] + [len(part) for part in parts.values()])
        ids = torch.zeros(B, width, dtype=torch.int64)
        mask = torch.zeros(B, width, dtype=torch.bool)
        for b, part in parts.items():
            ids[b, width - len(part):] = torch.tensor(part)
            mask[b, width - len(part):] = True
        chosen = self._rows(list(parts))[:, None]
        ids, mask = ids.to(self.device), mask.to(self.device)
        ids[:, width - T:] = torch.where(chosen, ids[:, width - T:], tail)
        mask[:, width - T:] = torch.where(chosen, mask[:, width - T:], tail_mask)
        return ids, mask

    def _decoded(self, going: list[int]) -> tuple[list[int], list[float] | None]:
        """As ``_sample``, then the decode forward over the ``going`` rows' new tokens (every running
        row), in one compiled call (``_decode_going``); the tokens and log-probabilities read on the
        host before the next call."""
        sampling, penalties = self._arguments()
        uniforms = pick_uniforms(sampling[0], self.batch_size, self.device, self.generator)  # (as pick_tokens')
        asks = any(self.rows[b].logprobs is not None for b in going)
        filters, values = self._for_rows("decode", lambda: (sampling_rows(*sampling, self.batch_size, self.device),
                                                            penalty_rows(*penalties, self.batch_size, self.device)))
        rule = (() if uniforms is None else filters, values, self.is_eos, asks)
        tokens, chosen = self.decode_going(self.logits, self._rows(going), uniforms, self._early(), self.cache,
                                           self.record, rule)
        return tokens.tolist(), chosen.tolist() if asks else None

    def _early(self) -> torch.Tensor | None:
        """[B] bool: the rows whose eos ids are held back (short of their min_new_tokens; idle rows
        take the first running row's), None when none is."""
        spare = next(r for r in self.rows if r is not None)
        rows = [r if r is not None else spare for r in self.rows]
        if self.eos and any(len(r.tokens) < r.min_new_tokens for r in rows):
            return torch.tensor([len(r.tokens) < r.min_new_tokens for r in rows], device=self.device)
        return None

    def _sample(self, going: list[int]) -> tuple[list[int], list[float] | None]:
        """Each row's next token from ``self.logits`` (its request's penalties, min_new_tokens and
        sampling arguments) and, if a request of ``going`` asks, its log-probability under the raw
        logits, read on the host; the penalties' record takes the tokens of the ``going`` rows."""
        sampling, penalties = self._arguments()
        processed = process_logits(self.logits, self.record, penalties[0], self.is_eos, self._early(),
                                   *penalties[1:])
        tokens = pick_tokens(processed, *sampling, self.generator)
        if self.record.seen is not None or self.record.counts is not None:
            self.record.add(torch.where(self._rows(going), tokens, self.output_vocab)[:, None])
        if not any(self.rows[b].logprobs is not None for b in going):
            return tokens.tolist(), None
        return tokens.tolist(), token_logprobs(self.logits, tokens).tolist()
