"""``StateHistory``: how a hybrid model's ``StaticKVCache`` rolls its recurrent states back.

A linear-attention (or Mamba, or short-convolution) layer keeps one state per row, which every
token updates; it has no positions to crop. Speculative decoding writes k + 1 tokens a round and
keeps a different prefix of them per row. So from ``StaticKVCache.checkpoint()`` on, a patched
model's recurrent layers run token by token (models/recurrent.py) and leave each row's state after
every token column here, in preallocated slots: slot 0 holds the states at the checkpoint, slot s
those after the s-th token column written since (padding columns included), with each row's length
then. A padding column (position -1) leaves a row's state and length as they were. A crop to a
length a row had since the checkpoint copies that slot back into the layers' states (the last
slot with that length); a crop to 0 empties the row's states; a forward that fails puts them
back as they were before it.

Everything runs on the device, without a host synchronisation, and the slots have static
addresses, so a compiled step can be replayed as a CUDA graph: the column a step starts at is a
device tensor, not a Python int the graph would be specialised on.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

# the length of slots not written since the checkpoint: larger than any length, so a crop never picks them
UNWRITTEN = torch.iinfo(torch.int64).max


def row_mask(mask: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``mask`` [B] shaped to broadcast over ``state`` [B, ...]."""
    return mask.view(-1, *([1] * (state.dim() - 1)))


def recurrent_states(layer) -> list[tuple[dict, int]]:
    """(dict, key) of every state ``layer`` (a LinearAttentionLayer) holds: its conv and recurrent
    states per state index, where initialised (Lfm2's layers keep conv states only)."""
    found = []
    for states in (layer.conv_states, layer.recurrent_states):
        found += [(states, key) for key, tensor in states.items() if tensor is not None]
    return found


def _same_states(kept, states) -> bool:
    """Whether slots allocated for ``kept`` still fit a layer's ``states`` (same entries, shapes, dtypes)."""
    return len(kept) == len(states) and all(
        d is states_dict and k == key and d[k].shape == slots.shape[1:] and d[k].dtype == slots.dtype
        for (d, k, slots), (states_dict, key) in zip(kept, states))


