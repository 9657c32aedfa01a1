"""Continuous batching with speculative decoding: ``SpeculativeBatcher``.

A ``ContinuousBatcher`` whose running requests advance by speculative rounds instead of one token a
step: each step, every running row gets k proposals (from a draft model, or looked up in the row's
own text, as ``prompt_lookup_generate``), the target scores them in one forward of k + 1 tokens and
``verify_draft`` keeps a prefix per row (SpeculativeRounds.verify_round, the round of
``speculative_generate``). Requests that ended (an eos, a stop, their own limit) free their rows;
waiting requests take them at the next step: their prompts run through the target (and the draft)
in the same forwards as the round, each row's cache emptied first and its prompt left-padded to end
in the last column beside the going rows' tokens, and their first token is sampled from the
target's logits there. (A hybrid model's recurrent states would be advanced by padding: its new
prompts run in a forward of their own after the round, the going rows' states kept, as
ContinuousBatcher does; so do prompts longer than a ring-buffer cache takes in one forward.) With
``max_prefill_tokens`` a prompt goes in over several steps, a part in each round's forwards. Greedy
requests get exactly the tokens ``generate`` gives their prompts alone; sampled ones follow the
target's distribution with their own arguments.

A round's tokens are read on the host, as ContinuousBatcher's steps read theirs: the eos, stops and
limits of each request are applied there, and a request keeps its tokens up to the one that ended
it. Compiled, a round is two calls (CUDA graphs): the draft model's k drafts, then the target's
forward with everything up to those tokens (the penalties, the eos held back, verification, the
crop, a hybrid's recurrent states rolled back, the penalties' record; ``_verify_going``). A round
that takes new prompts in has first forwards as wide as the prompts, run on their own: the draft's,
then its drafts in one call (``forward._drafts_after``); the target's, then the rest of the round
in one call (``_verified_going``).
Not served: MTP heads and Gemma 4 assistants as drafts (speculative_generate takes them).
"""

from __future__ import annotations

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.assistant import is_gemma4_assistant
from gptfast_kernels.generation.continuous import ContinuousBatcher
from gptfast_kernels.generation.forward import _drafts_after, _forward, compiled_function
from gptfast_kernels.generation.mtp import is_mtp_model
from gptfast_kernels.generation.prompt_lookup import emittable, lookup_continuations
from gptfast_kernels.generation.sampling import TokenRecord, token_logprobs
from gptfast_kernels.generation.speculative import (DraftModelProposer, History, SpeculativeRounds,
                                                    _check_draft_model)
from gptfast_kernels.generation.verify_step import processed_and_verified, target_input
from gptfast_kernels.models.patch import forward_with_cache
from gptfast_kernels.ops._dispatch import check_int


def _verify_going(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None,
                  active: torch.Tensor, last: torch.Tensor, made: torch.Tensor, cache, record: TokenRecord,
                  rule: tuple, model=None) -> tuple:
    """A SpeculativeBatcher round after its drafts [B, k], for the ``active`` rows: the target's
    forward over each row's ``last`` token and its drafts, then ``_verified_going`` on its logits.
    -> _verified_going's."""
    logits = _forward(*target_input(last, draft_tokens, active), cache, model=model)
    return _verified_going(logits, draft_tokens, draft_probs, uniforms, active, made, cache, record, rule)


def _verified_going(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    uniforms: torch.Tensor | None, active: torch.Tensor, made: torch.Tensor, cache,
                    record: TokenRecord, rule: tuple, model=None) -> tuple:
    """A SpeculativeBatcher round after the target's forward (its logits [B, k + 1, V] at each
    ``active`` row's last token and drafts [B, k]): the penalties over ``record`` (each position's:
    the row's text and the drafts before it), the eos held back from a token that would be new token
    ``made`` [B] + i of a row short of its min_new_tokens, verification (``uniforms`` when sampled),
    the crop, and the emitted tokens into ``record``, in place. ``rule``: (sampling filters as
    sampling_rows gives them or None when greedy, penalty_rows's penalties, min_new_tokens [B] or
    None, the eos columns [V] or None, whether to return log-probabilities). -> (tokens [B, k + 1],
    num_emitted [B], num_accepted [B], committed [B], the tokens' log-probabilities under the
    target's raw logits [B, k + 1] or None)."""
    *processing, logprobs = rule
    tokens, num_emitted, num_accepted, committed = processed_and_verified(
        logits, draft_tokens, draft_probs, uniforms, active, cache, record, made, processing)
    columns = torch.arange(draft_tokens.shape[1] + 1, device=logits.device)
    record.add(torch.where(columns[None, :] < num_emitted[:, None], tokens, logits.shape[-1]))
    chosen = token_logprobs(logits, tokens.clamp(min=0)) if logprobs else None
    return tokens, num_emitted, num_accepted, committed, chosen


