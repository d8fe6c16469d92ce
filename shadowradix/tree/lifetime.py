"""How long loose resume points live against whole prefixes, learned from what was missed
(the adaptive policy, under one byte budget).

Every page of a finished sequence can be a resume point: its window pages and its state
are all the tree needs. Away from a kept checkpoint (sequence ends, branch points, learned
offsets, every 16 pages) such a point is loose. It costs bytes that could keep more
prefixes instead, so under pressure the two compete:

- keep loose points too long and whole prefixes (leaves) go instead: a later request
  finds its prefix gone (a leaf ghost, below, says it would have matched);
- drop them too soon and a request whose match stops between kept checkpoints resumes
  at the one before, recomputing the pages between (the match's logical hit minus its
  resume point says how many).

`LooseLifetime` weighs the two misses, in pages, and sets `stretch`: how many times faster
than a leaf a loose point ages. Eviction (tree/eviction.py, `evict_bytes`) lets go, oldest
first, whichever of a leaf, a kept checkpoint and a node's loose points is oldest, a loose
point's age multiplied by `stretch`. Stretch 1 is a plain radix cache's LRU (resume
points at every page while memory allows); at MAX_STRETCH loose points go before anything
else (the static rule). ARC (Megiddo and Modha, 2003) adapts its split between recency
and frequency the same way, from hits in ghost lists.

Ghosts: when eviction removes a leaf, its parent and first page are remembered (as the
leaf's page count) in a bounded FIFO; a match that stops exactly there, and would
have gone on into it, counts the pages it would have matched. A leaf that went because
its last loose point did counts as a loose miss instead.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

MAX_STRETCH = 2.0 ** 20  # at this stretch loose points go before anything else
START_STRETCH = MAX_STRETCH  # the static rule until misses say otherwise
RATE = 1 / 8  # log2(stretch) moves by this much per page missed
MIN_GHOSTS = 1024  # ghosts kept at least; else as many as the tree has nodes


class Ghost(NamedTuple):
    """A leaf eviction let go: the pages it held, and whether a loose point's eviction
    took it (the leaf had no other resume point) rather than the leaf's own."""

    key: tuple[int, int]
    pages: int
    loose: bool


class LooseLifetime:
    """The stretch between loose points' and leaves' ages, and the ghosts it learns from.

    observe() and remember() mutate; find() and stretch do not."""

    def __init__(self) -> None:
        self.log2_stretch = math.log2(START_STRETCH)
        self.missed = {"loose": 0, "leaf": 0}  # pages, over the tree's life (diagnostics)
        self._ghosts: OrderedDict[tuple[int, int], Ghost] = OrderedDict()
        # node id -> the most pages a ghost under it holds: a leaf that goes after its
        # children did stands for their pages too.
        self._below: OrderedDict[int, int] = OrderedDict()

    @property
    def stretch(self) -> float:
        """How many times faster than a leaf a loose point ages; inf at the cap (loose
        points go first however new: even the newest go before an old leaf)."""
        if self.log2_stretch >= math.log2(MAX_STRETCH):
            return math.inf
        return float(2.0 ** self.log2_stretch)

    def observe(self, loose_pages: int, leaf_pages: int) -> None:
        """One match that goes ahead: pages it recomputes for want of a loose point, and
        pages a ghost says an evicted leaf would have served."""
        if loose_pages < 0 or leaf_pages < 0:
            raise ValueError(f"missed pages must be >= 0, got {loose_pages}, {leaf_pages}")
        self.missed["loose"] += loose_pages
        self.missed["leaf"] += leaf_pages
        step = RATE * (leaf_pages - loose_pages)
        self.log2_stretch = min(max(self.log2_stretch + step, 0.0), math.log2(MAX_STRETCH))

    def remember(self, leaf_id: int, parent_id: int, first_page: bytes, pages: int,
                 loose: bool, capacity: int) -> None:
        """An evicted leaf `leaf_id` under node `parent_id`, starting with `first_page`
        (bytes), of `pages` pages (and those of the ghosts under it)."""
        pages += self._below.pop(leaf_id, 0)
        key = (parent_id, hash(first_page))
        self._ghosts.pop(key, None)
        self._ghosts[key] = Ghost(key, pages, loose)
        self._below[parent_id] = max(self._below.pop(parent_id, 0), pages)
        cap = max(capacity, MIN_GHOSTS)
        for table in (self._ghosts, self._below):
            while len(table) > cap:
                table.popitem(last=False)

    def find(self, parent_id: int, next_page: bytes) -> Ghost | None:
        """The ghost a match stopping at node `parent_id`, whose next page is `next_page`,
        would have gone on into; None when there is none."""
        return self._ghosts.get((parent_id, hash(next_page)))

    def forget(self, ghost: Ghost) -> None:
        """A ghost counted once is done."""
        self._ghosts.pop(ghost.key, None)

    def __len__(self) -> int:
        return len(self._ghosts)

