"""A speculative round after its drafts: the target's forward over each row's last token and its
drafts, the k + 1 positions verified against the drafts, the target's cache cut to each row's
committed tokens, and the rows' state advanced (the emitted tokens up to an eos, a stop pattern or
the row's limit, the counts, the stop automata's states: a gather per token, on the device; the
penalties' record, which grows by the emitted tokens; a hybrid target's recurrent states rolled
back by the crop), in one compiled call.

Done op by op after the forward, that is some forty small kernels a round, each a launch on a GPU
and a dispatch on a CPU, between the target's forward and the next round's drafts; and a compiled
forward's logits could not go into another compiled call as they are (on a GPU they live in the
CUDA-graph pool, which the next call may reuse), so verification in a call of its own would first
copy them. Compiled, the rows' state lives in buffers (RoundState, and the penalties' TokenRecord)
that the call updates in place and the model keeps between calls, like its cache, at fixed
addresses: a CUDA graph reads and writes them where they are. What the call returns (where each
emitted token goes in the output and what it is) is written into the output outside it, whose
width changes with ``max_new_tokens`` and would otherwise be a graph per width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gptfast_kernels.generation.end_watch import count_remaining
from gptfast_kernels.generation.forward import _forward, _forward_with_hidden, compiled_function
from gptfast_kernels.generation.sampling import (TokenRecord, eos_id_tensor, kept_on_model, logits_to_probs,
                                                 process_logits, token_logprobs)
from gptfast_kernels.generation.stopping import StopMatcher
from gptfast_kernels.ops.verify_draft import verify_draft

STATE_ATTRIBUTE = "_gptfast_round_state"  # where a compiling target keeps its RoundStates (a dict)


@dataclass
class RoundState:
    """Each row's state between speculative rounds, [B] buffers updated in place by ``settle``."""
    last: torch.Tensor           # int64: the last emitted token, not yet in the target's cache
    finished: torch.Tensor       # bool
    num_generated: torch.Tensor  # int64: new tokens so far (the first, picked after the prefill, included)
    proposed: torch.Tensor       # int64: drafts proposed to the row
    accepted: torch.Tensor       # int64: drafts the target accepted
    remaining: torch.Tensor      # 0-d int64: the most new tokens an unfinished row may still emit (0: all
    #                              finished), which the round loop's EndWatch reads
    stop_state: torch.Tensor     # [B, M] int64: each row's state in the M stop automata (StopMatcher's; M = 0: none)

    @classmethod
    def start(cls, model, batch_size: int, device: torch.device, *, reuse: bool, stop_automata: int = 0
              ) -> "RoundState":
        """Zeroed buffers (``stop_automata``: the stop matcher's automata, 0 without one). With
        ``reuse`` (compiled rounds) ``model`` keeps them and hands them out again for the same batch
        size, device and automata (one state each: calls in turn find theirs), marked static:
        compiled graphs are specialised on them."""
        def zeros(dtype, *shape):
            return torch.zeros(shape, dtype=dtype, device=device)

        def make():
            return cls(zeros(torch.int64, batch_size), zeros(torch.bool, batch_size), zeros(torch.int64, batch_size),
                       zeros(torch.int64, batch_size), zeros(torch.int64, batch_size), zeros(torch.int64),
                       zeros(torch.int64, batch_size, stop_automata))

        state = (kept_on_model(model, STATE_ATTRIBUTE, (batch_size, torch.device(device), stop_automata), make,
                               RoundState.buffers) if reuse else make())
        for tensor in state.buffers():
            tensor.zero_()
        return state

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.last, self.finished, self.num_generated, self.proposed, self.accepted, self.remaining,
                self.stop_state)

    def count_remaining(self, max_new_tokens: torch.Tensor) -> None:
        """``remaining`` from the rows' ends, counts and limits (``max_new_tokens`` [B])."""
        count_remaining(self.remaining, self.finished, self.num_generated, max_new_tokens)


