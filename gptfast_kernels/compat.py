"""GPTFast's API (MDK8888/GPTFast 0.1) on top of gptfast_kernels, so that its users can switch by
changing an import::

    from gptfast_kernels.compat import gpt_fast            # was: from GPTFast.Core import gpt_fast

    def argmax(self, probabilities):
        return torch.argmax(probabilities, dim=-1).view(1, 1)

    model = gpt_fast("gpt2-xl", draft_model_name="gpt2", sample_function=argmax)
    tokens = model.generate(cur_tokens=input_ids, max_tokens=50, speculate_k=6)

What is kept from GPTFast: the names, the arguments and their meaning — model names are local
paths or hub names loaded with ``from_pretrained``; ``max_tokens`` (and ``generate_text_fast``'s
``max_length``) counts the prompt too: the returned sequence is that long; ``sample_function(self, probabilities,
**sampling_kwargs)`` is bound to the returned model, gets a token distribution and returns one
token id; ``generate`` does not stop at end-of-sequence tokens.

What differs, and why:
- Any batch size (GPTFast: 1). ``generate`` takes an optional keyword ``attention_mask`` for
  left- or right-padded batches, and returns exactly ``max_tokens`` columns (GPTFast could
  overshoot by up to ``speculate_k``). ``max_tokens`` not above the prompt length is a
  ValueError (GPTFast then still added one token).
- Verification is exact. With ``sample_function`` a draft token is accepted when it equals the
  token ``sample_function`` picks from the target's distribution at that position, and the first
  token it does not equal is replaced by that pick; the output is therefore what decoding the
  target alone with ``sample_function`` gives (token for token for a deterministic function such
  as argmax, in distribution for a random one). ``sample_function`` is called once per position
  the target scores (up to ``speculate_k + 1`` per round and row, some of them discarded), on
  ``probabilities``: [V] float32, the softmax of the target's logits. GPTFast instead ran a
  ratio test against the draft's softmax, which could reject the target's own argmax.
- Without ``sample_function``, ``**sampling_kwargs`` are ours: ``temperature`` (default 0:
  greedy), ``top_k``, ``top_p``, ``min_p``, ``generator`` (speculative sampling, exact target distribution),
  ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_new_tokens``, and
  ``eos_token_id``, ``stop_sequences`` and ``stop_strings`` with ``tokenizer`` (rows stop there
  and are padded; default: no stop, as in GPTFast), as ``gptfast_kernels.generate`` takes them.
- int8 is our weight-only ``Int8Linear`` (GPTFast used bitsandbytes), applied to the draft as
  well (it only changes how fast drafts come, never the output); ``int8=False`` turns it off.
  Nothing is torch.compile'd: the fused kernels give the speed-up eagerly.
- ``gpt_fast`` accepts GPTFast's ``max_length`` and ``cache_config`` keywords and does not need
  them: caches are sized per call, and the supported model families are patched without a
  description of their source.
- ``generate_text_fast`` (the text helper that wraps GPTFast in the Predacons package) stops at
  the model's end-of-sequence token and returns prompt + continuation, without printing.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import torch
from torch import nn

from gptfast_kernels.generation.common import (Prompt, check_positions_fit, check_prompt, check_token_range,
                                               input_vocab_size, model_device_dtype, output_vocab_size, prefill,
                                               resolve_special_tokens)
from gptfast_kernels.generation.generate import generate as _generate
from gptfast_kernels.generation.speculative import SpeculativeOutput, speculative_generate
from gptfast_kernels.models.patch import is_patched, patch_model
from gptfast_kernels.models.serialization import is_saved_patched, load_patched
from gptfast_kernels.modules.static_kv_cache import StaticKVCache
from gptfast_kernels.ops._dispatch import check_int

__all__ = ["KVCacheModel", "GPTFastModel", "gpt_fast", "load_int8", "add_kv_cache",
           "add_speculative_decode_kv_cache", "generate_text_fast"]

_OUR_SAMPLING_KWARGS = ("temperature", "top_k", "top_p", "min_p", "generator", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "min_new_tokens", "eos_token_id", "stop_sequences",
                        "stop_strings", "tokenizer")
_INITIAL_CACHE_SLOTS = 256  # KVCacheModel's first allocation beyond the prompt; it doubles when full


# -- loading ---------------------------------------------------------------------------------------

def _check_name(op: str, arg: str, name) -> str:
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise TypeError(f"{op}: {arg} must be a model path or hub name (a non-empty str), "
                        f"got {type(name).__name__}")
    return os.fspath(name)


def _default_device(device) -> torch.device:
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def _load(op: str, arg: str, name, *, device=None, dtype=None, trust_remote_code: bool = False) -> nn.Module:
    """``name`` loaded with from_pretrained, or, where it is a directory ``save_patched`` wrote, with
    ``load_patched``: patched as it was saved, its int8 weights read as they are."""
    from transformers import AutoModelForCausalLM

    name = _check_name(op, arg, name)
    if is_saved_patched(name):  # (in ``dtype`` where given: its float tensors converted as they are read)
        return load_patched(name, device=_default_device(device), dtype=dtype, trust_remote_code=trust_remote_code)
    kwargs = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    return model.to(_default_device(device)).eval()


def load_int8(model_name, *, device=None, dtype=None, trust_remote_code: bool = False) -> nn.Module:
    """Loads a causal LM (``from_pretrained``) with int8 weight-only Linear layers (Int8Linear,
    lm_head included, as patch_model does) and the fused static-cache attention. The result is still an ordinary
    transformers model: ``model(...)`` and ``model.generate(...)`` work as before. A directory that
    ``save_patched`` wrote loads as it was saved, its int8 weights straight onto the device."""
    model = _load("load_int8", "model_name", model_name, device=device, dtype=dtype,
                  trust_remote_code=trust_remote_code)
    return model if is_patched(model) else patch_model(model, int8=True, fused_attention=True)


# -- KVCacheModel ----------------------------------------------------------------------------------

class KVCacheModel(nn.Module):
    """A patched model with a StaticKVCache attached (GPTFast's KVCacheModel).

    ``prefill(input_ids, attention_mask=None)`` starts a sequence (the mask: 0 = padding, on either
    side), ``forward(input_ids)`` takes the whole sequence so far and runs only the columns not
    cached yet, ``rollback_cache(end_pos)`` forgets every column from ``end_pos`` on, ``clear()``
    drops the cache. Both return the next-token logits [B, V] at each row's last real token. The
    prompt's padding is remembered: columns past the prompt are real tokens. The cache starts at the
    prompt length + 256 slots and doubles when full (a model with recurrent layers, whose states
    cannot be carried over, then runs the sequence again into the larger cache). Such a model's
    columns past the prompt run one at a time.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"KVCacheModel: model must be a transformers causal LM, got {type(model).__name__}")
        self.model = model if is_patched(model) else patch_model(model, int8=False, fused_attention=True)
        self.cache: StaticKVCache | None = None
        self._consumed = 0  # columns of the caller's sequence already in the cache
        self._mask: torch.Tensor | None = None  # the prompt's [B, P] padding mask (None: no padding)

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, P] (attention_mask [B, P], 0 = padding) -> logits [B, V] at each row's last
        real token."""
        op = "KVCacheModel.prefill"
        _check_token_tensor(op, "input_ids", input_ids)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{op}: attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        device, _ = model_device_dtype(self.model)
        prompt = check_prompt(op, input_ids.to(device, torch.int64),
                              None if attention_mask is None else attention_mask.to(device), device,
                              input_vocab_size(self.model))
        check_positions_fit(op, "model", self.model, max(prompt.lengths), "the longest prompt")
        return self._start(prompt, prompt.input_ids.shape[1] + _INITIAL_CACHE_SLOTS)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L]: the whole sequence so far; its columns past the cached ones are run."""
        if self.cache is None:
            return self.prefill(input_ids)
        op = "KVCacheModel.forward"
        _check_token_tensor(op, "input_ids", input_ids)
        if input_ids.shape[0] != self.cache.batch_size or input_ids.shape[1] <= self._consumed:
            raise ValueError(f"{op}: input_ids must be [{self.cache.batch_size}, L] with L > "
                             f"{self._consumed} (the columns already cached), got {list(input_ids.shape)}")
        L = input_ids.shape[1]
        sequence, mask = input_ids.to(self.cache.device, torch.int64), self._sequence_mask(L)
        check_token_range(op, "input_ids", sequence, input_vocab_size(self.model))
        check_positions_fit(op, "model", self.model, int(mask.sum(dim=1).max()), "the longest sequence")
        new = Prompt(sequence[:, self._consumed:], mask[:, self._consumed:], [])
        if not bool(new.attention_mask.any(dim=1).all()):
            row = int((~new.attention_mask.any(dim=1)).nonzero()[0])
            raise ValueError(f"{op}: row {row} has no real token among columns {self._consumed}..{L - 1} (they are "
                             "its prompt's padding, after a rollback_cache into it); pass more of the sequence")
        needed = int(self.cache.seq_lengths.max()) + new.input_ids.shape[1]
        if needed > self.cache.max_cache_len:
            size = max(needed, 2 * self.cache.max_cache_len)
            if self.cache.has_recurrent_layers:  # states of a length cannot be carried over: run it all again
                return self._start(Prompt(sequence, mask, []), size)
            self._grow(size)
        if self.cache.has_recurrent_layers:
            # one column at a time: transformers' Mamba-1 blocks (Mamba, Falcon-Mamba, Jamba, Zamba) run
            # several tokens as a prompt, from a zero state; their single-token path continues the state
            for t in range(new.input_ids.shape[1]):
                logits = prefill(self.model, Prompt(new.input_ids[:, t:t + 1], new.attention_mask[:, t:t + 1], []),
                                 self.cache)
        else:
            logits = prefill(self.model, new, self.cache)
        self._consumed = L
        return logits

    def _start(self, prompt: Prompt, max_cache_len: int) -> torch.Tensor:
        """A new cache of ``max_cache_len`` slots holding ``prompt`` -> the logits at each row's last
        real token."""
        device, dtype = model_device_dtype(self.model)
        B, P = prompt.input_ids.shape
        self.cache = StaticKVCache(self.model.config, B, max_cache_len, device=device, dtype=dtype)
        mask = prompt.attention_mask
        self._mask = None if bool(mask.all()) else mask
        logits = prefill(self.model, prompt, self.cache)
        self._consumed = P
        return logits

    def _sequence_mask(self, length: int) -> torch.Tensor:
        """[B, length] bool: the prompt's padding mask, then real tokens."""
        B = self.cache.batch_size
        mask = torch.ones(B, length, dtype=torch.bool, device=self.cache.device)
        if self._mask is not None:
            P = min(self._mask.shape[1], length)
            mask[:, :P] = self._mask[:, :P]
        return mask

    def _grow(self, max_cache_len: int) -> None:
        """A cache of ``max_cache_len`` slots holding this one's keys and values (layers that keep none,
        such as those reading another layer's, have nothing to copy)."""
        old = self.cache
        new = StaticKVCache(self.model.config, old.batch_size, max_cache_len, device=old.device, dtype=old.dtype)
        for src, dst in zip(old.layers, new.layers):
            if src.keys is not None:
                dst.keys[:, :, :old.max_cache_len].copy_(src.keys)
                dst.values[:, :, :old.max_cache_len].copy_(src.values)
        new.seq_lengths.copy_(old.seq_lengths)
        self.cache = new

    def rollback_cache(self, end_pos: int) -> None:
        """Keeps the first ``end_pos`` columns of the sequence in the cache."""
        check_int("KVCacheModel.rollback_cache", "end_pos", end_pos, 0)
        if self.cache is None or end_pos >= self._consumed:
            return
        self.cache.crop(self._sequence_mask(end_pos).sum(dim=1))  # each row's real tokens among them
        self._consumed = end_pos

    def clear(self) -> None:
        self.cache = None
        self._consumed = 0
        self._mask = None


