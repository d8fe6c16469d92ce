"""Where matches resume, learned from the matches themselves (the adaptive policy).

A finished sequence keeps a checkpoint at its end (DESIGN.md §2). When the next request
extends it exactly, that checkpoint is where it resumes. Often it does not: a chat
template re-renders the last turn, a trace hashes the prompt only, a client trims the
reply. Then the request matches the sequence's tokens only up to some pages before its
end, and with the end checkpoint alone it resumes far earlier (at the last checkpoint
above that point), recomputing the pages between.

`ResumeOffsets` counts, over the matches that go ahead, how many pages before the end of
the sequence they matched into their logical hit stopped (the offset), and names the
offsets seen often enough to be worth a checkpoint on every finished sequence. It
decays its counts, so a workload that changes is followed.
"""

from __future__ import annotations

MAX_OFFSET = 16  # pages before a sequence end that a learned checkpoint may sit at
MIN_SHARE = 0.05  # an offset earns a checkpoint once this share of matches lands there
MAX_KEPT = 6  # learned checkpoints per sequence, at most (each costs a window + state)
HALF_LIFE = 2048  # observations after which old counts weigh half
REFRESH = 64  # observations between recomputations of the chosen offsets


class ResumeOffsets:
    """A decaying histogram of match offsets from sequence ends, and the offsets it picks.

    observe() mutates; offsets() does not (it returns the cached choice). Offset 0, the
    sequence end, is always chosen: that is the static policy's checkpoint.
    """

    def __init__(self) -> None:
        self.counts = [0.0] * MAX_OFFSET
        self.total = 0.0  # includes offsets past MAX_OFFSET (no checkpoint can serve those)
        self.seen = 0
        self._chosen: tuple[int, ...] = (0,)

    def observe(self, offset: int) -> None:
        """Count one match whose logical hit stopped `offset` pages before a sequence end."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if offset < MAX_OFFSET:
            self.counts[offset] += 1.0
        self.total += 1.0
        self.seen += 1
        if self.seen % HALF_LIFE == 0:
            self.counts = [c / 2 for c in self.counts]
            self.total /= 2
        if self.seen % REFRESH == 0:
            self._chosen = self._choose()

    def offsets(self) -> tuple[int, ...]:
        """The offsets (pages before a finished sequence's end) to keep checkpoints at,
        ascending; always starts with 0. No side effects."""
        return self._chosen

    def _choose(self) -> tuple[int, ...]:
        if self.total <= 0:
            return (0,)
        ranked = sorted(range(1, MAX_OFFSET), key=lambda o: -self.counts[o])
        picked = [o for o in ranked[:MAX_KEPT] if self.counts[o] >= MIN_SHARE * self.total]
        return (0, *sorted(picked))
