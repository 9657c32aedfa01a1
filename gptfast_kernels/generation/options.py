"""The decoding options every generator takes, checked once for all of them."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.sampling import check_new_token_counts, check_penalties, check_sampling_args
from gptfast_kernels.generation.stopping import StopMatcher, check_stop_sequences, check_stop_strings


@dataclass
class DecodeOptions:
    """Checked options: each per-row one a number for every row or a [B] tensor (see sampling.py)."""
    max_new_tokens: int | torch.Tensor
    most_new_tokens: int  # the largest max_new_tokens
    min_new_tokens: int | torch.Tensor
    temperature: float | torch.Tensor
    top_k: int | torch.Tensor | None
    top_p: float | torch.Tensor | None
    min_p: float | torch.Tensor | None
    repetition_penalty: float | torch.Tensor | None
    presence_penalty: float | torch.Tensor
    frequency_penalty: float | torch.Tensor
    eos: list[int]
    pad: int
    stop: StopMatcher | None  # the stop sequences and strings, or None

    def unpacked(self) -> tuple:
        """The fields in order (the tensors themselves, not copies)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def check_decode_options(op: str, model, prompt: common.Prompt, device: torch.device, *, max_new_tokens,
                         min_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                         frequency_penalty, eos_token_id, stop_sequences, stop_strings, tokenizer, output_logprobs,
                         compile, streamer, generator) -> DecodeOptions:
    """Checks what generate and the speculative generators share; each bad value is a ValueError (or
    TypeError) naming its argument."""
    batch = prompt.input_ids.shape[0]
    counts = check_new_token_counts(op, max_new_tokens, min_new_tokens, batch, device)
    sampling = check_sampling_args(op, temperature, top_k, top_p, min_p, batch, device)
    penalties = check_penalties(op, repetition_penalty, presence_penalty, frequency_penalty, batch, device)
    common.check_flag(op, "output_logprobs", output_logprobs)
    common.check_flag(op, "compile", compile)
    eos, pad = common.resolve_special_tokens(op, model, eos_token_id)
    vocab = common.output_vocab_size(model)
    stop = StopMatcher.build(check_stop_sequences(op, stop_sequences, vocab),
                             check_stop_strings(op, stop_strings, tokenizer), tokenizer, vocab, device)
    if compile and stop is not None:  # (tables of a few sizes, kept where compiled steps read them)
        stop = stop.kept_on(model)
    common.check_streamer(op, streamer)
    common.check_generator(op, generator, device)
    return DecodeOptions(*counts, *sampling, *penalties, eos, pad, stop)
