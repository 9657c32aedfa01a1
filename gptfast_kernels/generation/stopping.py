"""Stop sequences: token-id sequences that end a row when it generates one, matched on the device.

A row stops at the first new token that completes any of ``stop_sequences`` within the tokens it
generated (its prompt is never part of a match), as an eos token stops it: the sequence's tokens stay
in the output, the pad id follows. Like the eos ids under ``min_new_tokens``, a sequence completed by
new token number i < min_new_tokens does not stop the row (vLLM's rule for its stop ids). No host
synchronisation: a row's last L - 1 generated tokens (L: the longest sequence) and the new ones are
compared with a table of the sequences, right-aligned, in one batched comparison.
"""

from __future__ import annotations

import torch

# the table's entry before a sequence shorter than the longest: any token matches there
_ANY = -2
# a tail's entry before a row's first generated token: no stop token equals it
_NONE = -1


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


class StopSequences:
    """The sequences as a [S, L] table on ``device`` (right-aligned, _ANY before the shorter ones)."""

    def __init__(self, sequences: list[list[int]], device: torch.device):
        self.length = max(len(seq) for seq in sequences)
        self.table = torch.tensor([[_ANY] * (self.length - len(seq)) + seq for seq in sequences], dtype=torch.int64,
                                  device=device)

    def empty_tail(self, batch_size: int) -> torch.Tensor:
        """[B, L - 1]: the tail of rows that have generated nothing yet."""
        return torch.full((batch_size, self.length - 1), _NONE, dtype=torch.int64, device=self.table.device)

    def tail_of(self, generated: torch.Tensor, num_generated: torch.Tensor) -> torch.Tensor:
        """generated [B, W] (valid up to num_generated [B]) -> [B, L - 1]: each row's last L - 1
        generated tokens, _NONE where it has fewer."""
        columns = num_generated[:, None] - (self.length - 1) + torch.arange(self.length - 1,
                                                                            device=generated.device)[None, :]
        return torch.where(columns >= 0, generated.gather(1, columns.clamp(min=0)), _NONE)

    def ends(self, tail: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """tail [B, L - 1] (the row's generated tokens before ``tokens``), tokens [B, T] new ones in
        order -> [B, T] bool: whether the row's text up to each new token ends with a stop sequence."""
        text = torch.cat([tail, tokens], dim=1)  # [B, L - 1 + T]
        windows = text.unfold(1, self.length, 1)  # [B, T, L]: the L tokens up to each new one
        table = self.table[None, None]  # [1, 1, S, L]
        return ((windows[:, :, None, :] == table) | (table == _ANY)).all(dim=-1).any(dim=-1)

    @staticmethod
    def roll(tail: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The tail after ``tokens`` [B, T] were generated."""
        return torch.cat([tail, tokens], dim=1)[:, tokens.shape[1]:]