class StateHistory:
    """The recurrent states of a cache's layers after each token since a checkpoint (see the module
    docstring). ``capacity``: the most token columns between a checkpoint and the crop that ends it."""

    def __init__(self, capacity: int, batch_size: int, device: torch.device):
        self.capacity = capacity
        self.is_open = False
        # per layer index, [(states dict, key, slots [capacity + 2, *state shape])]; the last slot takes
        # the columns past capacity (``overflow`` says a crop can no longer restore the states)
        self.slots: dict[int, list[tuple[dict, int, torch.Tensor]]] = {}
        # [capacity + 2, B]: each row's length (one past its furthest position) after each slot's column;
        # slot 0: at the checkpoint
        self.lengths = torch.zeros(capacity + 2, batch_size, dtype=torch.int64, device=device)
        self.column = torch.zeros((), dtype=torch.int64, device=device)  # the next column's index
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        self._step_slots: torch.Tensor | None = None  # [T]: the slots of the current forward's columns
        self._step_real: torch.Tensor | None = None   # [B, T] bool: which of its tokens are real
        # eager bookkeeping (crop's check): columns planned and layer-steps recorded since the checkpoint
        self.columns_planned = 0
        self.steps_recorded = 0
        self._planned_from = (0, 0)  # (columns_planned, steps_recorded) before the current forward
        if not torch.compiler.is_compiling():
            for tensor in (self.lengths, self.column, self.overflow):
                torch._dynamo.mark_static_address(tensor)

    def open(self, layers, seq_lengths: torch.Tensor) -> None:
        """Checkpoint: slot 0 takes every recurrent layer's current states (allocating the slots on
        first use, or when the states were replaced)."""
        for index, layer in enumerate(layers):
            if not isinstance(layer, LinearAttentionLayer):
                continue
            states = recurrent_states(layer)
            if not states:
                raise ValueError("StaticKVCache.checkpoint: the recurrent layers hold no state yet; a checkpoint "
                                 "comes after the prompt's forward")
            kept = self.slots.get(index)
            if kept is None or not _same_states(kept, states):
                kept = [(d, k, self._new_slots(d[k])) for d, k in states]
                self.slots[index] = kept
            for states_dict, key, slots in kept:
                slots[0].copy_(states_dict[key])
        self.lengths.fill_(UNWRITTEN)
        self.lengths[0].copy_(seq_lengths)
        self.column.zero_()
        self.overflow.zero_()
        self.columns_planned = self.steps_recorded = 0
        self.is_open = True

    def _new_slots(self, state: torch.Tensor) -> torch.Tensor:
        slots = torch.empty((self.capacity + 2, *state.shape), dtype=state.dtype, device=state.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(slots)
        return slots

    def plan(self, positions: torch.Tensor) -> None:
        """A forward writes token columns ``positions`` [B, T] (-1: padding): its slots and the rows'
        lengths after each."""
        self.discard()  # (a forward interrupted before its end, KeyboardInterrupt: no hook said so)
        T = positions.shape[1]
        real = positions >= 0
        slots = (self.column + 1 + torch.arange(T, device=positions.device)).clamp(max=self.capacity + 1)
        self.overflow |= self.column + T > self.capacity
        base = self.lengths.index_select(0, self.column.clamp(max=self.capacity + 1)[None])  # [1, B]
        after = torch.maximum(base.T, (positions + 1).cummax(dim=1).values)  # [B, T]
        self.lengths.index_copy_(0, slots, after.T.contiguous())
        self._step_slots, self._step_real = slots, real
        if not torch.compiler.is_compiling():
            self._planned_from = (self.columns_planned, self.steps_recorded)
            self.columns_planned += T

    def commit(self, num_tokens: int) -> None:
        """The forward planned last succeeded: later ones start after its columns."""
        self.column += num_tokens
        self._step_slots = self._step_real = None

    def discard(self) -> None:
        """The forward planned last failed (some recurrent layers may have run it): every state goes
        back to the last committed column's, and the slots past it are never chosen. (Nothing to
        do when every planned forward ended.)"""
        if self._step_slots is None:
            return
        last = self.column.clamp(max=self.capacity + 1)[None]
        for entries in self.slots.values():
            for states_dict, key, slots in entries:
                states_dict[key].copy_(slots.index_select(0, last)[0])
        self.lengths.index_fill_(0, self._step_slots, UNWRITTEN)
        if not torch.compiler.is_compiling():
            self.columns_planned, self.steps_recorded = self._planned_from
        self._step_slots = self._step_real = None

    def states_of(self, layer_idx: int) -> list[torch.Tensor]:
        """Copies of layer ``layer_idx``'s states as they are now (before a token column)."""
        return [states_dict[key].clone() for states_dict, key, _ in self.slots[layer_idx]]

    def record(self, layer_idx: int, column: int, before: list[torch.Tensor]) -> None:
        """Layer ``layer_idx`` has run the forward's token column ``column``: rows whose token there
        is padding get ``before`` back, and every row's states go to the column's slot."""
        if self._step_slots is None:
            raise RuntimeError("StaticKVCache: a recurrent layer ran outside a planned forward")
        real = self._step_real[:, column]
        slot = self._step_slots[column:column + 1]
        for (states_dict, key, slots), old in zip(self.slots[layer_idx], before):
            state = states_dict[key]
            kept = torch.where(row_mask(real, state), state, old)
            state.copy_(kept)
            slots.index_copy_(0, slot, kept[None])
        if not torch.compiler.is_compiling():
            self.steps_recorded += 1

    def record_columns(self, layer_idx: int, after: list[torch.Tensor]) -> None:
        """Layer ``layer_idx`` has run all the forward's token columns at once: ``after`` holds each of
        its states (in ``slots``' order) after every column, [T, B, ...], a padding column already
        leaving a row's state as it was. They go to the columns' slots; the states take the last."""
        if self._step_slots is None:
            raise RuntimeError("StaticKVCache: a recurrent layer ran outside a planned forward")
        for (states_dict, key, slots), columns in zip(self.slots[layer_idx], after, strict=True):
            slots.index_copy_(0, self._step_slots, columns)
            states_dict[key].copy_(columns[-1])
        if not torch.compiler.is_compiling():
            self.steps_recorded += len(self._step_slots)

    def rollback(self, new_lengths: torch.Tensor, check: bool) -> None:
        """Every row's states as they were when it had ``new_lengths`` [B] tokens since the checkpoint
        (0: emptied); closes the checkpoint. ``check``: ValueError (after a host synchronisation)
        where that cannot be done."""
        self.discard()  # (as in plan)
        known = self.lengths[:self.capacity + 1]  # (the last slot takes the columns past capacity)
        slot = (known[1:] <= new_lengths[None]).sum(dim=0)  # [B]: the last slot with a length <= new
        rows = torch.arange(slot.shape[0], device=slot.device)
        emptied = new_lengths == 0  # (a row emptied starts over: zero states, as a fresh cache's)
        if check:
            if bool(self.overflow):
                raise ValueError(f"StaticKVCache.crop: more than rollback_tokens = {self.capacity} token columns "
                                 "(padding included) were written since the checkpoint; the recurrent states can "
                                 "only be rolled back within them")
            start = known[0]
            short = ~emptied & (new_lengths < start)
            if bool(short.any()):
                row = int(short.nonzero()[0, 0])
                raise ValueError(f"StaticKVCache.crop: row {row} would go back to length {int(new_lengths[row])}, "
                                 f"before the checkpoint (length {int(start[row])}); a hybrid model's "
                                 "recurrent states roll back only to lengths since the last checkpoint(), or to 0")
            missed = ~emptied & (known[slot, rows] != new_lengths)
            if bool(missed.any()):
                row = int(missed.nonzero()[0, 0])
                raise ValueError(f"StaticKVCache.crop: row {row} never had length {int(new_lengths[row])} since the "
                                 "checkpoint (its forwards skipped positions), so there is no recurrent state of "
                                 "that length to go back to")
            expected = self.columns_planned * len(self.slots)
            if self.steps_recorded != expected:
                raise RuntimeError(f"StaticKVCache.crop: the recurrent layers recorded {self.steps_recorded} of "
                                   f"{expected} token steps since the checkpoint; only a patched model "
                                   "(patch_model) records them")
        for entries in self.slots.values():
            for states_dict, key, slots in entries:
                state = states_dict[key]
                state.copy_(torch.where(row_mask(emptied, state), 0, slots[slot, rows]))
        self.close()

    def close(self) -> None:
        self.is_open = False
        self._step_slots = self._step_real = None