def add_kv_cache(model_name, *, device=None, dtype=None, trust_remote_code: bool = False) -> KVCacheModel:
    """A KVCacheModel for ``model_name`` (a path or hub name, loaded with ``from_pretrained``); a
    model already loaded (GPTFast's older ``add_kv_cache(model)``) or a KVCacheModel is accepted
    too. A model not patched yet is patched without int8 (use ``load_int8`` for int8)."""
    if isinstance(model_name, KVCacheModel):
        return model_name
    if isinstance(model_name, nn.Module):
        return KVCacheModel(model_name)
    return KVCacheModel(_load("add_kv_cache", "model_name", model_name, device=device, dtype=dtype,
                              trust_remote_code=trust_remote_code))


# -- speculative decoding --------------------------------------------------------------------------

def _check_token_tensor(op: str, arg: str, tokens) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0 or tokens.is_floating_point() \
            or tokens.dtype == torch.bool:
        raise ValueError(f"{op}: {arg} must be a [batch, seq_len] integer tensor with at least one token, "
                         f"got {tokens.dtype} {list(tokens.shape)}")


class GPTFastModel(nn.Module):
    """What ``gpt_fast`` / ``add_speculative_decode_kv_cache`` return: the target (``model``, a
    KVCacheModel), the draft (``draft_model``, or None: plain decoding) and ``sample``, the bound
    ``sample_function`` (None: our sampling kwargs). ``last_output`` keeps the last generate's
    SpeculativeOutput (acceptance figures)."""

    def __init__(self, model: KVCacheModel, draft_model: KVCacheModel | None, sample_function: Callable | None):
        super().__init__()
        self.model = model
        self.draft_model = draft_model
        self.sample = None if sample_function is None else types.MethodType(sample_function, self)
        self.last_output: SpeculativeOutput | None = None

    @property
    def config(self):
        return self.model.config

    def forward(self, *args, **kwargs):
        return self.model.model(*args, **kwargs)

    @torch.no_grad()
    def generate(self, cur_tokens: torch.Tensor, max_tokens: int, speculate_k: int, *,
                 attention_mask: torch.Tensor | None = None, **sampling_kwargs) -> torch.Tensor:
        """cur_tokens [B, P] (the prompts; ``attention_mask`` [B, P] when padded) -> [B, max_tokens]
        int64: the prompts followed by ``max_tokens - P`` generated tokens. ``speculate_k``: draft
        tokens per round. ``sampling_kwargs`` go to ``sample_function`` when there is one."""
        op = "generate"
        _check_token_tensor(op, "cur_tokens", cur_tokens)
        max_tokens = check_int(op, "max_tokens", max_tokens, 1)
        speculate_k = check_int(op, "speculate_k", speculate_k, 1)
        prompt_len = cur_tokens.shape[1]
        if max_tokens <= prompt_len:
            raise ValueError(f"{op}: max_tokens counts the prompt too (as in GPTFast) and must exceed cur_tokens' "
                             f"length {prompt_len}, got {max_tokens}")
        target = self.model.model
        device, _ = model_device_dtype(target)
        cur_tokens = cur_tokens.to(device, torch.int64)
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"{op}: attention_mask must be a torch.Tensor or None, "
                                f"got {type(attention_mask).__name__}")
            attention_mask = attention_mask.to(device)
        if self.sample is None:
            unknown = sorted(set(sampling_kwargs) - set(_OUR_SAMPLING_KWARGS))
            if unknown:
                raise TypeError(f"{op}: unexpected sampling keyword(s) {unknown}; without a sample_function the "
                                f"supported ones are {list(_OUR_SAMPLING_KWARGS)}")
            options = dict(sampling_kwargs)
            options.setdefault("eos_token_id", [])  # GPTFast does not stop at eos
            hook = None
        else:
            options = {"eos_token_id": []}
            hook = target.register_forward_hook(self._sampler_hook(sampling_kwargs))
        try:
            new = max_tokens - prompt_len
            speculate_k = min(speculate_k, new)  # (drafts past the last token would never be used)
            if self.draft_model is None:
                sequences = _generate(target, cur_tokens, attention_mask, max_new_tokens=new, **options).sequences
                self.last_output = None
            else:
                self.last_output = speculative_generate(target, self.draft_model.model, cur_tokens, attention_mask,
                                                        max_new_tokens=new, speculate_k=speculate_k, **options)
                sequences = self.last_output.sequences
        finally:
            if hook is not None:
                hook.remove()
        if sequences.shape[1] < max_tokens:  # every row stopped at an eos: pad to max_tokens
            _, pad = resolve_special_tokens(op, target, options["eos_token_id"])
            sequences = torch.nn.functional.pad(sequences, (0, max_tokens - sequences.shape[1]), value=pad)
        return sequences

    def _sampler_hook(self, sampling_kwargs: dict):
        """A forward hook replacing the target's logits with a one-hot of ``sample``'s pick at every
        position: greedy decoding / greedy verification then follow ``sample_function`` exactly."""

        def hook(module, args, output):
            logits = output.logits
            probs = torch.softmax(logits.float(), dim=-1).reshape(-1, logits.shape[-1])
            picks = [self._pick(row, sampling_kwargs) for row in probs]
            chosen = torch.tensor(picks, dtype=torch.int64, device=logits.device).view(logits.shape[:-1])
            one_hot = torch.full_like(logits, torch.finfo(logits.dtype).min)
            output.logits = one_hot.scatter_(-1, chosen.unsqueeze(-1), 0.0)
            return output

        return hook

    def _pick(self, probabilities: torch.Tensor, sampling_kwargs: dict) -> int:
        returned = self.sample(probabilities, **sampling_kwargs)
        try:
            token = torch.as_tensor(returned)
        except (TypeError, RuntimeError, ValueError) as error:
            raise TypeError(f"sample_function must return one integer token id (an int or a one-element tensor), "
                            f"got {type(returned).__name__}") from error
        if token.numel() != 1 or token.is_floating_point() or token.is_complex() or token.dtype == torch.bool:
            raise ValueError(f"sample_function must return one integer token id (an int or a one-element tensor), "
                             f"got {token.dtype} of shape {list(token.shape)}")
        token = int(token.reshape(()))
        if not 0 <= token < probabilities.shape[-1]:
            raise ValueError(f"sample_function returned token id {token}, outside the vocabulary "
                             f"[0, {probabilities.shape[-1]})")
        return token


