"""Prompt-lookup decoding: speculative decoding whose proposals come from the text itself, with no
draft model. Each row looks for the latest earlier occurrence of its last n tokens (n from
``max_ngram_size`` down to 1) in its prompt and what it has generated, and proposes the k tokens
that followed it. Input-grounded generation (summaries, edits of code or text, answers quoting a
document) repeats long spans, which the target then accepts several tokens per forward.

The proposals are one-hot "distributions", so verification is exact as for any draft: greedy
output equals the target's own greedy decoding, and sampling follows the target's distribution.
Every step runs on the device, batched over rows, with no host synchronisation.
"""

from __future__ import annotations

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.speculative import History, SpeculativeOutput, SpeculativeRounds
from gptfast_kernels.ops._dispatch import check_int


@torch.no_grad()
def prompt_lookup_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                           max_new_tokens: int, speculate_k: int = 4, max_ngram_size: int = 3,
                           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                           min_p: float | None = None, repetition_penalty: float | None = None,
                           presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_new_tokens: int = 0,
                           eos_token_id: int | list[int] | None = None, stop_sequences: list[list[int]] | None = None,
                           stop_strings: str | list[str] | None = None, tokenizer=None,
                           generator: torch.Generator | None = None, compile: bool = False, streamer=None,
                           output_logprobs: bool = False) -> SpeculativeOutput:
    """input_ids [B, P] (attention_mask [B, P], 0 = padding, left or right) -> SpeculativeOutput,
    as ``speculative_generate`` but with proposals looked up in each row's own tokens (n-grams of
    up to ``max_ngram_size`` tokens). ``model`` must be patched (patch_model); ``streamer``, the
    repetition, presence and frequency penalties, ``min_new_tokens``, ``stop_sequences``,
    ``stop_strings`` (with ``tokenizer``) and ``output_logprobs`` as there (one prompt for a streamer)."""
    op = "prompt_lookup_generate"
    check_int(op, "max_ngram_size", max_ngram_size, 1)
    rounds = SpeculativeRounds.checked(op, model, input_ids, attention_mask, max_new_tokens, speculate_k,
                                       temperature, top_k, top_p, min_p, eos_token_id, generator, compile,
                                       common.input_vocab_size(model), streamer, repetition_penalty, min_new_tokens,
                                       output_logprobs, presence_penalty, frequency_penalty, stop_sequences,
                                       stop_strings, tokenizer)
    vocab = common.output_vocab_size(model)
    return rounds.run(lambda capacity, target_cache: PromptLookupProposer(max_ngram_size, vocab))


class PromptLookupProposer:
    """Proposals from each row's own tokens (see the module docstring); keeps only the prompt."""

    def __init__(self, max_ngram_size: int, vocab_size: int):
        self.max_ngram_size, self.vocab_size = max_ngram_size, vocab_size
        self.prompt: common.Prompt | None = None

    def prefill(self, prompt: common.Prompt) -> None:
        self.prompt = prompt

    def propose(self, rounds: SpeculativeRounds, last, active, history: History):
        """-> draft tokens [B, k], and their one-hot distributions [B, k, V] (None when greedy)."""
        generated = history.generated
        made = torch.arange(generated.shape[1], device=generated.device)[None, :] < history.num_generated[:, None]
        tokens, lengths = _pack_left(torch.cat([self.prompt.input_ids, generated], dim=1),
                                     torch.cat([self.prompt.attention_mask, made], dim=1))
        drafts = emittable(lookup_continuations(tokens, lengths, rounds.k, self.max_ngram_size), self.vocab_size)
        if rounds.greedy:
            return drafts, None
        return drafts, torch.nn.functional.one_hot(drafts, self.vocab_size).float()

    def commit(self, active, committed, num_accepted, draft_tokens, target_hidden=None) -> None:
        return None


def emittable(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``drafts`` with every id the model cannot emit replaced by 0: a prompt may hold ids past the
    output vocabulary (Apertus 1.5's head is narrower than its embeddings), and a row without text
    gets -1. Verification takes the 0 like any draft: rejected, or accepted where the target picks it."""
    return drafts.where((drafts >= 0) & (drafts < vocab_size), 0)


def _pack_left(tokens: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L], keep [B, L] bool -> each row's kept tokens in order from the left ([B, L], -1
    after them), and their counts [B]: a row's text without its padding."""
    B, L = tokens.shape
    columns = torch.where(keep, keep.cumsum(dim=1) - 1, L)  # dropped tokens go to a dump column
    packed = torch.full((B, L + 1), -1, dtype=torch.int64, device=tokens.device)
    packed.scatter_(1, columns, tokens)
    return packed[:, :L], keep.sum(dim=1)


def lookup_continuations(tokens: torch.Tensor, lengths: torch.Tensor, k: int, max_ngram_size: int) -> torch.Tensor:
    """tokens [B, L] int64 (row b's first lengths[b] entries are its text, the rest -1) -> [B, k]:
    the k tokens that followed the latest earlier occurrence of the row's last n tokens, for the
    largest n <= max_ngram_size that occurs. A continuation that reaches the end of the text goes on
    copying what it has proposed (as an overlapping LZ77 copy does), so a text that cycles is
    proposed cycling. Where nothing matches, the row's last token fills in (any proposal is valid;
    a wrong one is only rejected)."""
    B, L = tokens.shape
    device = tokens.device
    start = torch.full((B,), -1, dtype=torch.int64, device=device)  # where the continuation begins
    for n in range(min(max_ngram_size, L - 1), 0, -1):
        tail_columns = (lengths[:, None] - n + torch.arange(n, device=device)[None, :]).clamp(min=0)
        tail = tokens.gather(1, tail_columns)                                   # [B, n]
        windows = tokens.unfold(1, n, 1)                                        # [B, L - n + 1, n]
        offsets = torch.arange(windows.shape[1], device=device)[None, :]
        # an earlier window (its continuation starts inside the text), equal to the tail; windows
        # over the -1 padding never equal a tail of real tokens
        match = (windows == tail[:, None, :]).all(dim=2) & (offsets + n < lengths[:, None]) \
            & (lengths[:, None] > n)
        latest = torch.where(match, offsets, -1).amax(dim=1)
        start = torch.where((start < 0) & (latest >= 0), latest + n, start)
    found = start >= 0
    # the continuation's i-th token: text[start + i], or past the end the proposal d = length - start
    # before it, i.e. text[start + i mod d]
    period = torch.where(found, lengths - start, 1)
    offsets = torch.arange(k, device=device)[None, :] % period[:, None]
    columns = torch.where(found, start, lengths - 1)[:, None] + offsets
    return tokens.gather(1, columns)