class SpeculativeBatcher(ContinuousBatcher):
    """``SpeculativeBatcher(model, draft_model=None, speculate_k=4, max_ngram_size=3, batch_size=8,
    max_length=None)``: a ContinuousBatcher (``submit``, ``step``, ``run``, the same per-request
    options) whose steps are speculative rounds. ``draft_model``: a patched model sharing the
    target's vocabulary; None proposes by prompt lookup (n-grams of up to ``max_ngram_size`` tokens
    in each row's prompt and output). ``last_tokens`` holds {id: [tokens]} of each step (a round
    gives a request one to k + 1), ``last_logprobs`` {id: [log-probabilities]};
    ``num_proposed`` / ``num_accepted`` count draft tokens over all rounds. ``max_prefill_tokens``
    as ContinuousBatcher's: prompts go in over several steps, in the rounds' forwards;
    ``reuse_prefixes`` as ContinuousBatcher's, the draft's cache rows copied alike."""

    def __init__(self, model, draft_model=None, *, speculate_k: int = 4, max_ngram_size: int = 3,
                 batch_size: int = 8, max_length: int | None = None, eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None, compile: bool = False, tokenizer=None,
                 max_prefill_tokens: int | None = None, reuse_prefixes: bool = False):
        op = "SpeculativeBatcher"
        common.check_model(op, "model", model)
        common.check_rollback(op, "model", model)
        self.k = self.extra_slots = check_int(op, "speculate_k", speculate_k, 1)
        if draft_model is not None:
            if is_mtp_model(draft_model) or is_gemma4_assistant(draft_model):
                raise ValueError(f"{op}: draft_model is {type(draft_model).__name__}, which drafts from the target's "
                                 "hidden states or cache; a SpeculativeBatcher takes a draft model of its own (or "
                                 "None: prompt lookup); speculative_generate takes this one")
            _check_draft_model(op, model, draft_model)
        else:
            check_int(op, "max_ngram_size", max_ngram_size, 1)
        # (a default max_length leaves room in the draft's position table too)
        self.position_models = (draft_model,) if draft_model is not None else ()
        super().__init__(model, batch_size=batch_size, max_length=max_length, eos_token_id=eos_token_id,
                         generator=generator, compile=compile, tokenizer=tokenizer,
                         max_prefill_tokens=max_prefill_tokens, reuse_prefixes=reuse_prefixes)
        capacity = self.max_length + self.k
        if draft_model is not None:  # (the draft embeds the prompts too)
            self.vocab_size = min(self.vocab_size, common.input_vocab_size(draft_model))
            common.check_positions_fit(op, "draft_model", draft_model, capacity, "max_length + speculate_k")
        # compiled, a round after its drafts is one call of the target (_verify_going)
        self.verify_going = compiled_function(model, _verify_going, "verify_going") if compile else None
        # (a round that takes new prompts in: its target forward as wide as they are, then this call)
        self.verified_going = compiled_function(model, _verified_going, "verified_going") if compile else None
        self.proposer = (_DraftRows(draft_model, self.batch_size, capacity, compile, self.k, holder=self)
                         if draft_model is not None else
                         _LookupRows(self.batch_size, capacity + self.k + 1, max_ngram_size, self.output_vocab,
                                     self.device))
        if reuse_prefixes and any(c.has_ring_layers or c.has_recurrent_layers for c in self.proposer.caches):
            raise ValueError(f"{op}: reuse_prefixes copies a row's first positions, but draft_model's cache has "
                             "ring-buffer layers or recurrent states, which do not keep them; leave reuse_prefixes "
                             "False")
        # each running row's last token: emitted, not yet in the target's cache (the next round's first input)
        self.last = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        # each running row's count of generated tokens, its last included (kept on the device: a round reads
        # it there and adds its emitted tokens; an idle row's is stale until its next request's first token)
        self.made = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        self.last_tokens: dict[int, list[int]] = {}
        self.last_logprobs: dict[int, list[float]] = {}
        self.num_proposed = self.num_accepted = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over all rounds so far (0 before any)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """One round for every running request whose prompt is in, the next parts of prompts in its
        forwards; the requests that ended, their rows free for the next step."""
        ended, self.last_tokens, self.last_logprobs = {}, {}, {}
        going = [b for b, r in enumerate(self.rows) if r is not None and r.filled == len(r.prompt)]
        new = self._admit()
        if new:
            self.proposer.admit(self, new)
        spans = self._prompt_spans()
        merged = spans if going and spans and self._can_merge(spans) else {}
        if merged:
            self._empty_started(self.proposer.caches + [self.cache], merged)
            self.proposer.merge(self, merged)
        if going:
            self._round(going, merged, ended)
        if spans and not merged:  # (in forwards of their own, the going rows' states kept)
            going = [b for b in going if self.rows[b] is not None]
            self._fill(spans, going)
            self.proposer.fill(self, spans, going)
        for b, (_, stop) in merged.items():
            self.rows[b].filled = stop
        complete = [b for b in spans if self.rows[b].filled == len(self.rows[b].prompt)]
        if complete:  # (their first tokens, from the target's logits after their prompts)
            tokens, logprobs = self._sample(complete)
            rows = self._rows(complete)
            first = torch.tensor(tokens, device=self.device)
            self.last = torch.where(rows, first, self.last)
            self.made = torch.where(rows, 1, self.made)
            self.proposer.append(first[:, None], rows.to(torch.int64))
            for b in complete:
                self._give(b, [tokens[b]], None if logprobs is None else [logprobs[b]], ended)
        return ended

    def _take_prefix(self, source: int, b: int, length: int, caches: list) -> int:
        """As ContinuousBatcher's, in the draft's cache too, within what the draft's row holds (one
        token less than the target's after a round that accepted every draft)."""
        for cache in self.proposer.caches:
            length = min(length, int(cache.seq_lengths[source]))
        return super()._take_prefix(source, b, length, caches + self.proposer.caches) if length else 0

    def _can_merge(self, spans: dict[int, tuple[int, int]]) -> bool:
        """Whether the parts of prompts ``spans`` can share the round's forwards: no recurrent state
        (padding would advance it) and, with ring-buffer layers, parts short enough for one forward."""
        caches = self.proposer.caches + [self.cache]
        width = max(stop - start for start, stop in spans.values())
        return not any(c.has_recurrent_layers or (c.has_ring_layers and width > c.max_step_tokens) for c in caches)

    def _round(self, going: list[int], merged: dict[int, tuple[int, int]], ended: dict) -> None:
        """A speculative round for the ``going`` rows (the parts of prompts ``merged`` in its
        forwards, those rows' next-token logits kept); each request takes its emitted tokens."""
        k, V = self.k, self.output_vocab
        active = self._rows(going)
        rows = [r if r is not None else self.rows[going[0]] for r in self.rows]
        rounds = self._rounds(rows)
        if merged:
            def target_step(target_input, mask, cache):
                ids, real = self.with_prompts(merged, target_input, mask)
                logits = forward_with_cache(self.model, ids, cache, attention_mask=real, logits_to_keep=k + 1).logits
                self._keep_logits(list(merged), logits[:, -1])
                return logits
        else:
            target_step = self.step_forward
        history = History(None, self.made, self.record)
        asks = any(self.rows[b].logprobs is not None for b in going)
        if (self.verified_going if merged else self.verify_going) is not None:
            tokens, num_emitted, logprobs = self._round_in_calls(rounds, active, history, target_step, merged, asks)
        else:
            tokens, num_emitted, num_accepted, target_logits, _ = rounds.verify_round(
                self.proposer, target_step, self.cache, self.last, active, history)
            if self.record.seen is not None or self.record.counts is not None:
                emitted = torch.arange(k + 1, device=self.device)[None, :] < num_emitted[:, None]
                self.record.add(torch.where(emitted, tokens, V))
            logprobs = token_logprobs(target_logits, tokens.clamp(min=0)).tolist() if asks else None
        self.last = torch.where(active, tokens.gather(1, (num_emitted - 1).clamp(min=0)[:, None])[:, 0], self.last)
        self.made = self.made + num_emitted  # (0 for the rows not going; a row that ends is idle from now on)
        self.proposer.append(tokens, num_emitted)
        tokens, counts = tokens.tolist(), num_emitted.tolist()
        for b in going:
            self.num_proposed += k
            self.num_accepted += counts[b] - 1
            self._give(b, tokens[b][:counts[b]], None if logprobs is None else logprobs[b][:counts[b]], ended)

    def _round_in_calls(self, rounds: SpeculativeRounds, active: torch.Tensor, history: History, target_step,
                        merged: dict, asks: bool) -> tuple:
        """A compiled round's drafts (one call of the draft, after its first forward where it takes
        new prompts in), then one call of the target: its forward and everything after it, or where
        the round takes new prompts in (``merged``), everything after ``target_step``'s forward, as
        wide as they are. -> (tokens [B, k + 1], num_emitted [B], the log-probabilities as lists if
        ``asks``, else None)."""
        draft_tokens, draft_probs = self.proposer.propose(rounds, self.last, active, history)
        self.cache.checkpoint()  # (a hybrid's recurrent states: the call's crop rolls them back)
        rule = (rounds.sampling_filters(self.batch_size, self.device), *rounds.logit_rows(self.batch_size, self.device),
                asks)
        uniforms = rounds.verification_uniforms(active)
        if merged:
            logits = target_step(*target_input(self.last, draft_tokens, active), self.cache)
            verified = self.verified_going(logits, draft_tokens, draft_probs, uniforms, active, self.made, self.cache,
                                           self.record, rule)
        else:
            verified = self.verify_going(draft_tokens, draft_probs, uniforms, active, self.last, self.made,
                                         self.cache, self.record, rule)
        tokens, num_emitted, num_accepted, committed, chosen = verified
        self.proposer.commit(active, committed, num_accepted, draft_tokens)
        # (on a GPU the call's outputs are read before the next call)
        return tokens, num_emitted, chosen.tolist() if asks else None

    def _rounds(self, rows: list) -> SpeculativeRounds:
        """The rounds' options for the requests in ``rows`` (idle rows: a running request's), made when
        the rows change (_for_rows), so that the [B] values a compiled round reads (sampling_filters,
        logit_rows) are built once, not every round."""
        def make() -> SpeculativeRounds:
            sampling, penalties = self._arguments()
            least = [r.min_new_tokens for r in rows]
            return SpeculativeRounds(
                self.model, None, max_new_tokens=0, most_new_tokens=0, k=self.k, temperature=sampling[0],
                top_k=sampling[1], top_p=sampling[2], min_p=sampling[3], eos=self.eos, pad=0, generator=self.generator,
                compile=self.compile, repetition_penalty=penalties[0], presence_penalty=penalties[1],
                frequency_penalty=penalties[2], is_eos=self.is_eos,
                min_new_tokens=torch.tensor(least, device=self.device) if any(least) else 0)

        return self._for_rows("rounds", make)

    def _give(self, b: int, tokens: list[int], logprobs: list[float] | None, ended: dict) -> None:
        """Row ``b``'s request takes ``tokens`` (up to the one that ends it), and this step's
        ``last_tokens`` / ``last_logprobs`` show them."""
        request = self.rows[b]
        taken = self._take(b, tokens, logprobs, ended)
        self.last_tokens.setdefault(request.id, []).extend(tokens[:taken])
        if request.logprobs is not None:
            self.last_logprobs.setdefault(request.id, []).extend(logprobs[:taken])


