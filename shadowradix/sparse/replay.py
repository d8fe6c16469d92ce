"""Offline replay of a top-k access stream through a hot buffer: LRU against Belady's optimum.

The buffer modelled (DESIGN.md §6), per (request, CSA layer), with capacity B entries:

    # step i, counts[i] <= B   fast path: the whole C4 history is on the device, no lookup
    # step i, counts[i] >  B   each selected entry is a hit (resident) or a miss (copied in
    #                          from host, replacing an entry NOT selected at step i)

When a stream leaves the fast path, the buffer holds the whole history of its last fast step
(every entry, in LRU order of last selection); a stream that never had one starts empty. An
entry that was never resident misses on its first use under every policy: a compulsory miss.
A new entry enters the buffer only when it is selected; the slot the compressor writes it
into is scratch (that slot is why B >= top_k + 1), so compulsory misses are the same number
for every policy and the policies differ only in capacity misses.

Belady's rule (evict the unselected entry whose next selection is furthest away, never again
counting as infinitely far) is optimal here too; tests check it against exhaustive search.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shadowradix.sparse.access import AccessStream

POLICIES = ("lru", "belady")


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """Counts from replaying streams at one capacity. hits + misses = selections made
    outside the fast path; compulsory <= misses. Add two with `+` to aggregate."""

    steps: int = 0
    fast_path_steps: int = 0
    hits: int = 0
    misses: int = 0
    compulsory: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        """hits / lookups; None when every step took the fast path (nothing was looked up)."""
        return self.hits / self.lookups if self.lookups else None

    @property
    def fast_path_share(self) -> float | None:
        return self.fast_path_steps / self.steps if self.steps else None

    def __add__(self, other: ReplayStats) -> ReplayStats:
        return ReplayStats(*(getattr(self, f.name) + getattr(other, f.name)
                             for f in fields(self)))

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "hit_rate": self.hit_rate, "fast_path_share": self.fast_path_share}


def min_capacity(stream: AccessStream) -> int:
    """The smallest buffer a stream can be replayed at: top_k + 1."""
    return stream.top_k + 1


def replay(stream: AccessStream, capacity: int, policy: str = "lru") -> ReplayStats:
    """Replay `stream` through a buffer of `capacity` entries under `policy` ("lru" or
    "belady"). Pure: the stream is not changed. Raises ValueError on an unknown policy or a
    capacity below top_k + 1 (TypeError if it is not an int)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
        raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
    capacity = int(capacity)
    if capacity < min_capacity(stream):
        raise ValueError(f"capacity {capacity} is too small for top_k = {stream.top_k}: "
                         f"the minimum is top_k + 1 = {min_capacity(stream)} (the newest "
                         "entry needs a slot besides the k being read)")
    n = len(stream)
    # counts never decrease, so the fast path is a prefix of the stream.
    start = int(np.searchsorted(stream.counts, capacity, side="right"))
    preload = _preload(stream, start)
    tail = stream.ids[stream.offsets[start]:]
    compulsory = int(np.count_nonzero(np.unique(tail) >= len(preload)))
    run = _lru if policy == "lru" else _belady
    hits = run(stream, start, capacity, preload)
    return ReplayStats(n, start, hits, tail.size - hits, compulsory)


def sweep(streams: Iterable[AccessStream], capacities: Sequence[int],
          policies: Sequence[str] = POLICIES) -> dict[str, dict[int, ReplayStats]]:
    """Aggregate replay over many streams: {policy: {capacity: summed ReplayStats}}.
    Raises as `replay` does, before or during the sweep."""
    out = {p: {int(c): ReplayStats() for c in capacities} for p in policies}
    for stream in streams:
        for p in policies:
            for c in capacities:
                out[p][int(c)] += replay(stream, c, p)
    return out


def _preload(stream: AccessStream, start: int) -> list[int]:
    """What the buffer holds when step `start` leaves the fast path: the whole history of
    step start - 1, least recently selected first (never-selected first; ties by id)."""
    if start == 0:
        return []
    history = int(stream.counts[start - 1])
    last = np.full(history, -1, dtype=np.int64)
    sizes = np.diff(stream.offsets[:start + 1])
    np.maximum.at(last, stream.ids[:stream.offsets[start]], np.repeat(np.arange(start), sizes))
    return np.lexsort((np.arange(history), last)).tolist()


def _lru(stream: AccessStream, start: int, capacity: int, preload: list[int]) -> int:
    """Hits under LRU. Within a step, hits move to the back first and misses are appended
    after them, so the front entry is never one selected in this step."""
    resident: OrderedDict[int, None] = OrderedDict.fromkeys(preload)
    ids, offsets = stream.ids.tolist(), stream.offsets.tolist()
    hits = 0
    for i in range(start, len(stream)):
        missing = []
        for e in ids[offsets[i]:offsets[i + 1]]:
            if e in resident:
                resident.move_to_end(e)
                hits += 1
            else:
                missing.append(e)
        for e in missing:
            if len(resident) >= capacity:
                resident.popitem(last=False)
            resident[e] = None
    return hits


def _belady(stream: AccessStream, start: int, capacity: int, preload: list[int]) -> int:
    """Hits under Belady: a max-heap of resident entries by next use, with lazy deletion.

    `next_use[e]` is the step of e's next selection, for each resident e. An entry selected
    at step i has next use i until the step is done, the smallest of all residents, so the
    heap's top is never one of them; then each selected entry's key moves on to its next
    selection after i (a key only grows, so only an entry's latest heap item matches it).
    """
    ids, offsets = stream.ids.tolist(), stream.offsets.tolist()
    n, never = len(stream), len(stream)  # `never` sorts after every real step
    # One backward pass: the next selection of each occurrence, and first uses from `start`.
    after = [never] * len(ids)
    upcoming: dict[int, int] = {}
    for i in range(n - 1, start - 1, -1):
        for j in range(offsets[i], offsets[i + 1]):
            after[j] = upcoming.get(ids[j], never)
            upcoming[ids[j]] = i
    next_use = {e: upcoming.get(e, never) for e in preload}
    heap = [(-k, e) for e, k in next_use.items()]
    heapq.heapify(heap)
    hits = 0
    for i in range(start, n):
        a, b = offsets[i], offsets[i + 1]
        for e in ids[a:b]:
            if e in next_use:
                hits += 1
                continue
            if len(next_use) >= capacity:
                while True:
                    key, victim = heapq.heappop(heap)
                    if next_use.get(victim) == -key:
                        break
                del next_use[victim]
            next_use[e] = i
        for j in range(a, b):
            next_use[ids[j]] = after[j]
            heapq.heappush(heap, (-after[j], ids[j]))
    return hits
