"""Stop sequences and stop strings: what ends a row besides its eos ids, matched on the device.

A row stops at the first new token that completes one of ``stop_sequences`` (lists of token ids)
in the tokens it generated, or one of ``stop_strings`` in the text of those tokens, as an eos token
stops it: the tokens stay in the output, the pad id follows. The prompt is never part of a match
(vLLM's rule; transformers' ``stop_strings`` may also match across the prompt's end). Like the eos
ids under ``min_new_tokens``, a match completed by new token number i < min_new_tokens does not
stop the row (vLLM's rule for its stop ids).

A stop string is matched in bytes (its UTF-8), against each token's bytes as the tokenizer decodes
it (a byte-level BPE token's own bytes, even half a character; a SentencePiece token with its
leading space; a special token as its text, as transformers' ``stop_strings`` take them). It
counts at the token within which it ends (["st", "opera"] stops on "opera" for "stop"), so a
string ending mid-token stops the row after that token, as in transformers.

How: an Aho-Corasick automaton over the patterns (tokens for the sequences, bytes for the strings),
lifted to whole tokens once per tokenizer and set of strings: ``table[s, t]`` holds
``2 * next_state + hit`` for a row in state s that generates token t (hit: a pattern ended within
it). Each row's state is one integer per automaton, so a step is one gather per automaton, on the
device, with no host synchronisation, however long the patterns are.
"""

from __future__ import annotations

import json
import re
import weakref
from collections import OrderedDict

import numpy as np
import torch

from gptfast_kernels.generation.sampling import kept_on_model

# Text put before a token when asking the tokenizer for the token's text, so that it is decoded as
# mid-text (a SentencePiece token keeps its leading space, which a decoder strips at the start)
_PREFIX = "abcdef"
# lifted tables kept per tokenizer (each is [states, V] int32 on the host)
_TABLES_PER_TOKENIZER = 8
# StopMatcher.kept_on: a table's states rounded up to a power of two, at least this many
MIN_KEPT_STATES = 16
KEPT_TABLES_ATTRIBUTE = "_gptfast_stop_tables"  # where a compiling model keeps them


def check_stop_sequences(op: str, stop_sequences, vocab_size: int) -> list[list[int]]:
    """None or a list of non-empty lists of token ids in [0, vocab_size) -> the list ([] for None)."""
    if stop_sequences is None:
        return []
    ok = isinstance(stop_sequences, (list, tuple)) and all(
        isinstance(seq, (list, tuple)) and len(seq) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in seq)
        for seq in stop_sequences)
    if not ok:
        raise ValueError(f"{op}: stop_sequences must be None or a list of non-empty lists of token ids in "
                         f"[0, {vocab_size}), got {stop_sequences!r}")
    return [list(seq) for seq in stop_sequences]


def check_stop_strings(op: str, stop_strings, tokenizer) -> list[str]:
    """None, a non-empty str or a list of them -> the list ([] for None); a tokenizer is required
    with any (transformers' rule: the strings are matched in its tokens' text)."""
    if stop_strings is None:
        return []
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"{op}: stop_strings must be None, a non-empty str or a list of non-empty str, "
                         f"got {stop_strings!r}")
    if not strings:
        return []
    if tokenizer is None:
        raise ValueError(f"{op}: stop_strings need the model's tokenizer (tokenizer=...), to know each token's text")
    if not all(callable(getattr(tokenizer, name, None)) for name in
               ("convert_ids_to_tokens", "convert_tokens_to_string", "encode", "__len__")):
        raise TypeError(f"{op}: tokenizer must be a transformers tokenizer (convert_ids_to_tokens, "
                        f"convert_tokens_to_string, encode), got {type(tokenizer).__name__}")
    return list(strings)