def add_speculative_decode_kv_cache(model, draft_model, sample_function: Callable | None = None) -> GPTFastModel:
    """Speculative decoding of ``model`` with ``draft_model`` (each a KVCacheModel from add_kv_cache,
    or a transformers model). ``sample_function(self, probabilities, **kwargs) -> token id`` or None
    (greedy, or our sampling kwargs). Returns a GPTFastModel with ``generate``."""
    op = "add_speculative_decode_kv_cache"
    for arg, value in (("model", model), ("draft_model", draft_model)):
        if not isinstance(value, nn.Module) or not hasattr(value, "config"):
            raise TypeError(f"{op}: {arg} must be a KVCacheModel (add_kv_cache) or a transformers model, "
                            f"got {type(value).__name__}")
    if sample_function is not None and not callable(sample_function):
        raise TypeError(f"{op}: sample_function must be callable or None, got {type(sample_function).__name__}")
    model, draft_model = add_kv_cache(model), add_kv_cache(draft_model)
    target_vocab, draft_vocab = output_vocab_size(model.model), output_vocab_size(draft_model.model)
    if target_vocab != draft_vocab:
        raise ValueError(f"{op}: draft_model's vocabulary ({draft_vocab} tokens) differs from model's "
                         f"({target_vocab}); speculative decoding needs models that share a tokenizer")
    return GPTFastModel(model, draft_model, sample_function)


