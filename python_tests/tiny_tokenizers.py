"""Tokenizers of at most VOCAB tokens built from lists (nothing downloaded), one per way a tokenizer
spells its tokens' text: GPT-2's byte-level alphabet, SentencePiece's "▁" with <0xNN> byte
fallback, and words joined by spaces. Ids 0, 1, 2 are <pad>, <eos>, <unk> (PAD and EOS of the tiny
models). Their pieces include the examples of transformers' StopStringCriteria docstring and
halves of multi-byte characters."""

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from python_tests.tiny_configs import VOCAB

SPECIALS = ["<pad>", "<eos>", "<unk>"]
# text pieces (str) and raw byte pieces (bytes: halves of characters)
PIECES = ["a", "b", "c", "d", "e", "f", "abcdef", " ", "\n", "\n\n", "s", "t", "o", "p", "st", "op", "sto", "stop",
          "opera", "pper", "las", "topper", "to", "pped", "at", " the", "the", " st", "é", "日本", "日", "本", "ok",
          " ok", "!", "! ", "x", "y", "z", "<|end|>", ".", ". ", "\"", "'", "to st", "ra", "er", "pe", "ll", "lo",
          " stop", "stopper", b"\xc3", b"\xa9", b"\xe6\x97", b"\xa5", b"\xe6", b"\x97\xa5"]


def _text_pieces():
    return [p for p in PIECES if isinstance(p, str)]


def _fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 / Llama 3 style: each token spelled in the byte-level alphabet (the raw byte pieces too)."""
    alphabet = bytes_to_unicode()
    spelled = ["".join(alphabet[b] for b in (p if isinstance(p, bytes) else p.encode())) for p in PIECES]
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(spelled)))}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _fast(tokenizer)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: "▁" for a space, <0xNN> tokens for bytes, a leading space stripped."""
    pieces = [p.replace(" ", "▁") for p in _text_pieces()] + ["▁"]
    pieces += [f"<0x{b:02X}>" for p in PIECES if isinstance(p, bytes) for b in p]
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(pieces)))}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return _fast(tokenizer)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Words, decoded joined by spaces (a tokenizer without a decoder)."""
    words = [p for p in _text_pieces() if p.strip() and " " not in p and "\n" not in p]
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(words)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _fast(tokenizer)


def rule_hits(tokens: list[int], pieces: list[bytes], strings: list[str]) -> list[bool]:
    """Whether an occurrence of a stop string in the tokens' text ends within each token."""
    text, ends = b"", []
    for token in tokens:
        text += pieces[token] if token < len(pieces) else b""
        ends.append(len(text))
    occurrence_ends = [start + len(s.encode()) for s in strings for start in range(len(text))
                       if text.startswith(s.encode(), start)]
    return [any((ends[i - 1] if i else 0) < end <= ends[i] for end in occurrence_ends) for i in range(len(tokens))]


def stop_string_from(pieces: list[bytes], tokens: list[int]) -> str:
    """A string that occurs in the text of ``tokens`` from the middle of token 2 into token 4 (or the
    nearest such span that is whole characters, else the longest), for a stop string the output
    does contain."""
    text = [pieces[t] if t < len(pieces) else b"" for t in tokens]
    start = sum(len(p) for p in text[:2]) + len(text[2]) // 2
    end = sum(len(p) for p in text[:4]) + max(1, len(text[4]) // 2)
    joined = b"".join(text)
    spans = [(start, end), (start - 1, end + 1), (start - 2, end + 2)]
    spans += [(a, a + width) for width in range(len(joined), 0, -1) for a in range(len(joined) - width + 1)]
    for a, z in spans:  # (else the longest span of whole characters)
        try:
            candidate = joined[max(a, 0):z].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if candidate:
            return candidate
    raise AssertionError(f"no text in {tokens}")


TOKENIZERS = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer, "words": word_tokenizer}
assert all(len(make()) <= VOCAB for make in TOKENIZERS.values())
