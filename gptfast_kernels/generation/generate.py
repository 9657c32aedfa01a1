"""``generate``: prefill + decode on a StaticKVCache with the fused kernels (API.md section 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.decode_step import DecodeState, StepRule, advance, decode_function
from gptfast_kernels.generation.end_watch import EndWatch
from gptfast_kernels.generation.forward import cache_for, step_function
from gptfast_kernels.generation.options import check_decode_options
from gptfast_kernels.generation.sampling import TokenRecord
from gptfast_kernels.modules.static_kv_cache import StaticKVCache


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, P + new] int64: the prompts (layout kept) then the new tokens
    # [B, new] float32 with output_logprobs=True: each new token's log-probability under the model's
    # raw distribution (log-softmax of its logits, before any sampling argument); 0 after a row's eos
    logprobs: torch.Tensor | None = None


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, repetition_penalty: float | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, min_new_tokens: int = 0,
             eos_token_id: int | list[int] | None = None, stop_sequences: list[list[int]] | None = None,
             stop_strings: str | list[str] | None = None, tokenizer=None, generator: torch.Generator | None = None,
             past_key_values: StaticKVCache | None = None, compile: bool = False, streamer=None,
             output_logprobs: bool = False) -> GenerateOutput:
    """Decodes up to ``max_new_tokens`` per row from a model patched with ``patch_model``.

    input_ids [B, P]; attention_mask [B, P] (0 = padding, left or right) or None. Rows are
    independent: each row's real tokens sit at cache positions 0.., whatever its padding, so
    greedy decoding matches transformers' ``generate(do_sample=False)``. A row that emits an eos
    token is finished: it gets the pad id from then on (and writes nothing more to the cache);
    decoding stops when every row has finished. ``past_key_values``: an optional StaticKVCache to
    reuse (its rows are emptied first); by default one of the needed size is allocated, its
    sliding-window layers as ring buffers (max_step_tokens = forward.PREFILL_CHUNK). A cache with
    ring buffers takes the prompt in chunks of its max_step_tokens.
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, the three penalties, ``max_new_tokens`` and
    ``min_new_tokens``: each a number for every row, or a list (or 1-D tensor) of one value per
    row, None for off (per-request sampling and limits): each row samples as it would with its own
    values for the whole batch, greedy rows (temperature 0) beside sampled ones, and a row that
    reaches its own ``max_new_tokens`` ends as at an eos (pad ids after it). A sampled row takes,
    each step, the first token whose cumulative probability passes a uniform drawn for it from
    ``generator`` (sampling.sample_by_uniform).
    ``compile``: run each decode step through torch.compile (a CUDA graph on GPUs), the pick of the
    next token included; the model then keeps its compiled step, its cache, its decode state, the
    penalties' record and its stop tables (of a few sizes: stop patterns of similar length share a
    compiled step) for later calls (see generation/forward.py, decode_step.py and stopping.py).
    ``repetition_penalty``: as transformers' (CTRL's): before sampling, the logit of every token
    already in the row (its prompt, padding aside, and what it generated) is divided by it where
    positive and multiplied by it where negative; > 1 discourages repeats.
    ``presence_penalty`` / ``frequency_penalty``: as the OpenAI API's and vLLM's: before sampling,
    each token's logit loses ``frequency_penalty`` times the number of times the row generated it
    (its prompt aside), and ``presence_penalty`` once if it generated it at all; > 0 discourages
    repeats, < 0 encourages them. Applied after the repetition penalty.
    ``min_new_tokens``: no eos before that many new tokens per row (their logits are -inf until
    then), as transformers' ``min_new_tokens``.
    ``stop_sequences``: lists of token ids; a row whose generated tokens come to end with one of
    them is finished as by an eos (the sequence kept, then the pad id), unless that happens before
    ``min_new_tokens`` (see generation/stopping.py). ``stop_strings`` likewise, with the model's
    ``tokenizer`` (as in transformers): a row stops at the token within which the text of its
    generated tokens comes to contain one of them.
    ``streamer``: as in transformers, ``put`` gets the prompt [B, P], then each step's tokens [B]
    (the pad id for finished rows), on the CPU; then ``end()``. Each put waits for the device.
    Returns GenerateOutput(sequences [B, P + n]) with n <= max_new_tokens (the largest); with ``output_logprobs``
    also ``logprobs`` [B, n] (see GenerateOutput).
    """
    op = "generate"
    common.check_model(op, "model", model)
    device, dtype = common.model_device_dtype(model)
    prompt = common.check_prompt(op, input_ids, attention_mask, device, common.input_vocab_size(model))
    (max_new_tokens, most_new, min_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
     frequency_penalty, eos, pad, stop) = check_decode_options(
        op, model, prompt, device, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, eos_token_id=eos_token_id,
        stop_sequences=stop_sequences, stop_strings=stop_strings, tokenizer=tokenizer,
        output_logprobs=output_logprobs, compile=compile, streamer=streamer, generator=generator).unpacked()
    B = prompt.input_ids.shape[0]
    if most_new == 0:
        if streamer is not None:
            streamer.put(prompt.input_ids.cpu())
            streamer.end()
        return GenerateOutput(prompt.input_ids.clone(), prompt.input_ids.new_zeros(B, 0, dtype=torch.float32)
                              if output_logprobs else None)
    needed = max(prompt.lengths) + most_new - 1  # the last token is emitted, never cached
    common.check_positions_fit(op, "model", model, needed, "the longest prompt + max_new_tokens - 1")
    if past_key_values is None:
        cache = cache_for(model, B, needed, device, dtype, reuse=compile)
    else:
        cache = past_key_values
        if not isinstance(cache, StaticKVCache) or cache.batch_size != B or cache.max_cache_len < needed:
            raise ValueError(f"{op}: past_key_values must be a StaticKVCache with batch_size {B} and "
                             f"max_cache_len >= {needed} (longest prompt + max_new_tokens - 1)")
        cache.crop(torch.zeros_like(cache.seq_lengths), check=False)  # stale slots are never read
    if streamer is not None:
        streamer.put(prompt.input_ids.cpu())

    logits = common.prefill(model, prompt, cache)
    record = TokenRecord.start(prompt.input_ids, prompt.attention_mask, logits.shape[-1], repetition_penalty,
                               presence_penalty, frequency_penalty)
    rule = StepRule.build(B, device, logits.shape[-1], max_new_tokens, min_new_tokens, temperature, top_k, top_p,
                          min_p, repetition_penalty, presence_penalty, frequency_penalty, eos, pad, output_logprobs,
                          stop)
    state = DecodeState.start(model, B, device, max_new_tokens, reuse=compile,
                              stop_automata=0 if stop is None else len(stop.tables))
    # Compiled, the step picks its token in the call too (the penalties' record, which each step
    # writes, kept static on the model): one call a step, and nothing else launched but the sampled
    # rows' uniforms.
    if compile:
        record = record.kept_on(model)
    decode_call = decode_function(model) if compile else None
    forward_step = step_function(model, compile) if decode_call is None else None
    # whether rows may end before most_new steps (an eos, a stop or a per-row limit); without that no
    # step asks whether all have, and the output keeps every step's column
    ends_early = bool(eos) or stop is not None or isinstance(max_new_tokens, torch.Tensor)
    # Asked after each step; on a GPU a step late (EndWatch), so that the host queues the next step
    # while the last runs (unless a streamer waits for each step anyway): a step run past the end
    # (every row finished, nothing written) is cut off below.
    watch = EndWatch(state.remaining, 1, lagged=streamer is None and EndWatch.lags_on(device)) if ends_early else None
    new_tokens, logprobs = [], []
    for step in range(most_new):
        if watch is not None and not watch.another():
            break
        if rule.sampled:
            state.uniforms.uniform_(generator=generator)
        if not step:
            logprob = advance(logits, state, rule, record)
        elif decode_call is not None:
            logprob = decode_call(state, cache, rule, record)
        else:  # (finished rows are padding from now on: nothing written, their lengths stay put)
            logits = forward_step(state.tokens[:, None], ~state.finished[:, None], cache)[:, -1]
            logprob = advance(logits, state, rule, record)
        # (copies: the state is the next step's, and a compiled call's outputs live until the next call)
        tokens = state.tokens.clone()
        new_tokens.append(tokens)
        if output_logprobs:
            logprobs.append(logprob.clone())
        if streamer is not None:
            streamer.put(tokens.cpu())
        if watch is not None:
            watch.queued()
    if streamer is not None:
        streamer.end()
    generated = torch.stack(new_tokens, dim=1)
    # as transformers: up to the last row's eos (or stop, or limit)
    new = int(state.lengths.max()) if ends_early else generated.shape[1]
    return GenerateOutput(torch.cat([prompt.input_ids, generated[:, :new]], dim=1),
                          torch.stack(logprobs, dim=1)[:, :new] if output_logprobs else None)
