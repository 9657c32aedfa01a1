"""Logits -> token distributions (the repetition, presence and frequency penalties, min-new-tokens,
temperature, top-k, top-p, min-p) and the checks every generator shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def check_sampling_args(op: str, temperature, top_k, top_p, min_p=None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"{op}: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{op}: top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"{op}: top_p must be None or a number in (0, 1], got {top_p!r}")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, (int, float))
                              or not 0 <= min_p <= 1):
        raise ValueError(f"{op}: min_p must be None or a number in [0, 1], got {min_p!r}")


def check_penalties(op: str, repetition, presence, frequency) -> None:
    """The repetition penalty (None or > 0) and the presence / frequency penalties (any finite number)."""
    if repetition is not None and (isinstance(repetition, bool) or not isinstance(repetition, (int, float))
                                   or not math.isfinite(repetition) or repetition <= 0):
        raise ValueError(f"{op}: repetition_penalty must be None or a finite number > 0 (1 = none), "
                         f"got {repetition!r}")
    for name, penalty in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError(f"{op}: {name} must be a finite number (0 = none), got {penalty!r}")


def seen_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids [B, P] and their mask -> [B, vocab_size] bool: which tokens each row's real (not
    padding) tokens hold (ids past the output vocabulary, which no logit scores, are left out)."""
    seen = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    real = (attention_mask != 0) & (input_ids < vocab_size)
    seen.scatter_(1, torch.where(real, input_ids, vocab_size), True)  # the rest into a dump column
    return seen[:, :vocab_size]


@dataclass
class TokenRecord:
    """What the penalties read of each row's text, per row ([B, V + 1]) or per row and position of a
    speculative round ([B, k + 1, V + 1]): ``seen`` bool, the tokens of its prompt and of what it
    generated (the repetition penalty), ``counts`` int32, how often it generated each token (the
    presence / frequency penalties); each None while its penalty is off. Column V absorbs masked
    writes (a token V is recorded nowhere that a logit reads)."""
    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    @classmethod
    def start(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int,
              repetition_penalty: float | None, presence_penalty: float, frequency_penalty: float) -> "TokenRecord":
        """The record after the prompt input_ids [B, P] (mask: 0 = padding), nothing generated,
        keeping what the penalties in use read (a repetition penalty of None or 1 and presence /
        frequency penalties of 0 are off)."""
        seen = repetition_penalty is not None and repetition_penalty != 1
        prompt = seen_tokens(input_ids, attention_mask, vocab_size) if seen else None
        return cls(None if prompt is None else torch.nn.functional.pad(prompt, (0, 1)),
                   input_ids.new_zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.int32)
                   if presence_penalty or frequency_penalty else None)

    def map(self, fn) -> "TokenRecord":
        """A record of ``fn`` applied to each tensor kept."""
        return TokenRecord(*(None if t is None else fn(t) for t in (self.seen, self.counts)))

    def add(self, tokens: torch.Tensor) -> None:
        """Records generated tokens [..., T] (ids in [0, V]), in place (through views too)."""
        if self.seen is not None:
            self.seen.scatter_(-1, tokens, True)
        if self.counts is not None:
            self.counts.scatter_add_(-1, tokens, torch.ones_like(tokens, dtype=torch.int32))

    def before_each(self, drafts: torch.Tensor) -> "TokenRecord":
        """drafts [B, k] -> the record at each of the k + 1 positions of a round: position i has the
        drafts before it, 0 .. i - 1, recorded too."""
        B, k = drafts.shape
        record = self.map(lambda t: t[:, None].repeat(1, k + 1, 1))
        for i in range(k):  # draft i is before positions i + 1 ..
            record.map(lambda t: t[:, i + 1:]).add(drafts[:, i, None, None].expand(B, k - i, 1))  # noqa: B023
        return record


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """[B, V] logits -> the same with each ``seen`` token's logit divided by ``penalty`` where it is
    positive and multiplied by it where negative (CTRL's repetition penalty, as transformers'
    ``repetition_penalty``: > 1 makes repeats less likely)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def eos_columns(eos_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """eos ids [n] -> [vocab_size] bool, True at each eos id (ids past the vocabulary left out;
    built by a scatter, without the host sync a boolean index would cost)."""
    is_eos = torch.zeros(vocab_size + 1, dtype=torch.bool, device=eos_ids.device)
    return is_eos.scatter_(0, eos_ids.clamp(max=vocab_size), True)[:vocab_size]


def apply_additive_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """[..., V] logits -> the same minus ``frequency`` times each token's count in ``counts`` [..., V]
    (how often the row generated it) and minus ``presence`` for every token generated at all (the
    OpenAI API's and vLLM's presence / frequency penalties: > 0 makes repeats less likely)."""
    counts = counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, record: TokenRecord, penalty: float | None, is_eos: torch.Tensor | None,
                   early: torch.Tensor | None, presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """[..., V] logits before sampling: the repetition penalty over ``record.seen`` (None: none),
    the presence and frequency penalties over ``record.counts`` (None: none), then the eos columns
    ``is_eos`` [V] at -inf where ``early`` [...] holds (transformers' ``min_new_tokens``: no eos
    before that many new tokens; None: nowhere); vLLM's order."""
    V = logits.shape[-1]
    if record.seen is not None:
        logits = apply_repetition_penalty(logits, record.seen[..., :V], penalty)
    if record.counts is not None:
        logits = apply_additive_penalties(logits, record.counts[..., :V], presence, frequency)
    if early is not None:
        logits = logits.masked_fill(early[..., None] & is_eos, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[..., V] logits, [...] tokens -> [...] float32: each token's log-probability under the logits."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                    top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p (nucleus:
    the smallest set of most likely tokens whose mass reaches top_p, at least one) and min-p (the
    tokens at least min_p times as likely as the most likely one), in transformers' order.
    temperature 0 gives a one-hot distribution on the argmax."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        drop_sorted = mass_before >= top_p                        # never drops the first token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if min_p:  # relative to the most likely token, which every filter keeps: renormalising cannot move it
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] probabilities -> [B] int64 sampled tokens."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_tokens(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                min_p: float | None, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens: argmax when temperature is 0, else a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_from(logits_to_probs(logits, temperature, top_k, top_p, min_p), generator)
