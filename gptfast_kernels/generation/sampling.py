"""Logits -> token distributions (the repetition, presence and frequency penalties, min-new-tokens,
temperature, top-k, top-p, min-p) and the checks every generator shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gptfast_kernels.ops._dispatch import check_int, real_number


def check_sampling_args(op: str, temperature, top_k, top_p, min_p, batch_size: int, device: torch.device) -> tuple:
    """Checks temperature / top-k / top-p / min-p -> (temperature, top_k, top_p, min_p) as sampling
    reads them. Each is a number (None: off, for the filters) for every row, or a list (or 1-D
    tensor) of one per row of the batch (None entries: off), as vLLM's per-request sampling
    parameters; per-row values become [B] tensors on ``device`` (top_k int64, the others float32;
    off: top_k 0, top_p 1, min_p 0), and the same value for every row becomes that number, so a
    uniform list samples exactly as the number does."""
    rules = (("temperature", temperature, _check_temperature), ("top_k", top_k, _check_top_k),
             ("top_p", top_p, _check_top_p), ("min_p", min_p, _check_min_p))
    return tuple(number_or_rows(op, name, value, check, batch_size, device) for name, value, check in rules)


def check_new_token_counts(op: str, max_new_tokens, min_new_tokens, batch_size: int,
                           device: torch.device) -> tuple:
    """``max_new_tokens`` and ``min_new_tokens``: each an int >= 0 for every row or one per row ->
    (max_new_tokens, the largest of them, min_new_tokens), per-row values as [B] int64 tensors
    (per-request limits: a row stops at its own maximum, as at an eos)."""
    def count(op, name, value):
        return check_int(op, name, value, 0)

    maximum = number_or_rows(op, "max_new_tokens", max_new_tokens, count, batch_size, torch.device("cpu"))
    if isinstance(maximum, torch.Tensor):  # (the largest read on the host, not from the device: no sync)
        largest, maximum = int(maximum.max()), maximum.to(device)
    else:
        largest = maximum
    return maximum, largest, number_or_rows(op, "min_new_tokens", min_new_tokens, count, batch_size, device)


def _check_temperature(op: str, name: str, value) -> float:
    number = real_number(value)
    if number is None or not 0 <= number <= _FLOAT32_MAX:
        raise ValueError(f"{op}: {name} must be a number in [0, {_FLOAT32_MAX:.4g}] (float32's largest; "
                         f"0 = greedy), got {value!r}")
    # (logits are divided in float32, where one too small for it is 0: greedy)
    return 0 if float(torch.tensor(number, dtype=torch.float32)) == 0 else value


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_top_k(op: str, name: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{op}: {name} must be None or an int >= 1, got {value!r}")
    return value


def _check_top_p(op: str, name: str, value) -> float | None:
    number = real_number(value)
    if value is not None and (number is None or not 0 < number <= 1):
        raise ValueError(f"{op}: {name} must be None or a number in (0, 1], got {value!r}")
    return value


def _check_min_p(op: str, name: str, value) -> float | None:
    number = real_number(value)
    if value is not None and (number is None or not 0 <= number <= 1):
        raise ValueError(f"{op}: {name} must be None or a number in [0, 1], got {value!r}")
    return value


# what a per-row tensor holds for a row whose filter or penalty is off (top_k 0: logits_to_probs
# reads it as the whole vocabulary)
_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0}
# arguments whose per-row tensor is float32 even when every value given is an int
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def number_or_rows(op: str, name: str, value, check, batch_size: int, device):
    """One argument, ``check(op, name, value)`` validating each value -> a number (or None) for every
    row, or a [B] tensor of per-row values (int64 for ints, else float32; None entries as _OFF)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            raise ValueError(f"{op}: {name} as a tensor must be 1-D and real, one value per row, got "
                             f"{tuple(value.shape)} {value.dtype}{' on the meta device (no values)' * value.is_meta}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return check(op, name, value)
    if len(value) != batch_size:
        raise ValueError(f"{op}: {name} has {len(value)} values, and takes one per row of the batch ({batch_size})")
    rows = [check(op, f"{name}[{i}]", v) for i, v in enumerate(value)]
    if all(v == rows[0] for v in rows):
        return rows[0]  # (one value for every row: sampled exactly as that number)
    rows = [_OFF[name] if v is None else v for v in rows]
    integers = all(isinstance(v, int) for v in rows) and name not in _FLOATS
    return torch.tensor(rows, dtype=torch.int64 if integers else torch.float32, device=device)


def check_penalties(op: str, repetition, presence, frequency, batch_size: int, device: torch.device) -> tuple:
    """The repetition penalty (None or > 0) and the presence / frequency penalties (any finite
    number) -> (repetition, presence, frequency) as process_logits reads them: each a number for
    every row (the repetition penalty None when it is 1), or, given as a list (or 1-D tensor) of one
    per row (None entries: off), a [B] float32 tensor on ``device``, as check_sampling_args."""
    repetition = number_or_rows(op, "repetition_penalty", repetition, _check_repetition, batch_size, device)
    presence, frequency = (number_or_rows(op, name, value, _check_additive, batch_size, device)
                           for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)))
    return (repetition if _on(repetition, 1) else None), presence, frequency