_IGNORED_GPT_FAST_KWARGS = ("max_length", "cache_config")


def gpt_fast(model_name, draft_model_name=None, sample_function: Callable | None = None, *, int8: bool = True,
             device=None, dtype=None, trust_remote_code: bool = False, **legacy_kwargs) -> GPTFastModel:
    """Loads ``model_name`` and ``draft_model_name`` (paths or hub names), both with int8 weights
    (``int8=False``: as loaded) and the fused static-cache attention, and returns a GPTFastModel
    whose ``generate(cur_tokens, max_tokens, speculate_k, **sampling_kwargs)`` decodes
    speculatively. ``draft_model_name=None``: plain decoding with the static cache.
    ``device``: default CUDA when available, else CPU. GPTFast's ``max_length`` and
    ``cache_config`` keywords are accepted and unused: caches are sized per ``generate`` call, and
    patching needs no description of the model's source (supported families are built in). A
    directory that ``save_patched`` wrote is used as saved (``int8`` does not apply to it)."""
    unknown = sorted(set(legacy_kwargs) - set(_IGNORED_GPT_FAST_KWARGS))
    if unknown:
        raise TypeError(f"gpt_fast: unexpected keyword argument(s) {unknown}")
    if sample_function is not None and not callable(sample_function):
        raise TypeError(f"gpt_fast: sample_function must be callable or None, got {type(sample_function).__name__}")
    options = {"device": device, "dtype": dtype, "trust_remote_code": trust_remote_code}
    names = {"model_name": model_name}
    if draft_model_name is not None:
        names["draft_model_name"] = draft_model_name
    loaded = {}
    for arg, name in names.items():
        model = _load("gpt_fast", arg, name, **options)  # (a save_patched directory comes patched as saved)
        loaded[arg] = model if is_patched(model) else patch_model(model, int8=int8, fused_attention=True)
    target = KVCacheModel(loaded["model_name"])
    if draft_model_name is None:
        return GPTFastModel(target, None, sample_function)
    return add_speculative_decode_kv_cache(target, KVCacheModel(loaded["draft_model_name"]), sample_function)


