"""verify_draft against the Hugging Face way (transformers' per-row `_speculative_sampling`, and
per-row argmax matching for greedy, as assisted generation runs them) and against the batched
pure-PyTorch reference.

GB/s counts the probability bytes the op actually needs for the drawn inputs: 2 * accepted token
probabilities plus the stop row (target, and draft when a draft was rejected) for sampling; rows
0..stop for greedy. "ours_auto_checked" is the eager wrapper, whose value checks read every
probability; "ours_kernel" is the op alone, as under torch.compile or CUDA graphs. Drafts are
sampled from a draft model close to the target, so acceptance lengths vary as in real use.
"""

from __future__ import annotations

import inspect

import torch
from transformers.generation.utils import _speculative_sampling

from gptfast_kernels import ops
from gptfast_kernels.ops import reference

FULL_CASES = [(B, k, V) for V in (32000, 128256) for k in (4, 8) for B in (1, 16, 64)]
CPU_QUICK_CASES = [(1, 4, 32000), (16, 4, 32000)]
ISSUE_CPU_CASE = (32, 4, 32000)    # target: >= 20x the HF per-row loop
ISSUE_CUDA_CASE = (64, 5, 128256)  # target: >= 10x the HF loop, >= 70% of copy bandwidth
DRAFT_NOISE = 1.0  # logit noise between target and draft (higher: fewer accepted tokens)


def make_inputs(B, k, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = 3 * torch.randn(B, k + 1, V, generator=g, device=device)
    target = logits.softmax(-1)
    draft_logits = logits[:, :k] + DRAFT_NOISE * torch.randn(B, k, V, generator=g, device=device)
    draft = draft_logits.softmax(-1)
    tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, k)
    greedy_tokens = target[:, :k].argmax(-1)
    greedy_tokens = torch.where(torch.rand(B, k, generator=g, device=device) < 0.3,
                                tokens, greedy_tokens)  # some mismatches
    uniforms = torch.rand(B, k + 1, generator=g, device=device)
    return target, draft, tokens, greedy_tokens, uniforms, target.log(), draft.log()


# transformers releases up to about 5.17 take an is_done_candidate flag (whether the draft ended
# the sequence) after the target logits; later ones dropped it
_HF_EXTRA = ({"is_done_candidate": False}
             if "is_done_candidate" in inspect.signature(_speculative_sampling).parameters else {})


def hf_sampling_loop(draft_tokens, draft_logits, target_logits):
    """The per-row HF call: each row is its own assisted-generation step (batch size 1)."""
    k = draft_tokens.shape[1]
    return [_speculative_sampling(draft_tokens[b:b + 1], draft_logits[b:b + 1], k,
                                  target_logits[b:b + 1], **_HF_EXTRA) for b in range(draft_tokens.shape[0])]


def hf_greedy_loop(draft_tokens, target_logits):
    """HF assisted generation's greedy check, row by row (utils.py, case 2 of step 3)."""
    out = []
    for b in range(draft_tokens.shape[0]):
        selected = target_logits[b:b + 1].argmax(dim=-1)
        n_matches = ((~(draft_tokens[b:b + 1] == selected[:, :-1])).cumsum(dim=-1) < 1).sum()
        out.append(selected[:, : n_matches + 1])
    return out


def needed_bytes(num_emitted, k, V, greedy):
    accepted = num_emitted - 1
    if greedy:
        return int(num_emitted.sum()) * V * 4
    rejected = (accepted < k).to(torch.int64)
    return int((accepted * 2 * 4 + V * 4 * (1 + rejected)).sum())


def run(h) -> None:
    device = h.device
    h.measure_copy_bandwidth()
    if device.type == "cuda":
        cases = FULL_CASES + [ISSUE_CUDA_CASE]
    else:
        cases = (CPU_QUICK_CASES if h.quick else FULL_CASES) + [ISSUE_CPU_CASE]
    for B, k, V in cases:
        target, draft, tokens, greedy_tokens, uniforms, t_logits, d_logits = make_inputs(B, k, V, device)
        for mode in ("sampling", "greedy"):
            greedy = mode == "greedy"
            dp = None if greedy else draft
            toks = greedy_tokens if greedy else tokens
            _, num_emitted = reference.verify_draft(target, dp, toks, uniforms)
            candidates = {
                "hf_per_row_loop": (lambda: hf_greedy_loop(toks, t_logits)) if greedy else
                                   (lambda: hf_sampling_loop(toks, d_logits, t_logits)),
                "torch_batched_reference": lambda: reference.verify_draft(target, dp, toks, uniforms),
                # the eager wrapper validates every probability (a full read, host syncs)
                "ours_auto_checked": lambda: ops.verify_draft(target, dp, toks, uniforms),
                # the kernel alone, as it runs under torch.compile / CUDA graphs
                "ours_kernel": lambda: torch.ops.gptfast_kernels.verify_draft(target, dp, toks,
                                                                              uniforms),
            }
            if device.type == "cuda":
                from gptfast_kernels.triton.verify_draft import verify_draft_triton

                candidates["ours_triton_kernel"] = lambda: verify_draft_triton(target, dp, toks,
                                                                               uniforms)
            case = {"B": B, "k": k, "V": V, "mode": mode,
                    "mean_emitted": round(float(num_emitted.float().mean()), 2),
                    "issue_target": (B, k, V) in (ISSUE_CPU_CASE, ISSUE_CUDA_CASE)}
            h.compare("verify_draft", case, candidates, baseline="hf_per_row_loop",
                      nbytes=needed_bytes(num_emitted.cpu(), k, V, greedy),
                      graphed=("ours_kernel", "ours_triton_kernel"))