class RoundRule(NamedTuple):
    """How a round verifies and when a row ends, as ``settle`` and ``_verify_round`` read it;
    tensors wherever a value may change between calls, so that a compiled round is not compiled
    anew for each value."""
    k: int                               # drafts per row and round
    filters: tuple | None                # sampling_rows's (temperature, top_k, top_p, min_p); None: greedy
    min_new_tokens: torch.Tensor | None  # [B]: no eos before that many new tokens; None: no row held back
    max_new_tokens: torch.Tensor         # [B] each row's limit
    eos_ids: torch.Tensor | None         # [n] int64; None: no eos
    is_eos: torch.Tensor | None          # [V] bool, the eos columns (only while a row may be held back)
    pad: int
    logprobs: bool                       # settle returns each emitted token's log-probability
    dump: torch.Tensor                   # 0-d int64: the output column that takes the writes of tokens not emitted
    stop_tables: tuple | None            # StopMatcher's tables; None: no stop pattern
    stops_from: torch.Tensor | None      # [B]: a stop pattern counts from that many new tokens on (with stop_tables)
    penalties: tuple                     # (repetition, presence, frequency), as penalty_rows gives them

    @classmethod
    def build(cls, k: int, batch_size: int, device: torch.device, filters: tuple | None, logit_rows: tuple,
              max_new_tokens, min_new_tokens, eos: list[int], pad: int, logprobs: bool, dump: int,
              stop: StopMatcher | None = None) -> "RoundRule":
        """From check_decode_options's values (numbers, or per-row [B] tensors), ``filters`` and
        ``logit_rows`` as SpeculativeRounds.sampling_filters and logit_rows give them (the [B]
        options the round's drafts call reads too); ``stop``: its stop matcher, whose patterns count
        from ``min_new_tokens`` on."""
        penalties, least, is_eos = logit_rows
        max_rows = max_new_tokens if isinstance(max_new_tokens, torch.Tensor) else torch.full(
            (batch_size,), max_new_tokens, device=device)  # (a [B] layout of its own, not a stride-0 view)
        return cls(k, filters, least, max_rows, eos_id_tensor(eos, device), is_eos, pad, logprobs,
                   torch.tensor(dump, dtype=torch.int64, device=device), None if stop is None else tuple(stop.tables),
                   None if stop is None else StopMatcher.counting_from(min_new_tokens, batch_size, device), penalties)


def verification_scores(processed: torch.Tensor, filters: tuple | None) -> torch.Tensor:
    """The target's processed logits [B, k + 1, V] -> what verify_draft weighs: the sampling
    distributions after ``filters`` (temperature, top_k, top_p, min_p), or with None (greedy) the
    logits as they are, whose argmax greedy verification reads (no distribution built)."""
    return processed.float() if filters is None else logits_to_probs(processed, *filters)


def verify_and_crop(scores: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                    uniforms: torch.Tensor | None, active: torch.Tensor, cache) -> tuple:
    """verify_draft for the ``active`` [B] rows (the others emit nothing), then each active row's
    target cache cut to its committed tokens: last + the accepted drafts. -> (tokens [B, k + 1],
    num_emitted [B], num_accepted [B], committed [B]: each row's cache length after the round)."""
    k = draft_tokens.shape[1]
    # softmax outputs and sampled ids: valid by construction, so no value check (a GPU sync)
    tokens, num_emitted = verify_draft(scores, draft_probs, draft_tokens, uniforms, check_values=False)
    num_emitted = torch.where(active, num_emitted, 0)
    num_accepted = (num_emitted - 1).clamp(min=0)
    # (>= 1 by construction: the target wrote k + 1 tokens, so no sync to check it)
    committed = cache.seq_lengths - k + num_accepted
    cache.crop(torch.where(active, committed, cache.seq_lengths), check=False)
    return tokens, num_emitted, num_accepted, committed


def processed_and_verified(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                           uniforms: torch.Tensor | None, active: torch.Tensor, cache, record: TokenRecord,
                           made: torch.Tensor, processing: tuple) -> tuple:
    """A round's target logits [B, k + 1, V] -> verify_and_crop's (tokens, num_emitted,
    num_accepted, committed), after the penalties over ``record`` at each position (the row's text
    and the drafts before it) and the eos held back from a token that would be new token ``made``
    [B] + i of a row short of its min_new_tokens. ``processing``: (the sampling filters as
    sampling_rows gives them, None when greedy; penalty_rows's penalties; min_new_tokens [B] or
    None: no row held back; the eos columns [V], with min_new_tokens)."""
    filters, penalties, least, is_eos = processing
    early = None
    if least is not None:
        early = made[:, None] + torch.arange(draft_tokens.shape[1] + 1, device=made.device)[None, :] < least[:, None]
    processed = process_logits(logits, record.before_each(draft_tokens), penalties[0], is_eos, early, *penalties[1:])
    return verify_and_crop(verification_scores(processed, filters), draft_probs, draft_tokens, uniforms, active, cache)