def generate_text_fast(model_path, draft_model_name, sequence, max_length: int, *, speculate_k: int = 6,
                       int8: bool = True, device=None, trust_remote_code: bool = False, stop_strings=None):
    """Text in, text out: loads both models (``gpt_fast``) and ``model_path``'s tokenizer, decodes
    greedily and speculatively until ``max_length`` tokens (prompt included) or the model's
    end-of-sequence token, and returns prompt + continuation decoded without special tokens.
    ``sequence``: a str, or a list of str (a batch: returns a list). ``stop_strings``: a str or a
    list of str; a row's continuation also ends with the token within which one of them is
    complete (see ``gptfast_kernels.generate``)."""
    op = "generate_text_fast"
    batch = isinstance(sequence, (list, tuple))
    texts = list(sequence) if batch else [sequence]
    if not texts or not all(isinstance(text, str) for text in texts):
        raise TypeError(f"{op}: sequence must be a str or a non-empty list of str, got {type(sequence).__name__}")
    check_int(op, "max_length", max_length, 1)
    _check_name(op, "model_path", model_path)
    _check_name(op, "draft_model_name", draft_model_name)
    tokenizer = padding_tokenizer(op, "model_path", model_path, trust_remote_code)
    fast = gpt_fast(model_path, draft_model_name, int8=int8, device=device, trust_remote_code=trust_remote_code)
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"].bool()
    lengths = mask.sum(dim=1).tolist()
    if min(lengths) == 0:
        raise ValueError(f"{op}: sequence {texts[lengths.index(0)]!r} has no tokens; give each text at least one")
    if max_length <= max(lengths):
        raise ValueError(f"{op}: max_length counts the prompt too and must exceed its {max(lengths)} "
                         f"tokens, got {max_length}")
    # every row to max_length tokens of its own (a shorter prompt's padding does not count), so the
    # batch runs to the longest continuation and each row is cut to its own
    P, wanted = ids.shape[1], [max_length - n for n in lengths]
    output = fast.generate(ids, P + max(wanted), speculate_k, attention_mask=mask.long(),
                           eos_token_id=text_eos_ids(fast.model.model, tokenizer), stop_strings=stop_strings,
                           tokenizer=tokenizer).cpu()
    rows = [torch.cat([ids[b][mask[b]], output[b, P:P + wanted[b]]]) for b in range(len(texts))]
    decoded = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return decoded if batch else decoded[0]


def padding_tokenizer(op: str, arg: str, path, trust_remote_code: bool = False):
    """``path``'s tokenizer, set to pad on the left (a batch of prompts then ends in one column),
    with a pad token (its eos, else unk, where it has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"{op}: {arg} {os.fspath(path)!r} has no loadable tokenizer: {error}") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    return tokenizer


def text_eos_ids(model, tokenizer) -> int | list[int]:
    """Where text generation stops: the model's eos ids, else the tokenizer's eos, else nowhere ([])."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else eos
