"""Batched draft-token verification for speculative decoding (API.md section 1)."""

from __future__ import annotations

import torch

from gptfast_kernels import _extension
from gptfast_kernels.ops import reference
from gptfast_kernels.ops._dispatch import (check_same_device, check_tensor, resolve_backend,
                                           tracing_or_dispatch_mode)

OP = "verify_draft"
# Sampling walks a row's float32 running sum (inverse CDF), which must not overflow: rows summing to
# less than this (float32's largest is just under 2^128) never do, whatever the order of the sum.
MAX_ROW_SUM = 2.0**127


def check_inputs(target_probs, draft_probs, draft_tokens, uniforms, op: str = OP) -> None:
    check_tensor(op, "target_probs", target_probs, dtypes=(torch.float32,), ndim=3)
    B, k_plus_1, V = target_probs.shape
    if k_plus_1 < 1 or V < 1:
        raise ValueError(f"{op}: target_probs must be [B, k + 1, V] with k >= 0 and V >= 1, "
                         f"got {list(target_probs.shape)}")
    k = k_plus_1 - 1
    check_tensor(op, "draft_tokens", draft_tokens, dtypes=(torch.int64,), ndim=2)
    if tuple(draft_tokens.shape) != (B, k):
        raise ValueError(f"{op}: draft_tokens must have shape [B, k] = [{B}, {k}], "
                         f"got {list(draft_tokens.shape)}")
    if draft_probs is not None:
        check_tensor(op, "draft_probs", draft_probs, dtypes=(torch.float32,), ndim=3)
        if tuple(draft_probs.shape) != (B, k, V):
            raise ValueError(f"{op}: draft_probs must have shape [B, k, V] = [{B}, {k}, {V}], "
                             f"got {list(draft_probs.shape)}")
    if uniforms is not None:
        check_tensor(op, "uniforms", uniforms, dtypes=(torch.float32,), ndim=2)
        if tuple(uniforms.shape) != (B, k + 1):
            raise ValueError(f"{op}: uniforms must have shape [B, k + 1] = [{B}, {k + 1}], "
                             f"got {list(uniforms.shape)}")
    check_same_device(op, target_probs=target_probs, draft_probs=draft_probs,
                      draft_tokens=draft_tokens, uniforms=uniforms)


def _check_values(target_probs, draft_probs, draft_tokens, uniforms) -> None:
    """Value checks that need the data; skipped while tracing. One fused min/max pass per tensor
    (NaN propagates through min/max, so it fails the range tests) and a single host sync."""
    V = target_probs.shape[-1]
    checks = {}  # argument name -> 0-d bool tensor, True when valid
    if draft_tokens.numel():
        lo, hi = torch.aminmax(draft_tokens)
        checks["draft_tokens"] = (lo >= 0) & (hi < V)
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is not None and probs.numel():
            lows, highs = torch.aminmax(probs, dim=-1)  # per row: the target's need a positive entry each
            lo, hi = lows.amin(), highs.amax()
            checks[name] = (lo >= 0) & (hi < float("inf"))
            if name == "target_probs":  # (a draft row of zeros is well defined: its tokens are all rejected)
                checks["target_probs_rows"] = highs.amin() > 0
            if name == "target_probs" and draft_probs is not None:  # sampling: a bound on every row's sum
                checks["target_probs_sum"] = hi * V < MAX_ROW_SUM
    if uniforms is not None and uniforms.numel():
        lo, hi = torch.aminmax(uniforms)
        checks["uniforms"] = (lo >= 0) & (hi < 1)
    if not checks:
        return
    valid = torch.stack(list(checks.values())).tolist()
    messages = {
        "draft_tokens": f"draft_tokens must be token ids in [0, V) = [0, {V})",
        "target_probs": "target_probs must be finite and non-negative (no NaN, inf or negative "
                        "probabilities)",
        "draft_probs": "draft_probs must be finite and non-negative (no NaN, inf or negative "
                       "probabilities)",
        "uniforms": "uniforms must lie in [0, 1) (no NaN)",
        "target_probs_rows": "target_probs must have a positive probability in every row (a row of zeros "
                             "is no distribution to pick from)",
    }
    for name, ok in zip(checks, valid):
        if name == "target_probs_sum" and not ok:  # the bound failed: the rows' sums themselves
            largest = target_probs.sum(dim=-1, dtype=torch.float64).max().item()
            if largest >= MAX_ROW_SUM:
                raise ValueError(f"{OP}: target_probs' rows must each sum to less than 2^127 for sampling (the "
                                 f"kernels' float32 running sums would overflow), got a row summing to {largest:.3g}")
        elif not ok:
            raise ValueError(f"{OP}: {messages[name]}")


