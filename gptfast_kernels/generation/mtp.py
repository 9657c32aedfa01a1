"""Drafting with a model's own multi-token-prediction (MTP) layer, batched.

DeepSeek-V3, GLM-4.5 / 4.6, Sarvam and Mellum checkpoints carry an extra decoder layer trained to
predict the token after next: at position j it takes the model's last hidden state there (the
final norm's output) and the embedding of token j + 1, and its output goes through the model's
own output head. transformers builds it as ``MtpModel`` (``MtpModel.from_pretrained(model)``
loads it from the model's checkpoint) and drafts with it one row at a time
(``generate(use_mtp=True)``). Passed to ``speculative_generate`` as the draft model, it drafts
for every row of a batch here, in an MtpProposer:

- It keeps a StaticKVCache of its own: slot j holds the keys and values of pair j (the target's
  hidden state at j, token j + 1), at rotary position j + 1, as transformers places them. After the
  target's prefill it takes the prompt's pairs but the last, whose next token is the first one
  the target emits.
- A round's first drafter forward takes the pairs the target's last forward made certain (the
  last emitted token's and those of the drafts accepted before it: 1 to k + 1 per row, padded)
  and drafts the first token from its last one. Drafts 2 .. k reuse the layer on its own output
  state and the draft before, as vLLM does when k exceeds the layers (transformers drafts one
  token per layer, so for k = 1 the two agree).
- After verification the drafter's cache keeps the pairs made from the target's hidden states
  alone: those the round's draft steps wrote (from the drafter's own states) are cropped, and the
  target's states at the accepted positions come in with the next round.

Everything stays on the device. Compiled, a round's k drafts are one call (CUDA graphs), as a
draft model's are (its forwards and the picks between them).
"""

from __future__ import annotations

import functools

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.forward import cache_for, compiled_function, picked_drafts
from gptfast_kernels.models.families import family_of


def is_mtp_model(module) -> bool:
    """Whether ``module`` is transformers' MtpModel (a model's multi-token-prediction layers)."""
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:  # (transformers before MtpModel)
        return False
    return isinstance(module, MtpModel)


def check_mtp(op: str, model, mtp) -> None:
    """ValueError unless ``mtp`` (an MtpModel) can draft for ``model`` here."""
    common.check_model(op, "draft_model", mtp)
    layers = len(mtp.layers)
    if layers != 1:
        raise ValueError(f"{op}: draft_model is an MtpModel with {layers} MTP layers; drafting with a single MTP "
                         "layer is supported (DeepSeek-V3, GLM-4.5, Sarvam and Mellum checkpoints have one)")
    kinds = family_of(mtp.config).layer_kinds(mtp.config)
    if kinds[0] != "attention":
        raise ValueError(f"{op}: draft_model's MTP layer is a {kinds[0]!r} layer; MTP drafting takes an attention "
                         "layer (a recurrent one could not roll its state back)")
    target = model.config.get_text_config(decoder=True)
    for name in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(mtp.config, name), getattr(target, name)
        if ours != theirs:
            raise ValueError(f"{op}: draft_model (an MtpModel) has {name} {ours} but model has {theirs}; build it "
                             "from this model (MtpModel.from_pretrained(model))")
    common.check_same_device(op, model, mtp)
    (_, dtype), (_, mtp_dtype) = common.model_device_dtype(model), common.model_device_dtype(mtp)
    if mtp_dtype != dtype:  # (it takes the target's hidden states as they are)
        raise ValueError(f"{op}: draft_model (an MtpModel) is {mtp_dtype} but model is {dtype}; the MTP layer reads "
                         f"model's hidden states: give both one dtype (draft_model.to({dtype}))")


def _mtp_forward(ids: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, cache, keep: torch.Tensor,
                 mtp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer on pairs (``hidden`` [B, T, H]: the states they continue, ``ids`` [B, T]: the
    tokens after them) into ``cache`` at each row's next slots (``mask`` False: padding) -> (its
    output state [B, H] at column ``keep`` [B] of each row, the logits there [B, V])."""
    positions = cache.plan_step(ids.shape[1], mask, hide_length=mtp._gptfast_fused_length_zero)
    try:
        embeds = mtp.embed_tokens(ids)
        rotary_positions = positions.clamp(min=0) + 1  # (pair j predicts token j + 2 from token j + 1)
        rotary = None
        if mtp.rotary_emb is not None:
            options = {"layer_type": mtp.config.layer_types[0]} if getattr(mtp, "has_per_layer_rope", False) else {}
            rotary = mtp.rotary_emb(embeds, position_ids=rotary_positions, **options)
        # (the cache goes positionally: transformers named it past_key_values before 5.24, cache since)
        out = mtp.layers[0](embeds, hidden, rotary, None, rotary_positions, cache, gptfast_cache=cache)
        if mtp.use_shared_post_norm:
            out = mtp.shared_post_norm(out)
        if not torch.compiler.is_compiling() and cache.attention_calls != cache.attention_modules:
            raise RuntimeError("speculative_generate: the MTP layer's attention did not receive the StaticKVCache "
                               "(its transformers version or family is unsupported)")
    except BaseException:
        cache.discard_step()
        raise
    cache.commit_step()
    kept = common.at_columns(out, keep)
    return kept, mtp._project_to_logits(kept[:, None])[:, 0]


def _mtp_drafts(tokens: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, cache, keep: torch.Tensor,
                first: torch.Tensor, active: torch.Tensor, k: int, sampling: tuple | None, processing,
                mtp=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A round's k drafts per row in one call: the MTP layer over the round's pending pairs
    (``tokens``, ``hidden``, ``mask``; ``keep`` [B]: the column of each row's last), then k - 1
    times over its own output state and the draft before (``first`` [B]: zeros; ``active`` [B]:
    the rows drafted), each draft picked as forward.picked_drafts picks (``sampling``,
    ``processing``) -> (drafts [B, k], their distributions [B, k, V] or None when greedy)."""
    state, logits = _mtp_forward(tokens, hidden, mask, cache, keep, mtp=mtp)

    def advance(token):
        nonlocal state
        state, next_logits = _mtp_forward(token[:, None], state[:, None], active[:, None], cache, first, mtp=mtp)
        return next_logits

    return picked_drafts(logits, advance, k, sampling, processing)