class StopMatcher:
    """One automaton per kind of pattern (token sequences, strings), each a [states, V] int32 table
    on the device (see the module docstring); a row's state is [M] int64, one per automaton."""

    def __init__(self, tables: list[torch.Tensor]):
        self.tables = tables
        self.vocab_size = tables[0].shape[1]

    @classmethod
    def build(cls, sequences: list[list[int]], strings: list[str], tokenizer, vocab_size: int,
              device: torch.device) -> "StopMatcher | None":
        """The matcher of checked ``sequences`` and ``strings`` (tokens up to ``vocab_size``), or None
        when there are none."""
        tables = []
        if sequences:
            tables.append(_lift_symbols(*_automaton(sequences, vocab_size)))
        if strings:
            tables.append(_string_table(tokenizer, strings, vocab_size))
        return cls([torch.from_numpy(t).to(device) for t in tables]) if tables else None

    def kept_on(self, model) -> "StopMatcher":
        """This matcher for compiled steps: each table copied into one that ``model`` keeps for its
        place and size, with its states rounded up to a power of two (at least MIN_KEPT_STATES),
        marked static. A compiled step is specialised on its inputs' shapes: tables of every other
        size would each compile it anew (under fullgraph a hard error past the recompile limit),
        where rounded, patterns of similar length share a step. And a CUDA graph copies an input
        that is not static into itself at every replay (a table over a 128k vocabulary holds 0.5 MB
        a state); kept, a table is copied once per call. The states past a table's own keep what an
        earlier table left there: no transition leads to them. The kept tables stay with the model
        (generation's state and caches do too: one generation at a time per model)."""
        tables = []
        for place, table in enumerate(self.tables):
            shape = (max(MIN_KEPT_STATES, 1 << (table.shape[0] - 1).bit_length()), table.shape[1])
            kept = kept_on_model(model, KEPT_TABLES_ATTRIBUTE, (place, shape, table.device),
                                 lambda: torch.zeros(shape, dtype=table.dtype, device=table.device))  # noqa: B023
            kept[:table.shape[0]].copy_(table)
            tables.append(kept)
        return StopMatcher(tables)

    def start(self, batch_size: int) -> torch.Tensor:
        """[B, M]: the state of rows that have generated nothing yet."""
        return torch.zeros(batch_size, len(self.tables), dtype=torch.int64, device=self.tables[0].device)

    def scan(self, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [B, M] before ``tokens`` [B, T] (new tokens in order; values outside the vocabulary,
        such as verification's -1 padding, read as token 0: their results must be ignored) ->
        (hits [B, T] bool: a pattern ended within that token; states [B, T, M] after each)."""
        tokens = tokens.clamp(0, self.vocab_size - 1)
        hits, states = [], []
        for t in range(tokens.shape[1]):
            entries = torch.stack([table.view(-1)[state[:, m] * self.vocab_size + tokens[:, t]]
                                   for m, table in enumerate(self.tables)], dim=1).to(torch.int64)
            state = entries >> 1
            hits.append((entries & 1).bool().any(dim=1))
            states.append(state)
        return torch.stack(hits, dim=1), torch.stack(states, dim=1)

    @staticmethod
    def counting_from(min_new_tokens, batch_size: int, device: torch.device) -> torch.Tensor:
        """``min_new_tokens`` (a number or [B]) as [B] int64: the new token number from which a
        row's matches count (what compiled steps take, so another value is not another graph)."""
        if isinstance(min_new_tokens, torch.Tensor):
            return min_new_tokens.to(torch.int64)
        return torch.full((batch_size,), min_new_tokens, dtype=torch.int64, device=device)

    @staticmethod
    def after(states: torch.Tensor, state: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """states [B, T, M] from ``scan`` of ``state`` [B, M] -> the state after each row's first
        ``count`` [B] tokens (0: ``state`` itself)."""
        index = (count - 1).clamp(min=0)[:, None, None].expand(-1, 1, states.shape[2])
        return torch.where(count[:, None] > 0, states.gather(1, index)[:, 0], state)


def _automaton(patterns: list, alphabet: int) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over symbols 0..alphabet-1 -> (next state [states, alphabet] int32, whether a
    pattern ends at each state [states] bool). State 0: nothing of any pattern matched."""
    children, accepting = [{}], [False]
    for pattern in patterns:
        node = 0
        for symbol in pattern:
            if symbol not in children[node]:
                children[node][symbol] = len(children)
                children.append({})
                accepting.append(False)
            node = children[node][symbol]
        accepting[node] = True
    delta = np.zeros((len(children), alphabet), dtype=np.int32)
    fail = [0] * len(children)
    order = list(children[0].values())
    for symbol, child in children[0].items():
        delta[0, symbol] = child
    for node in order:  # breadth first: a node's failure link is shallower, so already complete
        delta[node] = delta[fail[node]]
        accepting[node] = accepting[node] or accepting[fail[node]]
        for symbol, child in children[node].items():
            fail[child] = int(delta[fail[node], symbol])
            delta[node, symbol] = child
            order.append(child)
    return delta, np.array(accepting)


def _lift_symbols(delta: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """An automaton over tokens themselves -> its table (2 * next + hit)."""
    return 2 * delta + accepting[delta]


def _lift_bytes(delta: np.ndarray, accepting: np.ndarray, token_bytes: list[bytes]) -> np.ndarray:
    """An automaton over bytes -> its table over tokens: each token's bytes run from every state, a
    hit where any of them ends a pattern. Vectorised over states and tokens, byte column by byte
    column (longest tokens first, so each column is a prefix of the order)."""
    lengths = np.array([len(b) for b in token_bytes], dtype=np.int64)
    width = int(lengths.max(initial=0))
    padded = np.zeros((len(token_bytes), max(width, 1)), dtype=np.uint8)
    for t, data in enumerate(token_bytes):
        padded[t, :len(data)] = np.frombuffer(data, dtype=np.uint8)
    order = np.argsort(-lengths, kind="stable")
    current = np.broadcast_to(np.arange(delta.shape[0], dtype=np.int32)[:, None],
                              (delta.shape[0], len(token_bytes))).copy()
    hit = np.zeros(current.shape, dtype=bool)
    for column in range(width):
        tokens = order[:int((lengths > column).sum())]
        moved = delta[current[:, tokens], padded[tokens, column][None, :]]
        current[:, tokens] = moved
        hit[:, tokens] |= accepting[moved]
    return 2 * current + hit


# tokenizer -> (its length, [bytes per token id], OrderedDict of lifted tables)
_PER_TOKENIZER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _string_table(tokenizer, strings: list[str], vocab_size: int) -> np.ndarray:
    """The lifted table of ``strings`` for ``tokenizer``'s tokens 0..vocab_size-1, kept per tokenizer
    (building one reads the whole vocabulary)."""
    try:
        entry = _PER_TOKENIZER.get(tokenizer)
    except TypeError:  # (a tokenizer that cannot be weakly referenced is read every time)
        entry = None
    if entry is None or entry[0] != len(tokenizer):
        entry = (len(tokenizer), token_bytes(tokenizer), OrderedDict())
        try:
            _PER_TOKENIZER[tokenizer] = entry
        except TypeError:
            pass
    _, per_token, tables = entry
    key = (tuple(strings), vocab_size)
    if key not in tables:
        padded = (per_token + [b""] * vocab_size)[:vocab_size]  # (ids past the tokenizer: no text)
        tables[key] = _lift_bytes(*_automaton([s.encode("utf-8") for s in strings], 256), padded)
        if len(tables) > _TABLES_PER_TOKENIZER:
            tables.popitem(last=False)
    tables.move_to_end(key)
    return tables[key]


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes (index: id, 0..len(tokenizer)-1) as the tokenizer decodes it mid-text."""
    kinds = _decoder_kinds(tokenizer)
    byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
    byte_fallback = "ByteFallback" in kinds
    prefix_tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(_PREFIX, add_special_tokens=False))
    result = []
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if token is None:
            result.append(b"")
        elif byte_level is not None and all(c in byte_level for c in token):
            result.append(bytes(byte_level[c] for c in token))
        elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            result.append(bytes([int(token[3:5], 16)]))
        else:
            result.append(_mid_text(tokenizer, prefix_tokens, token).encode("utf-8"))
    return result


def _mid_text(tokenizer, prefix_tokens: list[str], token: str) -> str:
    """``token``'s text after other text (where a SentencePiece decoder keeps its leading space)."""
    text = tokenizer.convert_tokens_to_string([*prefix_tokens, token])
    at = text.find(_PREFIX)
    return text[at + len(_PREFIX):] if at >= 0 else tokenizer.convert_tokens_to_string([token])


def _decoder_kinds(tokenizer) -> set[str]:
    """The types in a fast tokenizer's decoder (``ByteLevel``, ``ByteFallback``, ...); empty for others."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        config = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    kinds, pending = set(), [config]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            kinds.add(item.get("type", ""))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return kinds


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
