"""Batched speculative decoding (API.md section 2): k proposed tokens per row, the target scores
all k + 1 positions in one forward (kv_cache_attention with T = k + 1) and ``verify_draft``
accepts a prefix per row; rows advance by different amounts and finish independently. Greedy
output equals the target's own greedy decoding; sampled output follows the target's distribution
(after the repetition penalty and temperature / top-k / top-p / min-p), whatever the proposals.

``speculative_generate`` proposes with a draft model (DraftModelProposer), with the target's own
multi-token-prediction layer (generation/mtp.py) or with a Gemma 4 assistant, which drafts over the
target's cache (generation/assistant.py); the round loop (SpeculativeRounds) also serves
prompt-lookup decoding (generation/prompt_lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.assistant import AssistantProposer, check_assistant, is_gemma4_assistant
from gptfast_kernels.generation.end_watch import EndWatch
from gptfast_kernels.generation.forward import cache_for, drafts_function, step_function
from gptfast_kernels.generation.mtp import MtpProposer, check_mtp, is_mtp_model
from gptfast_kernels.generation.options import check_decode_options
from gptfast_kernels.generation.sampling import (DraftProcessing, TokenRecord, eos_columns, holds_eos_back,
                                                 logits_to_probs, penalty_rows, pick_uniforms, process_logits,
                                                 sample_by_uniform, sampling_rows, token_logprobs, too_early)
from gptfast_kernels.generation.stopping import StopMatcher
from gptfast_kernels.generation.verify_step import (RoundRule, RoundState, settle, target_input,
                                                    verification_scores, verify_and_crop, verify_function)
from gptfast_kernels.modules.static_kv_cache import StaticKVCache
from gptfast_kernels.ops._dispatch import check_int


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor     # [B, P + new] int64, padded with the pad (or eos) id
    num_proposed: torch.Tensor  # [B] int64: draft tokens proposed to each row
    num_accepted: torch.Tensor  # [B] int64: draft tokens the target accepted, per row
    acceptance_rate: float      # accepted / proposed over the batch (0 when nothing was proposed)
    # [B, new] float32 with output_logprobs=True: each new token's log-probability under the target's
    # raw distribution (as GenerateOutput.logprobs); 0 after a row's end
    logprobs: torch.Tensor | None = None


@torch.no_grad()
def speculative_generate(model, draft_model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         *, max_new_tokens: int, speculate_k: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                         repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                         frequency_penalty: float = 0.0, min_new_tokens: int = 0,
                         eos_token_id: int | list[int] | None = None, stop_sequences: list[list[int]] | None = None,
                         stop_strings: str | list[str] | None = None, tokenizer=None,
                         generator: torch.Generator | None = None, compile: bool = False, streamer=None,
                         output_logprobs: bool = False) -> SpeculativeOutput:
    """input_ids [B, P] (attention_mask [B, P], 0 = padding, left or right) -> SpeculativeOutput.
    Both models must be patched (patch_model) and share a vocabulary; ``draft_model`` may also be the
    target's MTP layer (transformers' MtpModel, patched: generation/mtp.py) or, for a Gemma 4 target,
    a Gemma 4 assistant as transformers builds it (generation/assistant.py). ``compile``: run the draft's
    and the target's per-round forwards through torch.compile (CUDA graphs on GPUs), as in
    ``generate``. ``streamer`` (one prompt only, as in transformers' assisted generation): ``put``
    gets the prompt [1, P], then each round's new tokens [1, n] on the CPU; then ``end()``.
    ``repetition_penalty`` as in ``generate``: the target's distribution at each position penalises
    the tokens before it (the drafts before it included), so the output is still exactly the
    penalised target's; the draft's distributions are penalised the same way. ``presence_penalty``
    and ``frequency_penalty`` likewise (each position counts the drafts before it as generated).
    ``min_new_tokens`` as in ``generate``, per position of a round likewise; the sampling arguments,
    penalties and token limits per row as there (a batch with any sampled row is verified by sampling, its greedy rows'
    distributions one-hot: they still get the target's greedy tokens); ``stop_sequences``,
    ``stop_strings`` (with ``tokenizer``) and ``output_logprobs`` as there (a round that completes
    a stop sequence or string keeps the tokens up to the one that completes it)."""
    op = "speculative_generate"
    common.check_model(op, "model", model)
    mtp, assistant = is_mtp_model(draft_model), is_gemma4_assistant(draft_model)
    if mtp:
        check_mtp(op, model, draft_model)
    elif assistant:
        check_assistant(op, model, draft_model)
    else:
        _check_draft_model(op, model, draft_model)
    rounds = SpeculativeRounds.checked(op, model, input_ids, attention_mask, max_new_tokens, speculate_k,
                                       temperature, top_k, top_p, min_p, eos_token_id, generator, compile,
                                       min(common.input_vocab_size(model), common.input_vocab_size(draft_model)),
                                       streamer, repetition_penalty, min_new_tokens, output_logprobs,
                                       presence_penalty, frequency_penalty, stop_sequences, stop_strings, tokenizer)
    if assistant:
        return rounds.run(lambda capacity, target_cache: AssistantProposer(draft_model, model, target_cache, compile,
                                                                          rounds.k))
    proposer = MtpProposer if mtp else DraftModelProposer
    if not mtp and rounds.most_new_tokens:
        common.check_positions_fit(op, "draft_model", draft_model, rounds.slots, POSITIONS_TAKEN)
    return rounds.run(lambda capacity, target_cache: proposer(draft_model, rounds.batch_size, capacity, compile,
                                                              rounds.k))


# (what check_positions_fit says takes the positions a call's caches hold)
POSITIONS_TAKEN = "the longest prompt + max_new_tokens + speculate_k (a round's drafts go past a row's last token)"


def capacity(prompt: common.Prompt, most_new_tokens: int, k: int) -> int:
    """The cache slots per row a speculative call takes: its longest prompt, the most new tokens
    of a row, and a round's k drafts past them."""
    return max(prompt.lengths) + most_new_tokens + k


def _check_draft_model(op: str, model, draft_model) -> None:
    common.check_model(op, "draft_model", draft_model)
    common.check_rollback(op, "draft_model", draft_model)
    target_vocab, draft_vocab = common.output_vocab_size(model), common.output_vocab_size(draft_model)
    if target_vocab != draft_vocab:
        raise ValueError(f"{op}: draft_model's vocabulary ({draft_vocab} tokens) differs from model's "
                         f"({target_vocab}); the two models must share a tokenizer")
    common.check_same_device(op, model, draft_model)


class Proposer(Protocol):
    """What SpeculativeRounds asks of a source of drafts, once per call / round. One with
    ``takes_target_hidden = True`` gets the target's last hidden states (the final norm's output)
    of each target forward: [B, P, H] at every prompt column, then [B, k + 1, H] per round."""

    def prefill(self, prompt: common.Prompt, target_hidden: torch.Tensor | None = None) -> None:
        """After the target's prefill: take in the prompt."""

    def propose(self, rounds: "SpeculativeRounds", last: torch.Tensor, active: torch.Tensor,
                history: "History") -> tuple[torch.Tensor, torch.Tensor | None]:
        """last [B] (the last emitted token, not yet in the target's cache), active [B] bool ->
        draft tokens [B, k] int64 and the distributions they were drawn from [B, k, V] float32
        (None when ``rounds.greedy``)."""

    def commit(self, active: torch.Tensor, committed: torch.Tensor, num_accepted: torch.Tensor,
               draft_tokens: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """After verification: each active row kept ``committed`` tokens in the target's cache,
        ``num_accepted`` [B] of the drafts."""


class DraftModelProposer:
    """Proposals from a draft model with a StaticKVCache of its own. Its cache holds what the
    target's holds, except that when the previous round accepted all k drafts, the k-th draft token
    is not in it yet (``pending``): the round's first draft forward therefore takes two tokens,
    [pending, last], the first one padding (-1 position) in rows with nothing pending."""

    def __init__(self, draft_model, batch_size: int, capacity: int, compile: bool, k: int, *, holder=None):
        device, dtype = common.model_device_dtype(draft_model)
        self.model = draft_model
        # a round writes up to k + 1 tokens (two in its first forward) and rolls back up to k (``holder``: a
        # batcher, whose cache this is while it lives: cache_for)
        self.cache = cache_for(draft_model, batch_size, capacity, device, dtype, reuse=compile, step_tokens=k + 1,
                               role="draft", holder=holder)
        self.step = step_function(draft_model, compile)
        # compiled, a round's drafts are one call (a hybrid draft's forwards record its states' history there)
        self.drafts = drafts_function(draft_model) if compile else None
        # the drafts in one call after a first forward run outside it (forward._drafts_after): none here; a
        # batcher's proposer, whose first forward may take new prompts in, has it compiled
        self.drafts_after = None
        self.pending = torch.full((batch_size,), -1, dtype=torch.int64, device=device)

    def prefill(self, prompt: common.Prompt, target_hidden=None) -> None:
        common.fill_cache(self.model, prompt, self.cache)

    def propose(self, rounds: "SpeculativeRounds", last, active, history) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft tokens [B, k], and their distributions [B, k, V] (None when greedy)."""
        self.cache.checkpoint()  # (a hybrid draft's recurrent states: commit rolls them back)
        first_input = torch.stack([self.pending.clamp(min=0), last], dim=1)
        first_mask = torch.stack([(self.pending >= 0) & active, active], dim=1)
        if self.drafts_in_one_call(rounds, history):
            drafts, distributions = self.drafts(first_input, first_mask, active, self.cache, rounds.k,
                                                rounds.draft_sampling(last), rounds.draft_processing(history))
        else:
            logits = self.first_logits(first_input, first_mask)
            if self.drafts_after is None:
                return rounds.draft(history, logits,
                                    lambda token: self.step(token[:, None], active[:, None], self.cache)[:, -1])
            drafts, distributions = self.drafts_after(logits, active, self.cache, rounds.k,
                                                      rounds.draft_sampling(last), rounds.draft_processing(history))
        # (on a GPU a CUDA graph's outputs, which the target's forward, the next compiled call, may
        # write over: verification reads them after it)
        return drafts.clone(), None if distributions is None else distributions.clone()

    def drafts_in_one_call(self, rounds: "SpeculativeRounds", history: "History") -> bool:
        """Whether this round's drafts are one compiled call (compiled; the penalties and the eos
        held back processed in the call: draft_processing); else ``first_logits``, then the drafts
        in one call of ``drafts_after`` if there is one, or a step per draft."""
        return self.drafts is not None

    def first_logits(self, first_input: torch.Tensor, first_mask: torch.Tensor) -> torch.Tensor:
        """The round's first draft forward, [pending, last] [B, 2] -> the last column's logits [B, V]."""
        return self.step(first_input, first_mask, self.cache)[:, -1]

    def commit(self, active, committed, num_accepted, draft_tokens, target_hidden=None) -> None:
        """The round's outcome: each active row keeps ``committed`` tokens in the cache."""
        self.cache.crop(torch.where(active, committed, self.cache.seq_lengths), check=False)
        k = draft_tokens.shape[1]
        self.pending = torch.where(active & (num_accepted == k), draft_tokens[:, -1], -1)


@dataclass
class History:
    """What every row has generated so far (after its prompt): ``generated`` [B, W], valid up to
    ``num_generated`` [B] per row; ``record``: what the penalties read of each row's text so far."""
    generated: torch.Tensor
    num_generated: torch.Tensor
    record: TokenRecord = field(default_factory=TokenRecord)


@dataclass
class SpeculativeRounds:
    """The round loop both speculative generators share; a proposer supplies the k drafts per row.
    Cache invariant at the start of a round, per row: the target cache holds every token so far
    except the last one emitted (``last``)."""
    model: object
    prompt: common.Prompt
    max_new_tokens: int | torch.Tensor  # for every row, or [B] per row
    most_new_tokens: int  # the largest of them
    k: int
    # each a number for every row or a [B] tensor of per-row values (sampling.check_sampling_args)
    temperature: float | torch.Tensor
    top_k: int | torch.Tensor | None
    top_p: float | torch.Tensor | None
    min_p: float | torch.Tensor | None
    eos: list[int]
    pad: int
    generator: torch.Generator | None
    compile: bool
    streamer: object = None
    # the penalties: each a number for every row or a [B] tensor of per-row values (check_penalties)
    repetition_penalty: float | torch.Tensor | None = None
    min_new_tokens: int | torch.Tensor = 0  # for every row, or [B] per row
    output_logprobs: bool = False
    is_eos: torch.Tensor | None = None  # [V] bool: the eos columns on the model's device (set by run)
    presence_penalty: float | torch.Tensor = 0.0
    frequency_penalty: float | torch.Tensor = 0.0
    stop: StopMatcher | None = None  # the stop sequences and strings, or None
    # what compiled calls read of the options, as [B] tensors, built once per run (sampling_filters', logit_rows')
    filter_rows: tuple | None = field(default=None, init=False, repr=False)
    processing_rows: tuple | None = field(default=None, init=False, repr=False)

    @classmethod
    def checked(cls, op, model, input_ids, attention_mask, max_new_tokens, speculate_k, temperature, top_k, top_p,
                min_p, eos_token_id, generator, compile, vocab_size, streamer,
                repetition_penalty=None, min_new_tokens=0, output_logprobs=False, presence_penalty=0.0,
                frequency_penalty=0.0, stop_sequences=None, stop_strings=None, tokenizer=None) -> "SpeculativeRounds":
        """Validates the arguments every speculative generator shares (``op`` names the caller)."""
        common.check_model(op, "model", model)
        common.check_rollback(op, "model", model)
        check_int(op, "speculate_k", speculate_k, 1)
        device, _ = common.model_device_dtype(model)
        prompt = common.check_prompt(op, input_ids, attention_mask, device, vocab_size)
        options = check_decode_options(
            op, model, prompt, device, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, eos_token_id=eos_token_id,
            stop_sequences=stop_sequences, stop_strings=stop_strings, tokenizer=tokenizer,
            output_logprobs=output_logprobs, compile=compile, streamer=streamer, generator=generator)
        if streamer is not None and prompt.input_ids.shape[0] != 1:
            raise ValueError(f"{op}: a streamer takes one prompt (rows advance by different numbers of tokens "
                             f"per round), got a batch of {prompt.input_ids.shape[0]}")
        o = options
        # (drafts past the tokens a row can still make after its prefill's one are never emitted: k is
        # capped there, as transformers' assisted generation caps it; they cost a forward column each)
        k = min(speculate_k, max(1, o.most_new_tokens - 1))
        rounds = cls(model, prompt, o.max_new_tokens, o.most_new_tokens, k, o.temperature, o.top_k, o.top_p,
                     o.min_p, o.eos, o.pad, generator, compile, streamer, o.repetition_penalty, o.min_new_tokens,
                     output_logprobs, presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
                     stop=o.stop)
        if rounds.most_new_tokens:
            common.check_positions_fit(op, "model", model, rounds.slots, POSITIONS_TAKEN)
        return rounds

    @property
    def batch_size(self) -> int:
        return self.prompt.input_ids.shape[0]

    @property
    def slots(self) -> int:
        """The cache slots per row the call takes (``capacity``)."""
        return capacity(self.prompt, self.most_new_tokens, self.k)

    @property
    def greedy(self) -> bool:
        """Whether every row decodes greedily (a batch of greedy and sampled rows is verified by
        sampling, its greedy rows' distributions one-hot: exact for them too)."""
        return not isinstance(self.temperature, torch.Tensor) and self.temperature == 0

    def too_early(self, generated: torch.Tensor, offset: int | range) -> torch.Tensor | None:
        """Where a token would be new token number ``generated`` [B] + ``offset`` (from 0) of its row,
        and so may not be an eos (``min_new_tokens``): [B] for an int offset, [B, len(offset)] for a
        range. None when nothing is suppressed, and then nothing is computed: a round asks k + 1
        times, and on a GPU every operation is a launch."""
        if not self.eos or not holds_eos_back(self.min_new_tokens):
            return None
        if isinstance(offset, range):
            made = generated[:, None] + torch.arange(offset.start, offset.stop, device=generated.device)[None, :]
        else:
            made = generated + offset
        return too_early(made, self.min_new_tokens, made.shape[0], made.device)

    def processed(self, logits, record: TokenRecord, early):
        """logits [..., V] with the penalties over ``record`` (per row or per row and position) and the
        eos ids suppressed where ``early`` [...] (None: nowhere; see sampling.process_logits)."""
        return process_logits(logits, record, self.repetition_penalty, self.is_eos, early, self.presence_penalty,
                              self.frequency_penalty)

    def pick(self, logits, record: TokenRecord, early=None, uniforms=None):
        """[B, V] logits -> ([B] tokens, [B, V] float32 probabilities, or None when greedy: greedy
        verification needs only the target's argmax, so no distribution is built). ``record``: what
        the penalties read of each row's text; ``early`` [B]: rows whose eos ids are suppressed (see
        ``processed``); ``uniforms`` [B]: sampled by sample_by_uniform at these (default: drawn from
        the generator as pick_uniforms draws them, so a row's first token is generate's at the same
        seed)."""
        logits = self.processed(logits, record, early)
        if self.greedy:
            return logits.argmax(dim=-1), None
        probs = logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)
        if uniforms is None:
            uniforms = pick_uniforms(self.temperature, logits.shape[0], logits.device, self.generator)
        return sample_by_uniform(probs, uniforms), probs

    def drafts_unprocessed(self, history: History) -> bool:
        """Whether the drafts are picked from the draft's logits as they are: no penalty, no eos held
        back (then ``draft`` processes nothing, and a round's drafts in one call take no
        draft_processing)."""
        return (history.record.seen is None and history.record.counts is None
                and self.too_early(history.num_generated, 0) is None)

    def draft_processing(self, history: History) -> DraftProcessing | None:
        """What a round's drafts are processed with in one compiled call (the penalties over each
        row's text so far, the eos held back from rows short of min_new_tokens), None when
        ``drafts_unprocessed``. Each penalty and min_new_tokens as [B] values (a number as every
        row's: another value is not another graph)."""
        if self.drafts_unprocessed(history):
            return None
        generated = history.num_generated
        penalties, least, is_eos = self.logit_rows(generated.shape[0], generated.device)
        return DraftProcessing(history.record, generated, penalties, is_eos, least)

    def logit_rows(self, batch_size: int, device: torch.device) -> tuple:
        """What a compiled call processes logits with: (penalty_rows's penalties, min_new_tokens [B],
        the eos columns [V]; the last two None where no row is held back)."""
        if self.processing_rows is None:  # (the same for every round of a run)
            penalties = penalty_rows(self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                                     batch_size, device)
            least = None
            if self.eos and holds_eos_back(self.min_new_tokens):
                least = self.min_new_tokens
                if not isinstance(least, torch.Tensor):
                    least = torch.full((batch_size,), least, device=device)
            self.processing_rows = (penalties, least, None if least is None else self.is_eos)
        return self.processing_rows

    def sampling_filters(self, batch_size: int, device: torch.device) -> tuple | None:
        """What a compiled call samples with: temperature, top_k, top_p, min_p as sampling_rows gives
        them; None when greedy."""
        if self.greedy:
            return None
        if self.filter_rows is None:  # (the same for every round of a run)
            self.filter_rows = sampling_rows(self.temperature, self.top_k, self.top_p, self.min_p, batch_size, device)
        return self.filter_rows

    def draft_uniforms(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A round's draws for sampling its drafts, [B, k] float64 uniforms from the generator (draft i
        of a row sampled at column i: sample_by_uniform), drawn at once so that drafts sampled in one
        compiled call and step by step are the same; None when greedy. ``rows``: any [B] tensor of
        the round's, on its device."""
        if self.greedy:
            return None
        return torch.rand(rows.shape[0], self.k, dtype=torch.float64, device=rows.device, generator=self.generator)

    def draft_sampling(self, rows: torch.Tensor) -> tuple | None:
        """What a round's drafts are sampled with in one compiled call, None when greedy: (uniforms
        [B, k] (draft_uniforms), temperature, top_k, top_p, min_p as sampling_rows gives them)."""
        uniforms = self.draft_uniforms(rows)
        if uniforms is None:
            return None
        return uniforms, *self.sampling_filters(rows.shape[0], rows.device)

    def draft(self, history: History, logits: torch.Tensor, advance: Callable[[torch.Tensor], torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts per row, one at a time: the first picked from ``logits`` [B, V], each next one
        from ``advance(token [B])`` -> logits [B, V] (the penalties and eos suppression as at those
        positions of the target) -> (tokens [B, k], distributions [B, k, V] or None when greedy)."""
        record = history.record.map(torch.clone)  # and the drafts, as they come
        uniforms = self.draft_uniforms(history.num_generated)
        tokens, probs = [], []
        for i in range(self.k):
            token, distribution = self.pick(logits, record, self.too_early(history.num_generated, i),
                                            None if uniforms is None else uniforms[:, i])
            record.add(token[:, None])
            tokens.append(token)
            probs.append(distribution)
            if i < self.k - 1:
                logits = advance(token)
        return torch.stack(tokens, dim=1), None if probs[0] is None else torch.stack(probs, dim=1)

    def round_forwards(self, proposer: Proposer, target_step, target_cache: StaticKVCache, last: torch.Tensor,
                       active: torch.Tensor, history: History) -> tuple:
        """A round's forwards for the ``active`` [B] rows (the others are padding: nothing written):
        k drafts, then the target's forward over ``last`` [B] and them (``target_step``, returning its
        last hidden states too when the proposer takes them). -> (draft tokens [B, k], their
        distributions [B, k, V] or None when greedy, the target's logits [B, k + 1, V], its last
        hidden states or None)."""
        draft_tokens, draft_probs = proposer.propose(self, last, active, history)
        target_cache.checkpoint()  # (a hybrid target's recurrent states: the crop rolls them back)
        target_logits = target_step(*target_input(last, draft_tokens, active), target_cache)
        target_hidden = None
        if getattr(proposer, "takes_target_hidden", False):
            target_logits, target_hidden = target_logits
        return draft_tokens, draft_probs, target_logits, target_hidden

    def verification_uniforms(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A round's draws for verify_draft, [B, k + 1] float32 from the generator (as verify_draft
        would draw them), drawn before the call that verifies; None when greedy (it reads none).
        ``rows``: any [B] tensor of the round's, on its device."""
        if self.greedy:
            return None
        return torch.rand((rows.shape[0], self.k + 1), generator=self.generator, device=rows.device,
                          dtype=torch.float32)

    def verify(self, proposer: Proposer, target_cache: StaticKVCache, active: torch.Tensor, history: History,
               forwards: tuple) -> tuple:
        """The round after ``forwards`` (round_forwards's), op by op: the penalties over the round's
        text at each position, the eos held back under min_new_tokens, verification, the crops
        (verify_and_crop) and the proposer's commit. -> (tokens [B, k + 1]: the row's emitted
        tokens first, num_emitted [B] (0 where inactive), num_accepted [B])."""
        draft_tokens, draft_probs, target_logits, target_hidden = forwards
        round_record = history.record.before_each(draft_tokens)  # position i: the drafts before it too
        # position i scores new token number num_generated + i of its row
        processed = self.processed(target_logits, round_record,
                                   self.too_early(history.num_generated, range(self.k + 1)))
        scores = verification_scores(processed, None if self.greedy else
                                     (self.temperature, self.top_k, self.top_p, self.min_p))
        tokens, num_emitted, num_accepted, committed = verify_and_crop(
            scores, draft_probs, draft_tokens, self.verification_uniforms(active), active, target_cache)
        proposer.commit(active, committed, num_accepted, draft_tokens, target_hidden)
        return tokens, num_emitted, num_accepted

    def verify_round(self, proposer: Proposer, target_step, target_cache: StaticKVCache, last: torch.Tensor,
                     active: torch.Tensor, history: History) -> tuple:
        """round_forwards, then ``verify``: one round, op by op after the forwards. -> (tokens,
        num_emitted, num_accepted (verify's), the target's logits [B, k + 1, V], its last hidden
        states or None)."""
        forwards = self.round_forwards(proposer, target_step, target_cache, last, active, history)
        return (*self.verify(proposer, target_cache, active, history, forwards), *forwards[2:])

    def run(self, make_proposer: Callable[[int, StaticKVCache], Proposer]) -> SpeculativeOutput:
        """``make_proposer(capacity, target_cache)``: the proposer, given the cache length the rounds
        need and the target's cache (which a Gemma 4 assistant reads)."""
        model, prompt, k, pad, B = self.model, self.prompt, self.k, self.pad, self.batch_size
        device, dtype = common.model_device_dtype(model)
        zeros = torch.zeros(B, dtype=torch.int64, device=device)
        eos_ids = torch.tensor(self.eos, dtype=torch.int64, device=device)
        streamer = self.streamer
        if streamer is not None:
            streamer.put(prompt.input_ids.cpu())
        if self.most_new_tokens == 0:
            if streamer is not None:
                streamer.end()
            return SpeculativeOutput(prompt.input_ids.clone(), zeros, zeros.clone(), 0.0,
                                     zeros.new_zeros(B, 0, dtype=torch.float32) if self.output_logprobs else None)
        slots = self.slots
        target_cache = cache_for(model, B, slots, device, dtype, reuse=self.compile, step_tokens=k + 1)
        proposer = make_proposer(slots, target_cache)
        takes_hidden = getattr(proposer, "takes_target_hidden", False)
        target_step = step_function(model, self.compile, hidden=takes_hidden)

        if takes_hidden:
            logits, target_hidden = common.prefill(model, prompt, target_cache, hidden=True)
            proposer.prefill(prompt, target_hidden)
        else:
            logits, target_hidden = common.prefill(model, prompt, target_cache), None
            proposer.prefill(prompt)
        V = logits.shape[-1]
        self.is_eos = eos_columns(eos_ids, V)
        record = TokenRecord.start(prompt.input_ids, prompt.attention_mask, V, self.repetition_penalty,
                                   self.presence_penalty, self.frequency_penalty)
        last, _ = self.pick(logits, record, self.too_early(zeros, 0))
        record.add(last[:, None])
        if self.compile:  # (the compiled rounds write it in place: at one address from call to call)
            record = record.kept_on(model)

        # generated tokens; a round writes up to k + 1 more, and column `dump` absorbs masked writes
        out = torch.full((B, self.most_new_tokens + 2 * (k + 1)), pad, dtype=torch.int64, device=device)
        out[:, 0] = last
        out_logprobs = None
        if self.output_logprobs:  # as out; the target's raw log-probabilities of the tokens there
            out_logprobs = torch.zeros(out.shape, dtype=torch.float32, device=device)
            out_logprobs[:, 0] = token_logprobs(logits, last)
        if streamer is not None:
            streamer.put(last[:, None].cpu())
        stop = self.stop
        state = RoundState.start(model, B, device, reuse=self.compile,
                                 stop_automata=0 if stop is None else len(stop.tables))
        state.last.copy_(last)
        state.num_generated.fill_(1)
        rule = RoundRule.build(k, B, device, self.sampling_filters(B, device), self.logit_rows(B, device),
                               self.max_new_tokens, self.min_new_tokens, self.eos, pad, self.output_logprobs,
                               dump=out.shape[1] - 1, stop=stop)
        state.finished.copy_(torch.isin(last, eos_ids) | (state.num_generated >= rule.max_new_tokens))
        if stop is not None:  # (the first token: a stop counts with no min_new_tokens)
            hits, states = stop.scan(stop.start(B), last[:, None])
            state.finished.copy_(state.finished | (hits[:, 0] & (self.min_new_tokens == 0)))
            state.stop_state.copy_(states[:, 0])
        state.count_remaining(rule.max_new_tokens)
        history = History(out, state.num_generated, record)
        # compiled, each round after its drafts is one call of the target (verify_step: its forward, the
        # penalties, verification, the crop (a hybrid's states rolled back) and the rows' state)
        one_call = verify_function(model) if self.compile else None
        # (compiled rounds on a GPU: the host queues the next round before the last has ended, unless a
        # streamer waits for each round's tokens anyway)
        watch = EndWatch(state.remaining, k + 1,
                         lagged=one_call is not None and streamer is None and EndWatch.lags_on(device))

        while watch.another():
            active = ~state.finished
            if one_call is not None:  # the drafts, then one call: the target's forward and the rest
                draft_tokens, draft_probs = proposer.propose(self, state.last, active, history)
                target_cache.checkpoint()  # (a hybrid target's recurrent states: the call's crop rolls them back)
                slots, values, chosen, committed, num_accepted, target_hidden = one_call(
                    draft_tokens, draft_probs, self.verification_uniforms(active), active, state, target_cache, rule,
                    record, takes_hidden)
                proposer.commit(active, committed, num_accepted, draft_tokens, target_hidden)
            else:
                forwards = self.round_forwards(proposer, target_step, target_cache, state.last, active, history)
                tokens, num_emitted, num_accepted = self.verify(proposer, target_cache, active, history, forwards)
                slots, values, chosen, emitted = settle(tokens, num_emitted, num_accepted, forwards[2], active,
                                                        state, rule)
                record.add(torch.where(emitted, tokens, V))
            # (on a GPU the compiled call's outputs are read before its next replay)
            if streamer is not None:  # one row: its emitted tokens (in column order), up to max_new_tokens
                streamer.put(values[slots < rule.max_new_tokens[:, None]][None].cpu())
            out.scatter_(1, slots, values)
            if out_logprobs is not None:
                out_logprobs.scatter_(1, slots, chosen)
            watch.queued()

        if streamer is not None:
            streamer.end()
        num_generated = state.num_generated
        # a round may emit past a row's max_new_tokens: those tokens go, and (as generate) the output
        # is as wide as the longest row that is left; positions past a row's own length hold pad already
        lengths = num_generated.clamp(max=self.max_new_tokens)
        new = int(lengths.max())
        kept = torch.arange(new, device=device)[None, :] < lengths[:, None]
        generated = torch.where(kept, out[:, :new], pad)
        logprobs = None if out_logprobs is None else torch.where(kept, out_logprobs[:, :new], 0.0)
        proposed, accepted = state.proposed.clone(), state.accepted.clone()
        total_proposed = int(proposed.sum())
        rate = int(accepted.sum()) / total_proposed if total_proposed else 0.0
        return SpeculativeOutput(torch.cat([prompt.input_ids, generated], dim=1), proposed, accepted, rate, logprobs)