def _check_repetition(op: str, name: str, value) -> float | None:
    number = real_number(value)
    if value is not None and (number is None or not math.isfinite(number) or number <= 0):
        raise ValueError(f"{op}: {name} must be None or a finite number > 0 (1 = none), got {value!r}")
    return value


def _check_additive(op: str, name: str, value) -> float:
    number = real_number(value)
    if number is None or not math.isfinite(number):
        raise ValueError(f"{op}: {name} must be a finite number (0 = none), got {value!r}")
    return value


def seen_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids [B, P] and their mask -> [B, vocab_size] bool: which tokens each row's real (not
    padding) tokens hold (ids past the output vocabulary, which no logit scores, are left out)."""
    seen = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    real = (attention_mask != 0) & (input_ids < vocab_size)
    seen.scatter_(1, torch.where(real, input_ids, vocab_size), True)  # the rest into a dump column
    return seen[:, :vocab_size]


KEPT_RECORD_ATTRIBUTE = "_gptfast_token_record"  # where a compiling model keeps TokenRecord's tensors
KEPT_NAMES = "_gptfast_kept"  # the names of the attributes in which a compiling model keeps its caches and states


def keep_on(model, name: str, value) -> None:
    """``value`` kept on ``model`` as ``name`` for later compiled calls (forward.forget_kept drops it)."""
    setattr(model, name, value)
    vars(model).setdefault(KEPT_NAMES, set()).add(name)


def kept_on_model(model, attribute: str, key: tuple, make, tensors=lambda made: (made,)):
    """What ``model`` keeps under ``key`` in its dict ``attribute``: made by ``make()`` the first
    time, its ``tensors(made)`` then marked static (what a compiled step writes in place, or reads at
    every replay, at one address from call to call: on a GPU, a CUDA graph replayed, not recorded
    again), and handed out again for the same key."""
    kept = getattr(model, attribute, None)
    if kept is None:
        kept = {}
        keep_on(model, attribute, kept)
    if key not in kept:
        made = make()
        for tensor in tensors(made):
            torch._dynamo.mark_static_address(tensor)
        kept[key] = made
    return kept[key]


@dataclass
class TokenRecord:
    """What the penalties read of each row's text, per row ([B, V + 1]) or per row and position of a
    speculative round ([B, k + 1, V + 1]): ``seen`` bool, the tokens of its prompt and of what it
    generated (the repetition penalty), ``counts`` int32, how often it generated each token (the
    presence / frequency penalties); each None while its penalty is off. Column V absorbs masked
    writes (a token V is recorded nowhere that a logit reads)."""
    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    @classmethod
    def start(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int,
              repetition_penalty: float | None, presence_penalty: float, frequency_penalty: float) -> "TokenRecord":
        """The record after the prompt input_ids [B, P] (mask: 0 = padding), nothing generated,
        keeping what the penalties in use read (a repetition penalty of None or 1 and presence /
        frequency penalties of 0 are off)."""
        seen = _on(repetition_penalty, 1)
        prompt = seen_tokens(input_ids, attention_mask, vocab_size) if seen else None
        return cls(None if prompt is None else torch.nn.functional.pad(prompt, (0, 1)),
                   input_ids.new_zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.int32)
                   if _on(presence_penalty, 0) or _on(frequency_penalty, 0) else None)

    def kept_on(self, model) -> "TokenRecord":
        """This record for a compiled step, which writes it in place: each tensor copied into one
        that ``model`` keeps for its shape, marked static (a CUDA graph replays a graph only where
        what it writes is static; generation's state and caches are kept alike: one generation at
        a time per model)."""
        def keep(name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            key = (name, tuple(tensor.shape), tensor.device)
            return kept_on_model(model, KEPT_RECORD_ATTRIBUTE, key, lambda: torch.empty_like(tensor)).copy_(tensor)

        return TokenRecord(keep("seen", self.seen), keep("counts", self.counts))

    def map(self, fn) -> "TokenRecord":
        """A record of ``fn`` applied to each tensor kept."""
        return TokenRecord(*(None if t is None else fn(t) for t in (self.seen, self.counts)))

    def add(self, tokens: torch.Tensor) -> None:
        """Records generated tokens [..., T] (ids in [0, V]), in place (through views too)."""
        if self.seen is not None:
            self.seen.scatter_(-1, tokens, True)
        if self.counts is not None:
            self.counts.scatter_add_(-1, tokens, torch.ones_like(tokens, dtype=torch.int32))

    def before_each(self, drafts: torch.Tensor) -> "TokenRecord":
        """drafts [B, k] -> the record at each of the k + 1 positions of a round: position i has the
        drafts before it, 0 .. i - 1, recorded too."""
        B, k = drafts.shape
        record = self.map(lambda t: t[:, None].repeat(1, k + 1, 1))
        for i in range(k):  # draft i is before positions i + 1 ..
            record.map(lambda t: t[:, i + 1:]).add(drafts[:, i, None, None].expand(B, k - i, 1))  # noqa: B023
        return record


def penalty_rows(repetition, presence, frequency, batch_size: int, device: torch.device) -> tuple:
    """check_penalties's (repetition, presence, frequency) with each penalty that is on as [B] float32
    values (a number as every row's), those that are off as they are: what a compiled step takes,
    so that another value is not another graph (process_logits computes alike either way)."""
    return tuple(torch.full((batch_size,), float(value), device=device)
                 if not isinstance(value, torch.Tensor) and _on(value, off) else value
                 for value, off in ((repetition, 1), (presence, 0), (frequency, 0)))


class DraftProcessing(NamedTuple):
    """What a speculative round's drafts are processed with inside one compiled call (see
    SpeculativeRounds.draft_processing): the penalties over each row's ``record`` before the round
    (read, not written: the call records its drafts in a copy) and the eos ids held back from a
    draft that would be new token number ``generated`` [B] + i (from 0) of a row short of its
    ``min_new_tokens``."""
    record: TokenRecord
    generated: torch.Tensor
    penalties: tuple                     # penalty_rows's (repetition, presence, frequency)
    is_eos: torch.Tensor | None          # [V] bool, the eos columns (with min_new_tokens)
    min_new_tokens: torch.Tensor | None  # [B]; None: no row held back

    def process(self, logits: torch.Tensor, record: TokenRecord, i: int) -> torch.Tensor:
        """Draft ``i``'s logits [B, V], penalised over ``record`` (the record before the round and
        the drafts before this one), as process_logits gives them."""
        early = None if self.min_new_tokens is None else self.generated + i < self.min_new_tokens
        return process_logits(logits, record, self.penalties[0], self.is_eos, early, *self.penalties[1:])


def _on(value, off) -> bool:
    """Whether a penalty (a number, None, or per-row values that differ) does anything."""
    return isinstance(value, torch.Tensor) or (value is not None and value != off)


def holds_eos_back(min_new_tokens) -> bool:
    """Whether ``min_new_tokens`` (a number or [B]) can hold a row's eos back at all."""
    return isinstance(min_new_tokens, torch.Tensor) or min_new_tokens > 0


