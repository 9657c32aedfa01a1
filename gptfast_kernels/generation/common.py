"""Input checks and small helpers shared by generate and speculative_generate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptfast_kernels.models.patch import forward_with_cache, is_patched
from gptfast_kernels.ops._dispatch import check_tensor


@dataclass
class Prompt:
    """A validated batch of prompts: input_ids [B, P] int64, attention_mask [B, P] bool and each row's
    number of real tokens (host ints: read once, before generation starts)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: list[int]

    @property
    def ends_aligned(self) -> bool:
        """Every row's last real token is in the last column (left padding or none)."""
        return bool(self.attention_mask[:, -1].all())


def check_model(op: str, name: str, model) -> None:
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"{op}: {name} must be a transformers causal LM, got {type(model).__name__}")
    if not is_patched(model):
        raise ValueError(f"{op}: {name} is not patched; call gptfast_kernels.patch_model({name}) first")
    _, dtype = model_device_dtype(model)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{op}: {name} is {dtype}; the kernels and caches take float16, bfloat16 or float32 "
                         f"({name}.to(torch.float32))")
    if name == "model":
        from gptfast_kernels.generation.assistant import is_gemma4_assistant
        from gptfast_kernels.generation.mtp import is_mtp_model

        if is_mtp_model(model) or is_gemma4_assistant(model):
            raise ValueError(f"{op}: model is {type(model).__name__}, a draft that reads another model's hidden "
                             "states or cache; pass it as speculative_generate's draft_model, beside that model")


def check_rollback(op: str, name: str, model) -> None:
    """ValueError unless every layer of ``model`` can roll back rejected tokens (speculative decoding):
    keys and values always can; a hybrid's recurrent states can where its recurrent blocks step
    token by token (models/recurrent.py)."""
    blocker = getattr(model, "_gptfast_rollback_blocker", None)
    if blocker is not None:
        raise ValueError(f"{op}: {name} ({model.config.model_type}) is a hybrid model whose recurrent states cannot "
                         f"roll back the tokens a speculative round rejects: {blocker}; decode it with generate")


def check_prompt(op: str, input_ids, attention_mask, device: torch.device, vocab_size: int) -> Prompt:
    check_tensor(op, "input_ids", input_ids, dtypes=(torch.int64, torch.int32), ndim=2)
    B, P = input_ids.shape
    if B == 0 or P == 0:
        raise ValueError(f"{op}: input_ids must hold at least one prompt of at least one token, "
                         f"got shape {list(input_ids.shape)}")
    if input_ids.device != device:
        raise ValueError(f"{op}: input_ids is on {input_ids.device} but the model is on {device}")
    check_token_range(op, "input_ids", input_ids, vocab_size)
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        check_tensor(op, "attention_mask", attention_mask, ndim=2)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"{op}: attention_mask must have input_ids' shape {list(input_ids.shape)}, "
                             f"got {list(attention_mask.shape)}")
        if attention_mask.device != device:
            raise ValueError(f"{op}: attention_mask is on {attention_mask.device} but the model is on {device}")
        if attention_mask.is_complex():
            raise ValueError(f"{op}: attention_mask must hold real 0s and 1s (1 = token, 0 = padding), "
                             f"got {attention_mask.dtype}")
        # (floats too, as transformers takes them, as long as each is exactly 0 or 1)
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(f"{op}: attention_mask must hold only 0 and 1 (1 = token, 0 = padding)")
        mask = attention_mask != 0
    lengths = mask.sum(dim=1).tolist()
    if min(lengths) == 0:
        raise ValueError(f"{op}: every row of attention_mask needs at least one real token (row "
                         f"{lengths.index(0)} is all padding)")
    return Prompt(input_ids.to(torch.int64), mask, lengths)


