"""Plain-PyTorch reference implementations: the ground truth for tests and benchmarks, and the
``backend="reference"`` path of every op. Written for clarity, not speed; they accept the same
(already validated) inputs as the kernels and compute in float32, or float64 for float64 inputs.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight [N, K] int8, scales [N] float32), symmetric per output channel."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    qweight = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return qweight, scales


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantised qweight [N, K]^T * scales [N] + bias [N] -> [..., N] in x's dtype."""
    acc = _compute_dtype(x.dtype)
    y = (x.to(acc) @ qweight.to(acc).T) * scales.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def int8_expert_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       experts: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row p of x [P, K] times expert experts[p]'s dequantised qweight [E, N, K]^T * scales [E, N],
    plus bias[experts[p]] (bias [E, N] or None) -> [P, N] in x's dtype; a row whose expert is
    outside [0, E) (-1: padding) is zero."""
    acc = _compute_dtype(x.dtype)
    E = qweight.shape[0]
    valid = (experts >= 0) & (experts < E)
    index = experts.clamp(0, E - 1)
    y = torch.einsum("pk,pnk->pn", x.to(acc), qweight[index].to(acc)) * scales[index].to(acc)
    if bias is not None:
        y = y + bias[index].to(acc)
    return torch.where(valid[:, None], y, torch.zeros((), dtype=acc, device=y.device)).to(x.dtype)


def broadcast_positions(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """[T] or [B, T] positions -> [B, T] int64."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(batch, -1)
    return positions.to(torch.int64)


def kv_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, positions: torch.Tensor, scale: float | None = None,
                       window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None, ring: bool = False,
                       value_dim: int | None = None, chunk_size: int | None = None,
                       alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Writes k/v [B, Hkv, T, D] into the caches [B, Hkv, S, D] at positions [B, T] (or [T]),
    in place, then returns the causal attention of q [B, Hq, T, D] over cache slots 0..position
    (with a ``window``: only the last ``window`` of them, position - window < slot <= position;
    with ``chunk_size`` C: only those of the query's chunk, position - position % C <= slot).
    ``ring``: the caches are ring buffers, position p lives in slot p % S (a query then sees, in
    each slot, the latest position <= its own that maps there).
    ``softcap``: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
    ``sinks`` [Hq]: one more logit per head in the softmax's denominator, with no value (GPT-OSS).
    ``alibi_slopes`` [Hq]: ALiBi (BLOOM, MPT, Falcon-RW): head h's score of a slot holding position s
    for a query at position p gains alibi_slopes[h] * (s - p), after the soft cap.
    Negative positions are padding: nothing is written and their output rows are zero.
    ``value_dim`` Dv: the values are the keys' first Dv numbers (v, v_cache unused; out [B, Hq, T, Dv])."""
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    pos = broadcast_positions(positions, B)
    valid = pos >= 0

    rows, cols = valid.nonzero(as_tuple=True)
    slots = pos[rows, cols] % S if ring else pos[rows, cols]
    k_cache[rows, :, slots] = k[rows, :, cols]
    if value_dim:
        v_cache, Dv = k_cache[..., :value_dim], value_dim
    else:
        v_cache[rows, :, slots] = v[rows, :, cols]
        Dv = D

    acc = _compute_dtype(q.dtype)
    qg = q.to(acc).reshape(B, Hkv, group, T, D)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k_cache.to(acc)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    cache_slots = torch.arange(S, device=q.device)[None, None, :]
    query_pos = pos[:, :, None]
    # [B, T, S]: the position each slot holds for each query
    slot_pos = query_pos - (query_pos - cache_slots) % S if ring else cache_slots
    allowed = (slot_pos <= query_pos) & (slot_pos >= 0)
    if window:
        allowed &= slot_pos > query_pos - window
    if chunk_size:
        allowed &= slot_pos >= query_pos - query_pos % chunk_size
    if alibi_slopes is not None:
        distance = (slot_pos - query_pos).to(acc)  # [B, T, S], <= 0 where allowed
        scores = scores + alibi_slopes.to(acc).reshape(1, Hkv, group, 1, 1) * distance[:, None, None]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).reshape(1, Hkv, group, 1, 1).expand(B, Hkv, group, T, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows are all -inf
    if sinks is not None:
        probs = probs[..., :S]
    # slots no query of the row sees (past the fill of a torch.empty cache, before every window)
    # may hold garbage, NaN included: their zero probabilities must not meet it
    values = v_cache.to(acc).masked_fill(~allowed.any(dim=1)[:, None, :, None], 0.0)
    out = torch.einsum("bhgts,bhsd->bhgtd", probs, values).reshape(B, Hq, T, Dv)
    out = out * valid[:, None, :, None]
    return out.to(q.dtype)


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [..., V] >= 0 (unnormalised), uniforms [...] in [0, 1) -> index [...] int64: the
    smallest j whose running sum exceeds u * total. When rounding leaves no such j (u * total at
    or past the last partial sum), the last index with non-zero weight."""
    cdf = weights.cumsum(dim=-1)
    threshold = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    index = (cdf <= threshold).sum(dim=-1)
    last_nonzero = weights.shape[-1] - 1 - (weights.flip(-1) > 0).to(torch.int64).argmax(dim=-1)
    return torch.minimum(index, last_nonzero)


def verify_draft(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 draft_tokens: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-decoding verification of B rows at once (API.md, verify_draft).

    target_probs [B, k+1, V], draft_probs [B, k, V] or None (greedy), draft_tokens [B, k] int64,
    uniforms [B, k+1] -> (tokens [B, k+1] int64, accepted tokens then the emitted one then -1;
    num_emitted [B] int64 = accepted + 1).
    """
    B, k_plus_1, V = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    rows = torch.arange(B, device=device)
    if draft_probs is None:
        target_argmax = target_probs.argmax(dim=-1)  # first index on ties
        accept = draft_tokens == target_argmax[:, :k]
    else:
        p = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        q = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        accept = (q > 0) & (uniforms[:, :k] * q < p)
    num_accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]

    stop_target = target_probs[rows, num_accepted]  # [B, V]
    if draft_probs is None:
        final = stop_target.argmax(dim=-1)
    else:
        stop_draft = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k > 0 else \
            torch.zeros_like(stop_target)
        residual = (stop_target - stop_draft).clamp(min=0)
        rejected = num_accepted < k
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        weights = torch.where(use_residual[:, None], residual, stop_target)
        final = sample_inverse_cdf(weights, uniforms[:, k])

    columns = torch.arange(k_plus_1, device=device)[None, :]
    padded_draft = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(columns < num_accepted[:, None], padded_draft,
                         torch.full_like(padded_draft, -1))
    tokens = torch.where(columns == num_accepted[:, None], final[:, None], tokens)
    return tokens, num_accepted + 1
