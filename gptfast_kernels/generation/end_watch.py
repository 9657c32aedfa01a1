"""Whether a decode loop needs another call (a ``generate`` step, a speculative round), asked of a
0-d count that each call leaves on the device: the most new tokens an unfinished row may still
emit (0: every row has finished).

Reading it right after queuing a call is a sync: on a GPU the host would wait for that call to end
before queuing the next one's launches, and the GPU would idle while it does. A ``lagged`` watch
copies the count to pinned host memory behind each call and reads the call before the last: when
that one left every unfinished row more than ``per_call`` tokens short of its limit (a call emits
at most that many tokens a row), the last call cannot have ended them all at their limits, so the
next is queued without waiting; otherwise the host waits for the last call. So only rows that all
end at an eos (or a stop pattern) in the same call cost one call past the end, in which no row is
active: nothing is written and no state changes but the finished rows' pad ids.
"""

from __future__ import annotations

import torch

# rows whose limit the loop itself enforces (one limit for every row) count as this far from it: more
# than any limit a cache can hold (and, unlike int64's largest value, an ordinary constant in a kernel)
UNBOUNDED = 2**31 - 1


def count_remaining(remaining: torch.Tensor, finished: torch.Tensor, made: torch.Tensor,
                    limits: torch.Tensor | None) -> None:
    """Writes into ``remaining`` (0-d int64) the most new tokens an unfinished row may still emit:
    its limit (``limits`` [B]; None: one limit for every row, which the loop enforces) less the
    tokens it ``made`` [B]; 0 when every row has ``finished``."""
    left = UNBOUNDED if limits is None else limits - made
    remaining.copy_(torch.where(finished, 0, left).max())


class EndWatch:
    """``remaining``: the 0-d int64 count, updated in place by each call; ``per_call``: the most new
    tokens one call emits in a row (1 for a decode step, k + 1 for a speculative round)."""

    # the devices whose loops are watched ``lagged`` (tests add "cpu" to run the logic there)
    LAGGED_DEVICES = ("cuda",)

    def __init__(self, remaining: torch.Tensor, per_call: int, lagged: bool):
        self.remaining, self.per_call, self.lagged = remaining, per_call, lagged
        self.known = int(remaining)  # the latest value read (the state before the first call)
        self.pending = []  # [(host copy, event or None)]: queued calls' values not yet read, oldest first
        if lagged:
            pinned = remaining.is_cuda
            # two of each: the next call's copy never overwrites the one still pending
            self.copies = [torch.empty((), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
            self.events = [torch.cuda.Event() if pinned else None for _ in range(2)]
            self.queued_calls = 0

    @classmethod
    def lags_on(cls, device: torch.device) -> bool:
        """Whether a loop on ``device`` may read its end a call late (the host runs ahead of it)."""
        return device.type in cls.LAGGED_DEVICES

    def queued(self) -> None:
        """After queuing a call: its count, read now or (``lagged``) on its way to the host."""
        if not self.lagged:
            self.known = int(self.remaining)
            return
        slot = self.queued_calls % 2
        self.queued_calls += 1
        host, event = self.copies[slot], self.events[slot]
        host.copy_(self.remaining, non_blocking=event is not None)
        if event is not None:  # (on the stream that copies: that of the count's device, the current one or not)
            event.record(torch.cuda.current_stream(self.remaining.device))
        self.pending.append((host, event))

    def _read_oldest(self) -> None:
        host, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        self.known = int(host)

    def another(self) -> bool:
        """Whether to queue another call: some row has not finished, as far as the host knows."""
        while len(self.pending) > 1:
            self._read_oldest()
        if self.pending and 0 < self.known <= self.per_call:  # the last call may have ended every row
            self._read_oldest()
        return self.known > 0