def check_token_range(op: str, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size): an id outside the embedding table would be a
    device-side assert on CUDA."""
    low, high = (int(x) for x in torch.aminmax(ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{op}: {name} must be token ids in [0, {vocab_size}) (the model's embedding "
                         f"table, padding included), got values from {low} to {high}")


def resolve_special_tokens(op: str, model, eos_token_id) -> tuple[list[int], int]:
    """(eos ids, pad id). eos_token_id None means the model's generation_config's, as in
    transformers; ids >= 0 (an id past the vocabulary is never emitted, so never ends a row). The pad
    id, which finished rows get and feed the model, is the model's pad token where the model embeds
    it, else the first eos id it embeds, else 0."""
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        eos = []
    elif isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
        eos = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple)) and all(isinstance(e, int) and not isinstance(e, bool)
                                                         for e in eos_token_id):
        eos = list(eos_token_id)
    else:
        raise ValueError(f"{op}: eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")
    if any(e < 0 for e in eos):
        raise ValueError(f"{op}: eos_token_id must hold token ids >= 0, got {eos_token_id!r}")
    vocab = input_vocab_size(model)
    pad = getattr(config, "pad_token_id", None)
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < vocab:
        pad = next((e for e in eos if e < vocab), 0)
    return eos, int(pad)


def output_vocab_size(model) -> int:
    """Entries in the model's logits: the output head's width, else the config's vocab_size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else int(model.config.get_text_config(decoder=True).vocab_size)


def input_vocab_size(model) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def position_table(model) -> tuple[int, str] | None:
    """(how many positions ``model`` has room for, the config attribute saying so) where its family
    has a fixed position table (Family.position_table: GPT-2's learned position embeddings ...), else
    None (no bound)."""
    from gptfast_kernels.models.families import family_of

    attr = family_of(model.config).position_table
    return None if attr is None else (int(getattr(model.config.get_text_config(decoder=True), attr)), attr)


def check_positions_fit(op: str, name: str, model, needed: int, what: str) -> None:
    """ValueError unless ``model`` has room for ``needed`` positions: a token past a fixed position
    table would fail inside the embedding (a device-side assert on CUDA) mid-generation."""
    table = position_table(model)
    if table is not None and needed > table[0]:
        raise ValueError(f"{op}: {what}: {needed} positions, more than {name}'s position table holds "
                         f"({table[0]}: {model.config.model_type}'s config.{table[1]})")


DEFAULT_MAX_LENGTH = 2048  # the batchers' max_length where a model's position table allows it


def default_max_length(models, extra_slots: int) -> int:
    """A batcher's max_length when none is given: DEFAULT_MAX_LENGTH, or what the smallest position
    table among ``models`` leaves past the ``extra_slots`` a row takes beyond it (at least 1)."""
    limits = [table[0] - extra_slots for model in models if (table := position_table(model)) is not None]
    return max(1, min([DEFAULT_MAX_LENGTH, *limits]))


def check_same_device(op: str, model, draft_model) -> None:
    """ValueError unless ``draft_model`` runs on ``model``'s device."""
    device, _ = model_device_dtype(model)
    draft_device, _ = model_device_dtype(draft_model)
    if draft_device != device:
        raise ValueError(f"{op}: draft_model is on {draft_device} but model is on {device}")


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    """Where the model runs and its activation dtype (its first floating-point parameter / buffer)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    raise ValueError("the model has no floating-point weights")


def last_columns(mask: torch.Tensor) -> torch.Tensor:
    """[B, P] padding mask (0 = padding) -> [B] int64, the column of each row's last real token."""
    return mask.shape[1] - 1 - (mask != 0).flip(1).to(torch.int64).argmax(dim=1)


