"""The demo's data: a byte-level tokenizer and text every Python installation has, the sources of
its own standard library (a deterministic subset: the top-level ``*.py`` files, in name order)."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass

import torch


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text; then three special tokens."""

    PAD, BOS, EOS = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def decode(self, ids) -> str:
        """Bytes -> text (invalid UTF-8 shown as U+FFFD); special tokens are dropped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def batch(self, texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input_ids [B, P] int64 and attention_mask [B, P] (1 = real byte)."""
        encoded = [self.encode(text) for text in texts]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(texts), width), self.PAD, dtype=torch.int64)
        mask = torch.zeros((len(texts), width), dtype=torch.int64)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            mask[row, width - len(ids):] = 1
        return input_ids.to(device), mask.to(device)


HELD_OUT_EVERY = 8  # every 8th file (in name order) is kept out of training: prompts come from there


@dataclass
class Corpus:
    train: torch.Tensor      # [N] uint8: the training files, concatenated
    held_out: list[bytes]    # the held-out files' contents
    num_train_files: int
    root: str
    fingerprint: str         # Python version + file names and sizes: part of the cache key

    @property
    def description(self) -> str:
        return (f"{self.num_train_files} files of Python {sys.version_info.major}.{sys.version_info.minor}'s "
                f"standard library ({self.root}/*.py, {len(self.train) / 1e6:.1f} MB)")


def stdlib_files() -> tuple[str, list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    return root, sorted(glob.glob(os.path.join(root, "*.py")))


def load_corpus() -> Corpus:
    root, files = stdlib_files()
    if len(files) < 2 * HELD_OUT_EVERY:
        raise RuntimeError(f"demo: found only {len(files)} .py files under {root}; the default demo trains on the "
                           "standard library's sources, so it needs them (or use --model/--draft)")
    train, held_out, digest = [], [], hashlib.sha256(sys.version.encode())
    for index, path in enumerate(files):
        with open(path, "rb") as handle:
            content = handle.read()
        digest.update(f"{os.path.basename(path)}:{len(content)};".encode())
        (held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(content)
    data = b"\n".join(train)
    return Corpus(torch.frombuffer(bytearray(data), dtype=torch.uint8), held_out, len(train), root,
                  digest.hexdigest()[:16])


def code_prompts(corpus: Corpus, count: int, length: int = 96) -> list[str]:
    """``count`` prompts from the held-out files, one per file and each for a different method: the
    whole lines (at most ``length`` bytes) that end with a method's ``def`` line, then the first
    word of its body (``self.``, ``return ``, ``if ``...), for the model to continue."""
    prompts: list[str] = []
    names: set[bytes] = set()
    for content in corpus.held_out:
        start = 0
        while len(prompts) < count:
            found = content.find(b"\n    def ", start)
            if found < 0:
                break
            start = found + 1
            line_end = content.find(b"\n", found + 1)
            if line_end < 0 or not content[found:line_end].rstrip().endswith(b":"):
                continue  # a signature over several lines
            name = content[found + 9:line_end].split(b"(")[0]
            body = content[line_end + 1:content.find(b"\n", line_end + 1)]
            word = re.match(rb" +[A-Za-z_]+[ .(]", body)
            end = line_end + 1 + (word.end() if word else 0)
            if word is None or name in names or end < length:
                continue
            window = content[end - length:end]
            window = window[window.find(b"\n") + 1:]  # from a line start
            try:
                prompts.append(window.decode("ascii"))
            except UnicodeDecodeError:
                continue
            names.add(name)
            break  # one prompt per file: variety
        if len(prompts) == count:
            break
    if not prompts:
        raise RuntimeError("demo: no prompt found in the held-out standard-library files")
    while len(prompts) < count:
        prompts.extend(prompts[: count - len(prompts)])
    return prompts
