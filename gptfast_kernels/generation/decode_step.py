"""``generate``'s decode step: a forward over each row's last token, then its next token picked and
the rows' state advanced, in one compiled call when nothing outside it has to run between them.

The per-row state lives in buffers that each step updates in place (DecodeState). Compiled, they
are kept with the model between calls, like its cache, at fixed addresses: a CUDA graph reads and
writes them where they are, so a step launches its graph and a copy of the new tokens (and,
sampled, one draw of uniforms), where picking outside the graph took an argmax or a softmax and a
multinomial, and the bookkeeping (the pad id for finished rows, the lengths, the eos test, the stop
automata's gathers) a handful of small kernels, each a launch on a GPU and a dispatch on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gptfast_kernels.generation.end_watch import count_remaining
from gptfast_kernels.generation.forward import _forward, compiled_function
from gptfast_kernels.generation.sampling import (TokenRecord, eos_columns, eos_id_tensor, holds_eos_back,
                                                 kept_on_model, penalty_rows, pick_at, process_logits, sampling_rows,
                                                 token_logprobs)
from gptfast_kernels.generation.stopping import StopMatcher

STATE_ATTRIBUTE = "_gptfast_decode_state"  # where a compiling model keeps its DecodeStates (a dict)


@dataclass
class DecodeState:
    """Each row's state between decode steps, updated in place by ``advance``."""
    tokens: torch.Tensor    # [B] int64: the row's last token (the pad id once it has finished)
    finished: torch.Tensor  # [B] bool
    lengths: torch.Tensor   # [B] int64: new tokens up to the row's end (eos, stop or limit)
    uniforms: torch.Tensor  # [B] float64: the step's draw, at which a sampled row picks (sample_by_uniform)
    stop_state: torch.Tensor  # [B, M] int64: the row's state in the M stop automata (StopMatcher's; M = 0: none)
    # 0-d int64, which generate's EndWatch reads: the most new tokens an unfinished row may still emit
    # (0: every row has finished; end_watch.UNBOUNDED without per-row limits: the loop's one limit holds)
    remaining: torch.Tensor

    @classmethod
    def start(cls, model, batch_size: int, device: torch.device, max_new_tokens, *, reuse: bool,
              stop_automata: int = 0) -> "DecodeState":
        """The state before the first new token (a row whose ``max_new_tokens`` is 0 finished;
        ``stop_automata``: the stop matcher's automata, 0 without one). With ``reuse`` (compiled
        steps) ``model`` keeps it and hands it out again for the same batch size, device and
        automata (one state each: calls in turn find theirs), its buffers marked static: compiled
        graphs are specialised on them."""
        def zeros(dtype, *more):
            return torch.zeros((batch_size, *more), dtype=dtype, device=device)

        def make():
            return cls(zeros(torch.int64), zeros(torch.bool), zeros(torch.int64), zeros(torch.float64),
                       zeros(torch.int64, stop_automata), torch.zeros((), dtype=torch.int64, device=device))

        state = (kept_on_model(model, STATE_ATTRIBUTE, (batch_size, torch.device(device), stop_automata), make,
                               DecodeState.buffers) if reuse else make())
        state.tokens.zero_()
        state.lengths.zero_()
        state.stop_state.zero_()
        state.finished.copy_(state.lengths >= max_new_tokens)
        state.count_remaining(max_new_tokens if isinstance(max_new_tokens, torch.Tensor) else None)
        return state

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.finished, self.lengths, self.uniforms, self.stop_state, self.remaining

    def count_remaining(self, max_new_tokens: torch.Tensor | None) -> None:
        """``remaining`` from the rows' ends, lengths and limits (``max_new_tokens`` [B] or None)."""
        count_remaining(self.remaining, self.finished, self.lengths, max_new_tokens)


