"""How much one call to a store may move, and how much write-through may wait for it.

A store with a call deadline (deadline.py) is asked, in one call, for at most what it moves
in CALL_SHARE of the deadline, at the rate it has shown in that direction (reads and writes
apart: a store may be fast one way and slow the other). The rate starts at RATE_FLOOR and
follows what calls of at least half the size limit show (a smaller call measures the round
trip more than the rate), growing at most GROWTH times a call; it falls back to the floor
when a call times out, so a store that slows down, or whose link others now share, is
asked for less at once. A call larger than the floor's, sized by a rate learnt above it,
that timed out is no sign of a dead store: the storage tier closes the breakers it opened
(StorageTier._timed); the rate is then back at the floor, and a second timeout shuts the
store off. A store slower than the floor is
shut off by its breaker, as a stalled one.

Write-through waits in a bounded backlog: a batch that would take it past its limit is
dropped (the store is a cache), so memory and the wait of `close()` stay bounded.
"""

from __future__ import annotations

import threading

RATE_FLOOR = 256 << 20  # bytes/s: the slowest store taken as healthy
CALL_SHARE = 0.5  # of the deadline one call may spend moving bytes
GROWTH = 1.5  # the most the rate grows from one call's measure
MAX_CALL_BYTES = 1 << 32  # whatever the deadline and rate


class Pace:
    """The rate (bytes/s) one direction of a store has shown; `call_bytes` from it."""

    def __init__(self, floor: float | None = None) -> None:
        self.floor = float(RATE_FLOOR if floor is None else floor)
        self.rate = self.floor

    def call_bytes(self, deadline_s: float) -> int:
        """The most bytes one call may move within `deadline_s`."""
        return int(min(CALL_SHARE * deadline_s * self.rate, MAX_CALL_BYTES))

    def beyond_floor(self, nbytes: int, deadline_s: float) -> bool:
        """Whether a call of `nbytes` asks for more than one at the floor's rate would."""
        return nbytes > CALL_SHARE * deadline_s * self.floor

    def moved(self, nbytes: int, seconds: float, limit: int) -> None:
        """A call moved `nbytes` in `seconds` under a size limit of `limit` bytes."""
        if seconds > 0 and nbytes >= limit / 2:
            self.rate = max(self.floor, min(nbytes / seconds, GROWTH * self.rate))

    def timed_out(self) -> None:
        """A call ran past its deadline: ask for no more than the floor allows."""
        self.rate = self.floor


class Backlog:
    """Bytes of write-through handed to the write thread and not yet stored."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, limit: int) -> Ticket | None:
        """Room for `nbytes` more, or None where they would take the backlog past `limit`
        (a batch alone always fits: one larger than the limit waits for an empty one)."""
        with self._lock:
            if self.bytes > 0 and self.bytes + nbytes > limit:
                return None
            self.bytes += nbytes
        return Ticket(self, nbytes)

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


class Ticket:
    """One batch's place in a Backlog; `release` gives it back once, however often it is
    called (by the write thread once the batch is stored, and by whoever saw its
    submission fail: the executor may have queued it before failing)."""

    def __init__(self, backlog: Backlog, nbytes: int) -> None:
        self._backlog, self.nbytes = backlog, nbytes
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._backlog._give(self.nbytes)