def verify_draft(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 draft_tokens: torch.Tensor, uniforms: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, *,
                 backend: str = "auto", check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts or rejects k draft tokens per row and emits one more token per row.

    target_probs [B, k+1, V] float32; draft_probs [B, k, V] float32 or None (greedy); draft_tokens
    [B, k] int64; uniforms [B, k+1] float32 in [0, 1) or None (drawn from ``generator``; greedy
    verification reads none, so none are drawn) -> (tokens [B, k+1] int64: accepted drafts, the
    emitted token, then -1; num_emitted [B] int64). Rows of probabilities need not sum to 1 (they
    are used as weights). k = 0 is allowed: plain sampling (or argmax) from target_probs[:, 0]. In
    eager mode the values are checked (one fused min/max pass per tensor and one host sync); under
    torch.compile / CUDA-graph capture they are skipped; an out-of-range draft token then raises in
    the CPU kernel and counts as rejected in the CUDA / Triton kernels (never read).
    ``check_values=False`` skips them in eager mode too, for callers whose inputs are valid by
    construction (speculative_generate: softmax outputs and sampled ids), since the check reads
    every probability again and waits for the GPU once per call.
    """
    check_inputs(target_probs, draft_probs, draft_tokens, uniforms)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{OP}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if check_values and not tracing_or_dispatch_mode():
        _check_values(target_probs, draft_probs, draft_tokens, uniforms)
    B, k_plus_1, _ = target_probs.shape
    if uniforms is None and draft_probs is None:  # greedy reads no uniforms: a placeholder, nothing drawn
        uniforms = torch.empty((B, k_plus_1), device=target_probs.device, dtype=torch.float32)
    elif uniforms is None:
        uniforms = torch.rand((B, k_plus_1), generator=generator, device=target_probs.device,
                              dtype=torch.float32)
    chosen = resolve_backend(OP, backend, target_probs.device)
    if chosen == "reference":
        return reference.verify_draft(target_probs, draft_probs, draft_tokens, uniforms)
    args = (target_probs.contiguous(), None if draft_probs is None else draft_probs.contiguous(),
            draft_tokens.contiguous(), uniforms.contiguous())
    if chosen == "triton":  # (checked above; see tracing_or_dispatch_mode)
        from gptfast_kernels.triton.verify_draft import verify_draft_triton, verify_draft_unchecked

        return (verify_draft_triton if tracing_or_dispatch_mode() else verify_draft_unchecked)(*args)
    return torch.ops.gptfast_kernels.verify_draft(*args)


def verify_draft_fake(target_probs, draft_probs, draft_tokens, uniforms):
    """The fake (meta) implementation of the C++ and Triton verify_draft ops; also their Meta
    kernel, so a call with one argument on meta and the rest elsewhere raises rather than answers."""
    check_same_device(OP, target_probs=target_probs, draft_probs=draft_probs, draft_tokens=draft_tokens,
                      uniforms=uniforms)
    B, k_plus_1, _ = target_probs.shape
    return (target_probs.new_empty((B, k_plus_1), dtype=torch.int64),
            target_probs.new_empty((B,), dtype=torch.int64))


if _extension.has_kernel(OP, "CPU"):
    torch.library.register_fake(f"gptfast_kernels::{OP}")(verify_draft_fake)