def at_columns(states: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """states [B, T, H] -> [B, H]: row b's entry at column ``columns[b]``."""
    return states.gather(1, columns.view(-1, 1, 1).expand(-1, 1, states.shape[-1]))[:, 0]


def left_order(mask: torch.Tensor) -> torch.Tensor:
    """[B, P] column order that moves each row's padding (``mask`` False) before its real tokens,
    which keep their order."""
    return torch.argsort(mask.to(torch.int8), dim=1, stable=True)


def left_aligned(prompt: Prompt) -> Prompt:
    """The same rows with their padding moved before their real tokens (which keep their order):
    what a hybrid model's recurrent layers take (padding after a real token would enter the state).
    Each row's tokens keep their positions (a row's first real token is at 0 either way)."""
    return _reordered(prompt, left_order(prompt.attention_mask))


def _reordered(prompt: Prompt, order: torch.Tensor) -> Prompt:
    return Prompt(prompt.input_ids.gather(1, order), prompt.attention_mask.gather(1, order), prompt.lengths)


def prefill(model, prompt: Prompt, cache, *, hidden: bool = False):
    """Runs the prompt through ``model`` into ``cache`` -> [B, V] logits at each row's last real token.
    Only those positions reach the output head: the last column when every row ends there (left
    padding), else the few distinct columns where rows end (one host sync), never [B, P, V] (a
    32k-token prompt's full logits would take 16 GB at a 128k vocabulary). A cache with ring-buffer
    layers takes the prompt in chunks of its max_step_tokens. A hybrid model's prompt goes in
    left-aligned, however it was padded. ``hidden``: -> (logits, the last hidden states [B, P, H] at
    every column of ``prompt``, as a multi-token-prediction drafter takes them)."""
    order = None
    if cache.has_recurrent_layers:
        order = left_order(prompt.attention_mask)
        prompt = _reordered(prompt, order)
    aligned = prompt.ends_aligned
    last = None if aligned else last_columns(prompt.attention_mask).tolist()
    out, states = None, []
    for start, stop in prompt_chunks(prompt, cache):
        if not aligned:
            rows = [b for b, c in enumerate(last) if start <= c < stop]  # the rows ending in this chunk
            columns = sorted({last[b] for b in rows})
        keep = 1 if aligned or not columns else torch.tensor([c - start for c in columns],
                                                             device=prompt.input_ids.device)
        logits, chunk_hidden = _prefill_chunk(model, prompt, cache, start, stop, keep, hidden)
        states.append(chunk_hidden)
        if aligned:
            out = logits[:, 0]
            continue
        if not rows:
            continue
        if out is None:
            out = logits.new_empty(len(last), logits.shape[-1])
        index = torch.tensor(rows, device=logits.device)
        out[index] = logits[index, torch.tensor([columns.index(last[b]) for b in rows], device=logits.device)]
    if not hidden:
        return out
    states = torch.cat(states, dim=1)
    if order is not None:  # back to the prompt's own columns
        states = torch.empty_like(states).scatter_(1, order[..., None].expand_as(states), states)
    return out, states


def fill_cache(model, prompt: Prompt, cache) -> None:
    """Runs the prompt through ``model`` into ``cache`` for its keys and values alone (a draft
    model's prefill), in chunks as ``prefill``."""
    if cache.has_recurrent_layers:
        prompt = left_aligned(prompt)
    for start, stop in prompt_chunks(prompt, cache):
        _prefill_chunk(model, prompt, cache, start, stop, 1)


def prompt_chunks(prompt: Prompt, cache):
    """(start, stop) column ranges of the prompt, one forward each: the whole prompt, or chunks of
    max_step_tokens for a cache with ring-buffer layers."""
    P = prompt.input_ids.shape[1]
    chunk = cache.max_step_tokens if cache.has_ring_layers else P
    return [(start, min(start + chunk, P)) for start in range(0, P, chunk)]


def _prefill_chunk(model, prompt: Prompt, cache, start: int, stop: int, keep, hidden: bool = False):
    """The prompt's columns start..stop - 1 through the model (its mask up to there, as transformers
    takes a mask of past + new tokens) -> logits at the ``keep`` columns; with ``hidden``, (logits,
    the last hidden states of every column [B, stop - start, H]), else (logits, None)."""
    out = forward_with_cache(model, prompt.input_ids[:, start:stop], cache,
                             attention_mask=prompt.attention_mask[:, :stop], logits_to_keep=keep,
                             output_hidden_states=hidden)
    return out.logits, out.hidden_states[-1] if hidden else None


def check_flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{op}: {name} must be True or False, got {value!r}")


def check_generator(op: str, generator, device: torch.device) -> None:
    """None, or a torch.Generator on ``device``'s type (the model's), from which the sampled rows draw."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{op}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"{op}: generator must be on the model's device type ({device.type}), got a "
                         f"{generator.device.type} generator")


def check_streamer(op: str, streamer) -> None:
    """A transformers-style streamer (``put(tokens)``, ``end()``), or None."""
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise TypeError(f"{op}: streamer must have put(tokens) and end() methods (a transformers "
                        f"BaseStreamer such as TextStreamer), got {type(streamer).__name__}")