def too_early(made, min_new_tokens, batch_size: int, device: torch.device) -> torch.Tensor | None:
    """Where a token would be new token number ``made`` (an int for every row, or [B] / [B, T]) of
    its row and so may not be an eos (``min_new_tokens``, a number or [B]): a bool tensor, or None
    where no row is held back (an int for every row past a number)."""
    if not isinstance(made, torch.Tensor) and not isinstance(min_new_tokens, torch.Tensor):
        return torch.ones(batch_size, dtype=torch.bool, device=device) if made < min_new_tokens else None
    if not isinstance(made, torch.Tensor):
        return made < min_new_tokens
    return made < per_row(min_new_tokens, made) if holds_eos_back(min_new_tokens) else None


def per_row(value, like: torch.Tensor):
    """A number as it is, per-row values [B] as [B, 1, ..., 1] against ``like`` [B, ...]."""
    return _per_row(value, like) if isinstance(value, torch.Tensor) else value


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """[B, V] logits -> the same with each ``seen`` token's logit divided by ``penalty`` where it is
    positive and multiplied by it where negative (CTRL's repetition penalty, as transformers'
    ``repetition_penalty``: > 1 makes repeats less likely)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def eos_id_tensor(eos: list[int], device: torch.device) -> torch.Tensor | None:
    """eos ids -> [n] int64 on ``device`` (None for none), n their count rounded up to a power of two,
    at least 4, by repeating the first: compiled steps, which take it, are specialised on its shape,
    so that one to four eos ids (most models' count) share a step."""
    if not eos:
        return None
    n = max(4, 1 << (len(eos) - 1).bit_length())
    return torch.tensor(eos + eos[:1] * (n - len(eos)), dtype=torch.int64, device=device)


def eos_columns(eos_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """eos ids [n] -> [vocab_size] bool, True at each eos id (ids past the vocabulary left out;
    built by a scatter, without the host sync a boolean index would cost)."""
    is_eos = torch.zeros(vocab_size + 1, dtype=torch.bool, device=eos_ids.device)
    return is_eos.scatter_(0, eos_ids.clamp(max=vocab_size), True)[:vocab_size]


def apply_additive_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """[..., V] logits -> the same minus ``frequency`` times each token's count in ``counts`` [..., V]
    (how often the row generated it) and minus ``presence`` for every token generated at all (the
    OpenAI API's and vLLM's presence / frequency penalties: > 0 makes repeats less likely)."""
    counts = counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, record: TokenRecord, penalty, is_eos: torch.Tensor | None,
                   early: torch.Tensor | None, presence=0.0, frequency=0.0) -> torch.Tensor:
    """[B, ..., V] logits before sampling: the repetition penalty over ``record.seen`` (None: none),
    the presence and frequency penalties over ``record.counts`` (None: none), then the eos columns
    ``is_eos`` [V] at -inf where ``early`` [B, ...] holds (transformers' ``min_new_tokens``: no eos
    before that many new tokens; None: nowhere); vLLM's order. Each penalty is a number or per-row
    values [B] (check_penalties). Penalised logits are float32 (as transformers' processors take
    them), whether a penalty is a number or a tensor."""
    V = logits.shape[-1]
    repetition = record.seen is not None and _on(penalty, 1)
    additive = record.counts is not None and (_on(presence, 0) or _on(frequency, 0))
    if repetition or additive:
        logits = logits.float()
    if repetition:
        logits = apply_repetition_penalty(logits, record.seen[..., :V], per_row(penalty, logits))
    if additive:
        logits = apply_additive_penalties(logits, record.counts[..., :V], per_row(presence, logits),
                                          per_row(frequency, logits))
    if early is not None:
        logits = logits.masked_fill(early[..., None] & is_eos, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[..., V] logits, [...] tokens -> [...] float32: each token's log-probability under the logits."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def logits_to_probs(logits: torch.Tensor, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """[B, ..., V] logits -> [B, ..., V] float32 probabilities after temperature, top-k, top-p
    (nucleus: the smallest set of most likely tokens whose mass reaches top_p, at least one) and
    min-p (the tokens at least min_p times as likely as the most likely one), in transformers'
    order. Each argument is a number (None: off) or, per row, a [B] tensor (check_sampling_args's:
    0 in top_k is off). Temperature 0 gives a one-hot distribution on the argmax."""
    logits = logits.float()
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # (each row's largest logit brought to 0 first: a tiny temperature then sends the others to -inf
    # rather than the largest to inf, which would make the softmax NaN; the softmax is unchanged)
    top = logits.amax(dim=-1, keepdim=True)
    logits = logits - torch.where(top.isfinite(), top, 0.0)
    one_hot = None
    if isinstance(temperature, torch.Tensor):
        temperature = _per_row(temperature, logits)
        greedy = temperature == 0
        one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
        logits = logits / torch.where(greedy, 1.0, temperature)
    else:
        logits = logits / temperature
    if isinstance(top_k, torch.Tensor):
        k = _per_row(top_k, logits)
        k = torch.where(k == 0, logits.shape[-1], k.clamp(max=logits.shape[-1]))
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if isinstance(top_p, torch.Tensor) or (top_p is not None and top_p < 1):
        on = per_row(top_p, logits)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        drop_sorted = (mass_before >= on) & (on < 1)              # never drops the first token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = _renormalised(probs.masked_fill(drop, 0.0), on < 1)
    if isinstance(min_p, torch.Tensor) or min_p:
        # relative to the most likely token, which every filter keeps: renormalising cannot move it
        on = per_row(min_p, logits)
        probs = _renormalised(probs.masked_fill(probs < on * probs.amax(dim=-1, keepdim=True), 0.0), on > 0)
    if one_hot is not None:
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _per_row(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1], broadcasting over ``logits`` [B, ..., V]."""
    return values.view(values.shape[0], *([1] * (logits.dim() - 1)))


def _renormalised(probs: torch.Tensor, where) -> torch.Tensor:
    """probs divided by their sum where ``where`` ([B, 1, ..] or a bool for every row) holds; other
    rows as they are (a filter that is off leaves a row's numbers untouched)."""
    if isinstance(where, bool):
        return probs / probs.sum(dim=-1, keepdim=True) if where else probs
    return torch.where(where, probs / probs.sum(dim=-1, keepdim=True), probs)


def sample_by_uniform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities (any positive total) and [B] uniforms in [0, 1) -> [B] int64 tokens:
    each row's inverse CDF at its uniform, the first token whose cumulative mass (float64) passes
    uniform x total. Sampling from drawn numbers rather than from a generator inside the call lets
    a compiled function sample (a speculative round's drafts in one call) and an eager one take the
    same tokens. A token of zero mass is never taken: where rounding leaves no cumulative mass past
    the mark, the row takes its last token of nonzero mass."""
    cdf = probs.double().cumsum(dim=-1)
    past = cdf > (uniforms.double() * cdf[:, -1])[:, None]
    # (argmax returns the first of equal maxima: the first token past the mark, and the first
    # token where the cumulative mass reaches its total, which is the last of nonzero mass)
    return torch.where(past.any(dim=-1), past.to(torch.uint8).argmax(dim=-1), cdf.argmax(dim=-1))


def sampling_rows(temperature, top_k, top_p, min_p, batch_size: int, device: torch.device) -> tuple:
    """check_sampling_args's (temperature, top_k, top_p, min_p) -> the same as [B] per-row tensors, a
    filter that is off for every row None: logits_to_probs reads them exactly as the numbers, and a
    compiled function given them is not compiled anew for each value (as it is for numbers)."""
    def rows(value, dtype):
        if isinstance(value, torch.Tensor):
            return value.to(dtype)
        return torch.full((batch_size,), value, dtype=dtype, device=device)

    def off(value, name: str) -> bool:  # (a number that is off: None, or what _OFF holds for a row)
        return not isinstance(value, torch.Tensor) and (value is None or value == _OFF[name])

    return (rows(temperature, torch.float32), None if off(top_k, "top_k") else rows(top_k, torch.int64),
            None if off(top_p, "top_p") else rows(top_p, torch.float32),
            None if off(min_p, "min_p") else rows(min_p, torch.float32))


def pick_uniforms(temperature, batch_size: int, device: torch.device,
                  generator: torch.Generator | None) -> torch.Tensor | None:
    """The uniforms a pick samples at, [B] float64 drawn from ``generator``; None when temperature
    (a number, or per-row [B]) is 0: the argmax, nothing drawn."""
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return None
    return torch.rand(batch_size, dtype=torch.float64, device=device, generator=generator)


def pick_at(logits: torch.Tensor, uniforms: torch.Tensor | None, *filters) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens: the argmax where ``uniforms`` is None, else each row's
    sample at its uniform from the distribution ``filters`` (temperature, top_k, top_p, min_p) make
    (logits_to_probs, sample_by_uniform; per row with per-row arguments: a row of temperature 0
    gets its argmax, from a one-hot distribution). Compiled calls pick so, at uniforms drawn
    outside them (pick_uniforms)."""
    if uniforms is None:
        return logits.argmax(dim=-1)
    return sample_by_uniform(logits_to_probs(logits, *filters), uniforms)


def pick_tokens(logits: torch.Tensor, temperature, top_k, top_p, min_p,
                generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens: pick_at the uniforms pick_uniforms draws from ``generator``."""
    uniforms = pick_uniforms(temperature, logits.shape[0], logits.device, generator)
    return pick_at(logits, uniforms, temperature, top_k, top_p, min_p)
