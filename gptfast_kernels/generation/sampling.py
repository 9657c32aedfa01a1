"""Logits -> token distributions (temperature, top-k, top-p, min-p) and the checks every generator shares."""

from __future__ import annotations

import math

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