def settle(tokens: torch.Tensor, num_emitted: torch.Tensor, num_accepted: torch.Tensor, target_logits: torch.Tensor,
           active: torch.Tensor, state: RoundState, rule: RoundRule) -> tuple:
    """The round's outcome into ``state``, in place: each row's emitted tokens up to its first eos
    or the first token that completes a stop pattern (one that counts: from the row's
    min_new_tokens on), its counts, last token, stop automata's state and whether it has finished
    (at an eos, a stop or its limit). -> (slots [B, k + 1]: the output column of each emitted
    token, ``rule.dump`` for the others; values [B, k + 1]: the emitted tokens, the pad id
    elsewhere; their log-probabilities under the target's raw logits (0 elsewhere), None unless
    ``rule.logprobs``; emitted [B, k + 1] bool)."""
    columns = torch.arange(rule.k + 1, device=tokens.device)
    state.proposed.add_(rule.k * active)
    state.accepted.add_(num_accepted)
    last = torch.where(active, tokens.gather(1, (num_emitted - 1).clamp(min=0)[:, None])[:, 0], state.last)
    emitted = columns[None, :] < num_emitted[:, None]
    ends = torch.zeros_like(emitted) if rule.eos_ids is None else torch.isin(tokens, rule.eos_ids) & emitted
    if rule.stop_tables is not None:  # (position i is new token number num_generated + i of its row)
        hits, stop_states = StopMatcher(list(rule.stop_tables)).scan(state.stop_state, tokens)
        made = state.num_generated[:, None] + columns[None, :]
        ends = ends | (hits & (made >= rule.stops_from[:, None]) & emitted)
    ends_before = ends.to(torch.int64).cumsum(dim=1) - ends.to(torch.int64)
    emitted = emitted & (ends_before == 0)  # (a row's tokens after its end are dropped)
    slots = torch.where(emitted, state.num_generated[:, None] + columns[None, :], rule.dump)
    values = torch.where(emitted, tokens, rule.pad)
    chosen = None
    if rule.logprobs:
        chosen = torch.where(emitted, token_logprobs(target_logits, tokens.clamp(min=0)), 0.0)
    count = emitted.sum(dim=1)
    state.num_generated.add_(count)
    state.finished.copy_(state.finished | ends.any(dim=1) | (state.num_generated >= rule.max_new_tokens))
    state.last.copy_(last)
    if rule.stop_tables is not None:
        state.stop_state.copy_(StopMatcher.after(stop_states, state.stop_state, count))
    state.count_remaining(rule.max_new_tokens)
    return slots, values, chosen, emitted


def target_input(last: torch.Tensor, draft_tokens: torch.Tensor, active: torch.Tensor) -> tuple:
    """What the target scores in a round, last [B] + the k drafts [B, k] in one forward (every row
    then verified at once): (tokens [B, k + 1], their attention mask: the ``active`` [B] rows')."""
    B, k = draft_tokens.shape
    return torch.cat([last[:, None], draft_tokens], dim=1), active[:, None].expand(B, k + 1).contiguous()


def _verify_round(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None,
                  active: torch.Tensor, state: RoundState, cache, rule: RoundRule, record: TokenRecord, hidden: bool,
                  model=None) -> tuple:
    """A round after its drafts [B, k]: the target's forward over each row's last token and its
    drafts (``target_input``), the penalties over ``record`` (each position's: the row's text and
    the drafts before it), the eos held back where a row is short of its min_new_tokens,
    verification, the crop, ``settle`` (stop patterns too), and the emitted tokens into ``record``,
    in place. -> (slots, values, log-probabilities or None (settle's), committed [B] and
    num_accepted [B] (what the proposer's commit takes), the target's last hidden states
    [B, k + 1, H] with ``hidden``, else None)."""
    tokens_in, mask = target_input(state.last, draft_tokens, active)
    if hidden:
        target_logits, target_hidden = _forward_with_hidden(tokens_in, mask, cache, model=model)
    else:
        target_logits, target_hidden = _forward(tokens_in, mask, cache, model=model), None
    tokens, num_emitted, num_accepted, committed = processed_and_verified(
        target_logits, draft_tokens, draft_probs, uniforms, active, cache, record, state.num_generated,
        (rule.filters, rule.penalties, rule.min_new_tokens, rule.is_eos))
    slots, values, chosen, emitted = settle(tokens, num_emitted, num_accepted, target_logits, active, state, rule)
    record.add(torch.where(emitted, tokens, target_logits.shape[-1]))  # (nothing without a penalty)
    return slots, values, chosen, committed, num_accepted, target_hidden


def verify_function(model, *, module_guards: bool = False):
    """``model``'s compiled ``(draft_tokens, draft_probs, uniforms, active, state, cache, rule, record,
    hidden) -> (slots, values, log-probabilities or None, committed, num_accepted, last hidden states or
    None)`` (see _verify_round), kept on the model like its steps (``module_guards``: as
    step_function's)."""
    return compiled_function(model, _verify_round, "verify", module_guards=module_guards)