class StepRule(NamedTuple):
    """How a step picks and when a row ends, as ``advance`` reads it; tensors wherever a value may
    change between calls, so that a compiled step is not compiled anew for each value."""
    sampled: bool                          # False: every row takes its argmax
    filters: tuple                         # sampled: sampling_rows's (temperature, top_k, top_p, min_p)
    penalties: tuple                       # (repetition, presence, frequency), as process_logits reads them
    min_new_tokens: torch.Tensor | None    # [B]: no eos before that many new tokens; None: no row held back
    max_new_tokens: torch.Tensor | None    # [B] per-row limits; None: one limit, the loop's
    eos_ids: torch.Tensor | None           # [n] int64; None: no eos
    is_eos: torch.Tensor | None            # [V] bool, the eos columns (only while a row may be held back)
    pad: int
    logprobs: bool                         # advance returns each token's log-probability
    stop_tables: tuple | None = None       # StopMatcher's tables; None: no stop pattern
    stops_from: torch.Tensor | None = None  # [B]: a stop pattern counts from that many new tokens on

    @classmethod
    def build(cls, batch_size: int, device: torch.device, vocab_size: int, max_new_tokens, min_new_tokens,
              temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
              eos: list[int], pad: int, logprobs: bool, stop: StopMatcher | None = None) -> "StepRule":
        """From check_decode_options's values (numbers, or per-row [B] tensors); ``stop``: its
        stop matcher."""
        sampled = isinstance(temperature, torch.Tensor) or temperature != 0
        filters = sampling_rows(temperature, top_k, top_p, min_p, batch_size, device) if sampled else ()
        eos_ids = eos_id_tensor(eos, device)
        held = eos_ids is not None and holds_eos_back(min_new_tokens)
        if held and not isinstance(min_new_tokens, torch.Tensor):  # (one [B] layout either way: no recompile)
            min_new_tokens = torch.full((batch_size,), min_new_tokens, device=device)
        limits = max_new_tokens if isinstance(max_new_tokens, torch.Tensor) else None
        stops_from = None if stop is None else StopMatcher.counting_from(min_new_tokens, batch_size, device)
        penalties = penalty_rows(repetition_penalty, presence_penalty, frequency_penalty, batch_size, device)
        return cls(sampled, filters, penalties,
                   min_new_tokens if held else None, limits, eos_ids,
                   eos_columns(eos_ids, vocab_size) if held else None, pad, logprobs,
                   None if stop is None else tuple(stop.tables), stops_from)


def advance(logits: torch.Tensor, state: DecodeState, rule: StepRule, record: TokenRecord) -> torch.Tensor | None:
    """[B, V] logits of each row's next token -> the rows' state one token on, in place: the penalties
    over ``record`` (which takes the tokens) and the eos held back from rows short of their
    min_new_tokens, then the argmax or a sample at ``state.uniforms``; a finished row gets the pad
    id; a row ends at an eos, at a token that completes a stop pattern (from its min_new_tokens
    on) or at its own limit. Returns the tokens' log-probabilities under the raw logits (0 for
    finished rows) when ``rule.logprobs``, else None."""
    finished = state.finished
    # (a row that has not finished has made as many tokens as there were steps)
    early = None if rule.min_new_tokens is None else state.lengths < rule.min_new_tokens
    processed = process_logits(logits, record, rule.penalties[0], rule.is_eos, early, *rule.penalties[1:])
    tokens = pick_at(processed, state.uniforms if rule.sampled else None, *rule.filters)
    record.add(tokens[:, None])  # (a finished row's record no longer matters: it emits the pad id)
    logprob = torch.where(finished, 0.0, token_logprobs(logits, tokens)) if rule.logprobs else None
    tokens = torch.where(finished, rule.pad, tokens)
    ended = finished
    if rule.eos_ids is not None:
        ended = ended | torch.isin(tokens, rule.eos_ids)
    if rule.stop_tables is not None:  # (lengths: this token's new token number, in rows not finished)
        hits, stop_states = StopMatcher(list(rule.stop_tables)).scan(state.stop_state, tokens[:, None])
        ended = ended | (hits[:, 0] & (state.lengths >= rule.stops_from))
        state.stop_state.copy_(stop_states[:, 0])
    state.lengths += ~finished
    if rule.max_new_tokens is not None:
        ended = ended | (state.lengths >= rule.max_new_tokens)
    state.tokens.copy_(tokens)
    state.finished.copy_(ended)
    state.count_remaining(rule.max_new_tokens)
    return logprob


def _decode_step(state: DecodeState, cache, rule: StepRule, record: TokenRecord, model=None) -> torch.Tensor | None:
    """One forward over each row's last token (finished rows as padding: nothing written), then
    ``advance``."""
    logits = _forward(state.tokens[:, None], ~state.finished[:, None], cache, model=model)[:, -1]
    return advance(logits, state, rule, record)


def decode_function(model, *, module_guards: bool = False):
    """``model``'s compiled ``(state, cache, rule, record) -> log-probabilities or None`` (see
    _decode_step), kept on the model like its other steps (``module_guards``: as step_function's)."""
    return compiled_function(model, _decode_step, "decode", module_guards=module_guards)