class _DraftRows(DraftModelProposer):
    """A draft model's proposals; a new request's prompt runs through the draft into its emptied row,
    in the round's first draft forward (``merge``; compiled, the drafts after it in one call) or in
    one of its own (``fill``)."""

    merging: tuple | None = None  # (the batcher, the parts of prompts the next round's first forward takes)

    def __init__(self, draft_model, batch_size: int, capacity: int, compile: bool, k: int, *, holder=None):
        super().__init__(draft_model, batch_size, capacity, compile, k, holder=holder)
        if compile:
            self.drafts_after = compiled_function(draft_model, _drafts_after, "drafts_after")

    @property
    def caches(self) -> list:
        return [self.cache]

    def admit(self, batcher: SpeculativeBatcher, rows: list[int]) -> None:
        self.pending.masked_fill_(batcher._rows(rows), -1)

    def merge(self, batcher: SpeculativeBatcher, spans: dict[int, tuple[int, int]]) -> None:
        self.merging = (batcher, spans)

    def fill(self, batcher: SpeculativeBatcher, spans: dict[int, tuple[int, int]], going: list[int]) -> None:
        batcher._run(self.model, self.cache, self.step, [], spans, going)

    def drafts_in_one_call(self, rounds: SpeculativeRounds, history: History) -> bool:
        return self.merging is None and super().drafts_in_one_call(rounds, history)  # (merging: first_logits's)

    def first_logits(self, first_input: torch.Tensor, first_mask: torch.Tensor) -> torch.Tensor:
        if self.merging is None:
            return super().first_logits(first_input, first_mask)
        (batcher, spans), self.merging = self.merging, None
        ids, mask = batcher.with_prompts(spans, first_input, first_mask)
        return forward_with_cache(self.model, ids, self.cache, attention_mask=mask, logits_to_keep=1).logits[:, -1]

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        return None  # (the draft's cache follows the rounds: commit)