def mtp_step_function(mtp, compile: bool):
    """_mtp_forward on ``mtp``, eager or compiled (as generation.forward.step_function)."""
    if not compile:
        return functools.partial(_mtp_forward, mtp=mtp)
    return compiled_function(mtp, _mtp_forward, "mtp_forward")


class MtpProposer:
    """Proposals from an MtpModel (see the module docstring). Between rounds it holds each row's
    pending pairs, those the drafter has not taken in yet: ``count`` [B] of them, the target's
    hidden states ``hidden`` [B, k + 1, H] and the tokens after them ``tokens`` [B, k + 1] (the last
    one, the token the target emitted last, arrives with the round)."""

    takes_target_hidden = True

    def __init__(self, mtp, batch_size: int, capacity: int, compile: bool, k: int):
        device, dtype = common.model_device_dtype(mtp)
        self.mtp = mtp
        # a round writes up to k + 1 pairs (its first forward) and k - 1 drafts, and crops back to before them
        self.cache = cache_for(mtp, batch_size, capacity, device, dtype, reuse=compile, step_tokens=k + 1,
                               role="draft")
        self.step = mtp_step_function(mtp, compile)
        self.drafts = compiled_function(mtp, _mtp_drafts, "mtp_drafts") if compile else None  # (a round's drafts)
        self.prefill_step = mtp_step_function(mtp, False)  # (prompt lengths vary: eager, as a model's prefill)
        self.tokens = torch.zeros(batch_size, k + 1, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(batch_size, k + 1, mtp.config.hidden_size, dtype=dtype, device=device)
        self.count = torch.ones(batch_size, dtype=torch.int64, device=device)
        self.columns = torch.arange(k + 1, device=device)
        self.first = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def prefill(self, prompt: common.Prompt, target_hidden: torch.Tensor | None = None) -> None:
        """The prompt's pairs, but each row's last (pending: its next token is not known yet)."""
        order = common.left_order(prompt.attention_mask)  # (each row's tokens end in the last column)
        ids, real = prompt.input_ids.gather(1, order), prompt.attention_mask.gather(1, order)
        hidden = target_hidden.gather(1, order[..., None].expand_as(target_hidden))
        paired = real & real.roll(-1, dims=1)
        paired[:, -1] = False
        pairs = common.Prompt(ids.roll(-1, dims=1), paired, prompt.lengths)
        for start, stop in common.prompt_chunks(pairs, self.cache):
            self.prefill_step(pairs.input_ids[:, start:stop], hidden[:, start:stop],
                              pairs.attention_mask[:, start:stop], self.cache, self.first)
        self.hidden[:, 0] = hidden[:, -1]
        self.count.fill_(1)

    def propose(self, rounds, last, active, history) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft tokens [B, k], and their distributions [B, k, V] (None when greedy)."""
        self.tokens.scatter_(1, (self.count - 1)[:, None], last[:, None])
        mask = (self.columns[None, :] < self.count[:, None]) & active[:, None]
        if self.drafts is not None:
            drafts, distributions = self.drafts(self.tokens, self.hidden, mask, self.cache, self.count - 1, self.first,
                                                active, rounds.k, rounds.draft_sampling(last),
                                                rounds.draft_processing(history))
            # (a CUDA graph's outputs, which the target's next call may write over: as DraftModelProposer's)
            return drafts.clone(), None if distributions is None else distributions.clone()
        state, logits = self.step(self.tokens, self.hidden, mask, self.cache, self.count - 1)

        def advance(token):
            nonlocal state
            # (state is the last call's output, which on a GPU the next compiled call may write over,
            # CUDA graphs' outputs living until then: the call takes a copy)
            state, next_logits = self.step(token[:, None], state[:, None].clone(), active[:, None], self.cache,
                                           self.first)
            return next_logits

        return rounds.draft(history, logits, advance)

    def commit(self, active, committed, num_accepted, draft_tokens, target_hidden=None) -> None:
        """The round's outcome: the drafter's cache goes back to the pairs before the round's last
        token (the target's length before the round), and the target's states at the positions it
        kept (last + accepted drafts) become the pending pairs, with the accepted drafts after them."""
        self.cache.crop(torch.where(active, committed - num_accepted - 1, self.cache.seq_lengths), check=False)
        k = draft_tokens.shape[1]
        self.tokens[:, :k].copy_(torch.where(active[:, None], draft_tokens, self.tokens[:, :k]))
        self.hidden.copy_(torch.where(active[:, None, None], target_hidden, self.hidden))
        self.count.copy_(torch.where(active, num_accepted + 1, self.count))