class _LookupRows:
    """Prompt-lookup proposals over each row's text (its request's prompt and what it generated), kept
    on the device as ``text`` [B, width] (-1 past each row's ``lengths``)."""

    def __init__(self, batch_size: int, width: int, max_ngram_size: int, vocab_size: int, device: torch.device):
        self.width, self.max_ngram_size, self.vocab_size = width, max_ngram_size, vocab_size
        self.text = torch.full((batch_size, width + 1), -1, dtype=torch.int64, device=device)  # (+ a dump column)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)

    caches: list = []  # (no cache of its own)

    def merge(self, batcher: SpeculativeBatcher, spans: dict[int, tuple[int, int]]) -> None:
        return None

    def fill(self, batcher: SpeculativeBatcher, spans: dict[int, tuple[int, int]], going: list[int]) -> None:
        return None

    def admit(self, batcher: SpeculativeBatcher, rows: list[int]) -> None:
        for b in rows:
            prompt = batcher.rows[b].prompt
            row = torch.full((self.width + 1,), -1, dtype=torch.int64)
            row[:len(prompt)] = torch.tensor(prompt)
            self.text[b] = row.to(self.text.device)
            self.lengths[b] = len(prompt)

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Each row's first ``counts`` [B] of ``tokens`` [B, T] follow its text."""
        columns = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        slots = torch.where(columns < counts[:, None], self.lengths[:, None] + columns, self.width)
        self.text.scatter_(1, slots.clamp(max=self.width), tokens)
        self.text[:, self.width] = -1
        self.lengths += counts

    def propose(self, rounds: SpeculativeRounds, last, active, history):
        """-> draft tokens [B, k], and their one-hot distributions [B, k, V] (None when greedy)."""
        # (a row that never held a request has no text: its drafts, padding in every forward, must still be ids)
        drafts = emittable(lookup_continuations(self.text[:, :self.width], self.lengths.clamp(min=1, max=self.width),
                                                rounds.k, self.max_ngram_size), self.vocab_size)
        if rounds.greedy:
            return drafts, None
        return drafts, torch.nn.functional.one_hot(drafts, self.vocab_size).float()

    def commit(self, active, committed, num_accepted, draft_tokens, target_hidden=None) -> None:
        return None
