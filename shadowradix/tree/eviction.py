"""Eviction for ShadowRadix, per tier and pool (a part of the tree, kept in its own file).

ALL pools lose whole unlocked leaves of a tier; WINDOW / CHECKPOINT pools are
tombstoned page by page, loose pages before kept checkpoints, least recently
used first. The tree's state (nodes, counts, locks) is ShadowRadix's: this class
owns only the LRU heaps, and is mixed into the tree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from shadowradix.layout.spec import KVLayout
from shadowradix.tree.lifetime import LooseLifetime
from shadowradix.tree.lru import LRUHeap
from shadowradix.tree.node import Node
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.results import EvictResult
from shadowradix.tree.rules import MatchRule
from shadowradix.tree.spill import SpillRoom
from shadowradix.tree.tier import DEVICE, HOST

Freed = list[list[list[np.ndarray]]]  # [tier][pool row] -> arrays of page ids let go
F = TypeVar("F", bound=Callable[..., Any])


def _salvaging(walk: F) -> F:
    """A walk that raises halfway has let some pages go already (the tree forgot them):
    what it had (`_freeing`) is kept in `stranded` for the cache to free, so a fault never
    leaks a page. Each walk forgets a page before it records it, so a page recorded is
    one no node holds. With `sink_walks` (the owner frees everything from `stranded`:
    PrefixCache) every walk is in `stranded` from its start, raised or not, so a fault
    between the walk's return and the owner's release leaks nothing either."""

    @functools.wraps(walk)
    def run(self: Eviction, *args: Any, **kwargs: Any) -> Any:
        try:
            return walk(self, *args, **kwargs)
        except BaseException:
            # A table changed and its count not yet made (or the other way round): the
            # counts are made again from the tables at the owner's next operation.
            self.needs_repair = True
            freed = self._freeing
            if freed is not None:
                self._unrecorded()
                if not self.sink_walks:  # as it is: joining it could fault too
                    self.stranded.append(freed)
                self._freeing = None
                self.needs_sweep = True  # until a sweep gets through (see `sweep`)
                self._sweep(freed)  # a leaf it emptied before dropping it goes now
                self.needs_sweep = False
            raise
        finally:
            self._freeing = None

    return run  # type: ignore[return-value]


class Eviction:
    # Set by ShadowRadix.__init__ before _init_eviction.
    layout: KVLayout
    policy: CheckpointPolicy
    rule: MatchRule
    tiers: int
    n_pools: int
    page_size: int
    short_lived_rows: list[int]
    root: Node
    _held: list[list[int]]
    _pinned: list[list[int]]
    full_pin_rows: list[int]
    window_pin_rows: list[int]
    _n_nodes: int
    _clock: int
    lifetime: LooseLifetime
    needs_repair: bool

    def _init_eviction(self) -> None:
        """Per tier: leaves, and per short-lived pool the nodes with pages outside /
        inside kept checkpoints. Each heap has its own bit in Node.queued."""
        bits = 1 + 2 * self.n_pools
        self._leaves = [LRUHeap(t * bits) for t in range(self.tiers)]
        self._loose = [{row: LRUHeap(t * bits + 1 + 2 * row) for row in self.short_lived_rows}
                       for t in range(self.tiers)]
        self._kept = [{row: LRUHeap(t * bits + 2 + 2 * row) for row in self.short_lived_rows}
                      for t in range(self.tiers)]
        # Let go by walks that raised (`_salvaging`); with `sink_walks`, by every walk,
        # and the owner's own queue besides (PrefixCache shares it).
        self.stranded: list[Any] = []
        self.sink_walks = False
        self.needs_sweep = False  # a walk raised and the sweep after it did too
        self._freeing: Freed | None = None  # what the running walk let go so far
        # A node's pages between its forgetting and their recording (see `_unrecorded`).
        self._limbo: _Limbo | None = None
        self._byte_plans: dict[tuple[int, ...], Any] = {}  # evict_bytes' rows per budget

    def nodes_visited(self) -> int:
        """Nodes the eviction walks have looked at so far (each LRU heap's yields, the
        locked ones they skip included): their work, for benchmarks."""
        heaps = [*self._leaves, *(h for t in (*self._loose, *self._kept) for h in t.values())]
        return sum(h.yielded for h in heaps)

    def _begin(self, freed: Freed) -> None:
        """A walk starts letting pages go into `freed` (see `_salvaging`)."""
        self._unrecorded()
        self._freeing = freed
        if self.sink_walks:
            self.stranded.append(freed)

    @_salvaging
    def evict(self, pool: str, num_pages: int, tier: int = DEVICE,
              room: SpillRoom | None = None) -> EvictResult:
        """Let at least `num_pages` pages of `pool` go from `tier`, if that many are unlocked.

        ALL pools (and every pool when tombstones are off) lose whole unlocked
        leaves of the tier, least recently used first: all of a node's shadows
        in the tier go. A node that still holds pages in the other tier stays
        (host-only after a device eviction); one that holds none is removed.
        WINDOW / CHECKPOINT pools are tombstoned page by page, least recently
        used first, pages outside kept checkpoints before those inside. A leaf
        left with no checkpoint to resume from in any tier is removed too.
        Locked pages stay in both tiers. With a `room` (write-back), device pages
        without a host copy take host pages from it before they go (a node keeps its
        data, host-only); the moves are recorded in the room for the caller to copy.
        evict(_, 0) is a no-op. The result lists every page let go, in every pool
        and both tiers.
        """
        row = self.layout.index(pool)
        if not 0 <= tier < self.tiers:
            raise ValueError(f"tier {tier}: this tree has {self.tiers} tier(s)")
        freed: Freed = [[[] for _ in range(self.n_pools)] for _ in range(self.tiers)]
        self._begin(freed)
        got = 0
        if num_pages > 0:
            if row in self._loose[tier] and self.policy.tombstones:
                for kept in (False, True):
                    if got < num_pages:
                        got += self._tombstone(tier, row, kept, num_pages - got, freed, room)
            if got < num_pages and (row not in self._loose[tier] or not self.policy.tombstones):
                self._evict_leaves(tier, row, num_pages - got, freed, room)
        return self._evict_result(freed)

    @_salvaging
    def evict_bytes(self, want: int, page_bytes: list[int]) -> EvictResult:
        """One byte budget for every device pool: let at least `want` bytes go, if that
        many are unlocked, choosing across pools (page_bytes: bytes per page, per row).

        Oldest first, whichever of: the least recently used leaf (every pool), kept
        checkpoint (its pages in every short-lived pool go together: one is useless
        without the others) and node's loose WINDOW / CHECKPOINT pages (those away from
        a kept checkpoint, together too), a loose page's age counted `stretch` times.
        Under `adaptive_lifetime` the stretch is learned (tree/lifetime.py); otherwise
        loose pages go before anything else. So the window pool grows and shrinks
        against the others with what is used. One tier only; mutates; evict_bytes(0, _)
        is a no-op.
        """
        if self.tiers != 1:
            raise ValueError("a shared byte budget needs a tree without a host tier")
        got = _Tally(page_bytes)
        freed: Freed = [got.rows]
        self._begin(freed)
        if want <= 0:
            return self._evict_result(freed)
        counted, loose_rows, along, lead = self._byte_rows(page_bytes)
        # Loose pages first, every row (`loose_rows`, largest pages first); a node's loose
        # pages in the other short-lived rows go with those of the row with the largest
        # pages (one is useless without the others: every short-lived row is needed at a
        # resume point).
        for i, row in enumerate(loose_rows):
            short = want - got()
            if short > 0:
                self._tombstone(DEVICE, row, False, -(-short // page_bytes[row]), freed,
                                None, along if i == 0 else ())
        # Left short, the loose-first pass let go every unlocked loose page of `lead` (it
        # stops early only once it freed enough): the walk by age has none to look for.
        self._evict_older(want, lead, freed, got, loose=not loose_rows or lead != loose_rows[0])
        # Pages the walk above did not reach (rows other than the one it walks by).
        for kept in (False, True) if self.policy.tombstones else ():
            for row in counted:
                short = want - got()
                if short > 0:
                    self._tombstone(DEVICE, row, kept, -(-short // page_bytes[row]), freed,
                                    None)
        return self._evict_result(freed)

    def _byte_rows(self, page_bytes: list[int]) -> tuple[list[int], list[int], list[int],
                                                         int | None]:
        """For `evict_bytes` over `page_bytes` (made once per budget): the short-lived
        rows that count (a row of 0 bytes, a pool outside the budget, frees none: only
        the walk of a row that counts takes its pages along); those the loose-first pass
        walks (none under `adaptive_lifetime` or without tombstones), largest pages first;
        the rows whose loose pages go along with the first; and the row the walk by age
        follows for short-lived pages (None: none counts, or no tombstones)."""
        key = tuple(page_bytes)
        got = self._byte_plans.get(key)
        if got is None:
            counted = [r for r in self.short_lived_rows if page_bytes[r] > 0]
            loose = (sorted(counted, key=lambda r: -page_bytes[r])
                     if self.policy.tombstones and not self.policy.adaptive_lifetime else [])
            along = [r for r in self.short_lived_rows if loose and r != loose[0]]
            lead = (max(counted, key=lambda r: page_bytes[r])
                    if counted and self.policy.tombstones else None)
            got = self._byte_plans[key] = (counted, loose, along, lead)
        return got

    def _evict_older(self, want: int, lead: int | None, freed: Freed, got: _Tally,
                     loose: bool = True) -> None:
        """Leaves, kept checkpoints and loose pages (those of row `lead`, the short-lived
        row of the largest pages; None: leaves only; not `loose`: no loose pages), oldest
        first (a loose page's age stretched), until `want` bytes are freed."""
        if got() >= want:  # the loose pages did it: no walk to start (each pops a head)
            return
        rows = self.short_lived_rows if self.policy.tombstones else []
        stretch = self.lifetime.stretch if self.policy.adaptive_lifetime else math.inf
        kinds = [] if lead is None else [(lead, kept) for kept in
                                         ((False, True) if loose else (True,))]
        walks: list[_Walk] = []  # first on a tie (min keeps the first): loose, kept, leaf
        now = self._clock

        def stamp(w: _Walk) -> float:
            assert w.node is not None
            if w.row is None or w.kept:
                return w.node.last_access
            return -math.inf if stretch == math.inf else (
                now - (now - w.node.last_access) * stretch)

        try:
            for row, kept in (*kinds, (None, False)):
                walks.append(_Walk(self, row, kept))
                walks[-1].advance()  # to its first node
            while got() < want:
                live = [w for w in walks if w.node is not None]
                if not live:
                    break
                w = min(live, key=stamp) if len(live) > 1 else live[0]
                node = w.node
                assert node is not None
                if node.alive and w.row is None:
                    if not node.children:
                        self._remember(node, loose=False, whole=True)
                        self._remove_leaf(node, freed)
                elif node.alive and w.row is not None:
                    self._drop_short(node, rows, freed, w.kept)
                    if self._locked_rest(node, DEVICE, w.row, w.kept):
                        w.skipped.append(node)
                w.advance()
        finally:  # after a fault too: the node a walk was at goes back with its locked ones
            for w in walks:
                w.requeue()

    def _drop_short(self, node: Node, rows: list[int], freed: Freed, kept: bool) -> None:
        """Tombstone a node's unlocked kept (or loose) pages in every short-lived pool;
        a leaf left with no resume point goes too."""
        if kept and self._only_kept_leaf(node, rows):  # it goes whole, as it would after
            if self.policy.adaptive_lifetime:
                self._remember(node, loose=False, whole=False)
            parent = node.parent
            self._remove_leaf(node, freed)
            assert parent is not None
            self._drop_dead_leaf(parent, freed)
            return
        for row in rows:
            mask = self._free_cells(node, DEVICE, row, kept)
            if np.count_nonzero(mask):
                self._let_go(node, DEVICE, row, mask, freed)
        if not node.children and node.full_lock == 0:
            if self.policy.adaptive_lifetime and self._dead(node):
                self._remember(node, loose=not kept, whole=False)
            self._drop_dead_leaf(node, freed)

    def _only_kept_leaf(self, node: Node, rows: list[int]) -> bool:
        """An unlocked leaf (one tier) whose pages in the short-lived `rows` are all kept
        ones: once those go it holds no resume point (each needs a page of some short-lived
        row), so the dead leaf goes with the rest of its pages."""
        return (bool(rows) and self.rule.has_checkpoints and self.tiers == 1
                and not node.children and node.full_lock == 0
                and not np.count_nonzero((node.pages[rows] >= 0) > node.keep[rows]))

    def _remember(self, leaf: Node, loose: bool, whole: bool) -> None:
        """A ghost of a leaf eviction lets go (adaptive_lifetime): see tree/lifetime.py.
        What the leaf would have served: up to its deepest resume point when it goes whole,
        all of it when it goes because its last resume point did (`whole` False)."""
        if self.policy.adaptive_lifetime and leaf.parent is not None:
            pages = self.rule.deepest(leaf.pages) if whole else leaf.n_pages
            self.lifetime.remember(leaf.id, leaf.parent.id, leaf.key(self.page_size),
                                   pages, loose, self._n_nodes)

    @_salvaging
    def prune(self, node: Node) -> EvictResult | None:
        """Remove `node` and unlocked ancestors while each is a leaf no tier can resume
        from (a running request's prefix, inserted without its live window, once the
        request is gone). The caller frees the pages in the result; None: nothing went."""
        if not node.alive or node is self.root or node.children or node.full_lock:
            return None
        freed: Freed = [[[] for _ in range(self.n_pools)] for _ in range(self.tiers)]
        self._begin(freed)
        self._drop_dead_leaf(node, freed)
        return self._evict_result(freed)

    @_salvaging
    def unspill(self, room: SpillRoom) -> EvictResult:
        """Undo what a room recorded (its copies were never submitted): the host cells it
        filled hold no data, so they go, with any node left resident nowhere. The caller
        frees the pages in the result (the host pages of the room included): those a
        node never took too (a fault between the room noting them and the node's table
        filling)."""
        freed: Freed = [[[] for _ in range(self.n_pools)] for _ in range(self.tiers)]
        self._begin(freed)
        for node, cells, _, ids in room.taken:
            held = cells & (node.slot(HOST) == ids)  # (a node that died let its own go)
            never = cells & ~held
            for row in range(self.n_pools):
                if np.count_nonzero(never[row]):
                    freed[HOST][row].append(ids[row][never[row]])
            if not node.alive:
                continue
            self._forget_cells(node, HOST, held, freed)
            self._drop_dead_leaf(node, freed)
        room.taken.clear()
        return self._evict_result(freed)

    @_salvaging
    def forget(self, bad: list[list[np.ndarray]]) -> EvictResult:
        """Tombstone every cell holding a page of `bad` ([tier][pool row] -> page ids whose
        bytes never arrived: a failed copy), locked or not, and any node left resident
        nowhere. An ALL pool is all or nothing per tier, so a bad page there takes the
        node's other ALL pages in that tier too. The caller frees the pages in the result
        and stops every reader of the device pages in it."""
        freed: Freed = [[[] for _ in range(self.n_pools)] for _ in range(self.tiers)]
        self._begin(freed)
        hit, stack = [], list(self.root.children.values())
        all_rows = list(self.rule.all_rows)
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tier, rows in enumerate(bad):
                slot = node.slot(tier)
                mask = np.zeros(slot.shape, dtype=bool)
                for row, pages in enumerate(rows):
                    if pages.size:
                        mask[row] = np.isin(slot[row], pages) & (slot[row] >= 0)
                if all_rows and mask[all_rows].any():
                    mask[all_rows] = slot[all_rows] >= 0
                if mask.any():
                    hit.append(node)
                    self._forget_cells(node, tier, mask, freed)
        for node in hit:
            if node.alive:
                self._drop_dead_leaf(node, freed)
        return self._evict_result(freed)

    def _forget_cells(self, node: Node, tier: int, mask: np.ndarray, freed: Freed) -> None:
        """Tombstone the `mask` cells ([pools, n], each holding a page) of a node's tier,
        locked or not: counted, cleared, then recorded (see `_salvaging`)."""
        slot = node.slot(tier)
        lost = [slot[row][mask[row]] for row in range(self.n_pools)]
        self._count(mask, -1, tier, node)
        slot[mask] = -1
        for row, pages in enumerate(lost):
            if pages.size:
                freed[tier][row].append(pages)

    @_salvaging
    def sweep(self) -> EvictResult:
        """Drop every unlocked leaf no tier can resume from: what a walk a fault cut short
        left, when the sweep after it faulted too (`needs_sweep`). The caller frees the
        pages in the result. O(tree)."""
        freed: Freed = [[[] for _ in range(self.n_pools)] for _ in range(self.tiers)]
        self._begin(freed)
        self._sweep(freed)
        self.needs_sweep = False
        return self._evict_result(freed)

    def _sweep(self, freed: Freed) -> None:
        """Every unlocked leaf no tier can resume from goes (its pages into `freed`): after
        a walk a fault cut short between emptying a leaf and dropping it. O(tree)."""
        stack, leaves = list(self.root.children.values()), []
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        for leaf in leaves:
            if leaf.alive:
                self._drop_dead_leaf(leaf, freed)

    def result_of(self, freed: Freed) -> EvictResult:
        """What a walk let go (one of `stranded`) as the EvictResult it would have made."""
        return self._evict_result(freed)

    def _evict_result(self, freed: Freed) -> EvictResult:
        return EvictResult.of_walk(freed, self.layout.pool_names, queued=self.sink_walks)

    def _free_cells(self, node: Node, tier: int, row: int, kept: bool) -> np.ndarray:
        """The cells of one pool row that eviction may let go: present in `tier`, not held
        by a window lock, and kept checkpoints' (kept) or loose pages (not kept)."""
        cells = self._kind_cells(node, tier, row, kept)
        if node.full_lock == 0:  # no lock runs through it: no window lock either
            return cells
        return cells & (node.window_lock == 0)

    def _kind_cells(self, node: Node, tier: int, row: int, kept: bool) -> np.ndarray:
        """The cells of one pool row present in `tier` that are kept checkpoints' (kept) or
        loose pages (not kept), locked or not."""
        present = node.slot(tier)[row] >= 0
        return present & node.keep[row] if kept else present > node.keep[row]  # & ~keep

    def _let_go(self, node: Node, tier: int, row: int, mask: np.ndarray, freed: Freed) -> int:
        """Tombstone the `mask` cells of one pool row; their pages go to `freed`."""
        ids = node.slot(tier)[row]
        pages = ids[mask]
        ids[mask] = -1
        self._held[tier][row] -= pages.size
        freed[tier][row].append(pages)
        return int(pages.size)

    def _tombstone(self, tier: int, row: int, kept: bool, want: int, freed: Freed,
                   room: SpillRoom | None, along: Sequence[int] = ()) -> int:
        """Let at least `want` unlocked kept (or loose) pages of pool row `row` go from
        `tier`, least recently used node first, with the same kind of pages of each such
        node in rows `along` (not counted; no room); the pages of `row` that went."""
        heap = (self._kept if kept else self._loose)[tier][row]
        got, skipped = 0, []
        try:
            for node in heap.oldest(_any_node):
                skipped.append(node)  # back in the heap if a fault cuts its turn short
                present = self._kind_cells(node, tier, row, kept)  # none: it leaves the heap
                if not np.count_nonzero(present):
                    skipped.pop()
                    continue
                if node.full_lock == 0:  # no lock runs through it: no window lock either
                    locked, mask = None, present
                else:
                    locked = node.window_lock > 0
                    mask = present & ~locked
                if locked is None or np.count_nonzero(mask):
                    if tier == DEVICE and room is not None:
                        self._spill(node, row, mask, room)
                    got += self._let_go(node, tier, row, mask, freed)
                    for other in along:
                        cells = self._free_cells(node, tier, other, kept)
                        if np.count_nonzero(cells):
                            self._let_go(node, tier, other, cells, freed)
                    if not node.children and node.full_lock == 0:
                        self._drop_dead_leaf(node, freed)
                if not (locked is not None and node.alive
                        and np.count_nonzero(present & locked)):
                    skipped.pop()  # it stays out: none of its pages of this kind is locked
                if got >= want:
                    break
        finally:  # the locked ones (and, after a fault, the one it was at) go back
            for node in skipped:
                heap.add(node)
        return got

    def _evict_leaves(self, tier: int, row: int, want: int,
                      freed: Freed, room: SpillRoom | None) -> None:
        got, skipped = 0, []
        heap = self._leaves[tier]
        wanted = ((lambda n: not n.children) if self.tiers == 1 else
                  (lambda n: self._resident(n, tier) and
                   not any(self._resident(c, tier) for c in n.children.values())))
        try:
            for node in heap.oldest(wanted):
                skipped.append(node)  # back in the heap if a fault cuts its turn short
                if node.full_lock > 0:
                    continue
                got += int(np.count_nonzero(node.slot(tier)[row] >= 0))
                if tier == DEVICE and room is not None:
                    self._spill(node, None, node.pages >= 0, room)
                if self.tiers == 1:
                    self._remove_leaf(node, freed)
                elif not node.children and not self._resident(node, self.tiers - 1 - tier):
                    parent = node.parent  # the other tier does not hold it either: it goes
                    self._remove_leaf(node, freed)
                    self._drop_dead_leaf(parent, freed)  # type: ignore[arg-type]
                else:  # it stays for the other tier (or for children only it holds)
                    self._drop_tier(node, tier, freed)
                    self._drop_dead_leaf(node, freed)
                skipped.pop()  # done with it
                if got >= want:
                    break
        finally:  # the locked ones (and, after a fault, the one it was at) go back
            for node in skipped:
                if node.alive:
                    heap.add(node)

    def _spill(self, node: Node, row: int | None, mask: np.ndarray, room: SpillRoom) -> None:
        """Write-back: device pages `mask` (one row or [pools, n]) the host lacks take
        host pages from `room` before they go."""
        host = node.slot(HOST)
        want = np.zeros(node.pages.shape, dtype=bool)
        if row is None:
            want[:] = mask
        else:
            want[row] = mask
        want &= host < 0
        if not np.count_nonzero(want):
            return
        counts = self._counts(want, node)  # read first: nothing after the table can fault
        got = room.take(node, want)
        if got is None:
            return
        host[want] = got[want]
        self._apply(counts, +1, HOST)
        self._enqueue(node)

    def _drop_tier(self, node: Node, tier: int, freed: Freed) -> None:
        """Let every page of one tier of a node go; the node stays for the other tier."""
        slot = node.slot(tier)
        pages = self._table_pages(slot)
        self._limbo = _Limbo([pages] if tier == DEVICE else [[], pages], freed, table=slot)
        slot[:] = -1  # forgotten (one numpy call), then recorded (see `_salvaging`)
        self._record(pages, tier, freed)
        self._limbo = None
        if node.parent is not None and node.parent is not self.root:
            self._leaves[tier].add(node.parent)

    def _resident(self, node: Node, tier: int) -> bool:
        """Whether a node holds its data in `tier`: its ALL pages (all or none of them are
        there), or any page in a layout without ALL pools."""
        slot = node.slot(tier)
        if self.rule.all_rows:
            return bool(slot[self.rule.all_rows[0], 0] >= 0)
        return bool(np.count_nonzero(slot >= 0))

    def _drop_dead_leaf(self, node: Node, freed: Freed) -> None:
        """Remove unlocked leaves (walking up) that no longer hold a resume point."""
        while (node is not self.root and node.parent is not None and not node.children
               and node.full_lock == 0 and self._dead(node)):
            parent = node.parent
            self._remove_leaf(node, freed)
            node = parent

    def _dead(self, node: Node) -> bool:
        """No tier holds the node, or no tier holds a resume point in it."""
        if self.tiers > 1 and not any(self._resident(node, t) for t in range(self.tiers)):
            return True
        return self.rule.has_checkpoints and self.rule.deepest(self._either(node)) == 0

    def _either(self, node: Node) -> np.ndarray:
        """A node's pages as one table: >= 0 where any tier holds the page."""
        if self.tiers == 1:
            return node.pages
        return np.maximum(node.pages, node.slot(HOST))

    def _remove_leaf(self, node: Node, freed: Freed) -> None:
        assert not node.children and node.full_lock == 0 and node.parent is not None
        pages = [self._table_pages(node.slot(tier)) for tier in range(self.tiers)]
        parent = node.parent
        key = node.key(self.page_size)
        self._limbo = _Limbo(pages, freed, node, parent, key)  # (see `_unrecorded`)
        del parent.children[key]
        node.alive = False
        node.parent = None
        self._n_nodes -= 1
        for tier in range(self.tiers):  # unlinked, then recorded (see `_salvaging`)
            self._record(pages[tier], tier, freed)
        self._limbo = None
        if parent is not self.root:
            for tier in range(self.tiers):
                if self.tiers > 1 or not parent.children:
                    self._leaves[tier].add(parent)

    def _table_pages(self, slot: np.ndarray) -> list[np.ndarray]:
        """Per pool row, the pages of a node's table of one tier (reads only)."""
        present = slot >= 0
        return [slot[row][present[row]] for row in range(self.n_pools)]

    def _unrecorded(self) -> None:
        """After a fault: the pages of a node forgotten (unlinked, or its tier's table
        cleared) but not yet recorded when it struck go to its walk's Freed now (each
        array once), and the counts are made again (`needs_repair`). A node still linked
        keeps them. Run by `_salvaging` and, for what a fault in its own sweep left, as
        the next walk begins."""
        limbo, self._limbo = self._limbo, None
        if limbo is None:
            return
        if limbo.parent is not None and limbo.parent.children.get(limbo.key) is limbo.node:
            return  # the fault came before the unlink: the node holds them still
        if limbo.table is not None and np.count_nonzero(limbo.table >= 0):
            return  # the fault came before the table was cleared: it holds them still
        if limbo.node is not None:  # unlinked: no heap may hand it to a walk again
            limbo.node.alive = False
            limbo.node.parent = None
        for tier, rows in enumerate(limbo.pages):
            for row, got in enumerate(rows):
                if got.size and not any(a is got for a in limbo.freed[tier][row]):
                    limbo.freed[tier][row].append(got)
        self.needs_repair = True  # a count may have missed them (`_record`)

    def _record(self, pages: list[np.ndarray], tier: int, freed: Freed) -> None:
        """Record per-row pages a node no longer holds as let go (the caller cleared or
        dropped them first: see `_salvaging`)."""
        held = self._held[tier]
        for row, got in enumerate(pages):
            if got.size:
                freed[tier][row].append(got)
                held[row] -= got.size

    def _count(self, mask: np.ndarray, step: int, tier: int = DEVICE,
               node: Node | None = None) -> None:
        """Adjust the per-pool page counts by the set cells of `mask` [pools, n] of `node`
        (None: a node no lock holds), pinned counts included."""
        self._apply(self._counts(mask, node), step, tier)

    def _counts(self, mask: np.ndarray, node: Node | None) -> tuple[list[int], list[int]]:
        """The set cells of `mask` per row, held and pinned (see `_count`); reads only."""
        held = [int(k) for k in np.count_nonzero(mask, axis=1)]
        pinned = [0] * self.n_pools
        if node is None or node.full_lock == 0:
            return held, pinned
        for row in self.full_pin_rows:
            pinned[row] = held[row]
        if self.window_pin_rows:
            locked = node.window_lock > 0
            for row in self.window_pin_rows:
                pinned[row] = int(np.count_nonzero(mask[row] & locked))
        return held, pinned

    def _apply(self, counts: tuple[list[int], list[int]], step: int, tier: int) -> None:
        held, pinned = self._held[tier], self._pinned[tier]
        for row, (k, p) in enumerate(zip(*counts, strict=True)):
            held[row] += step * k
            pinned[row] += step * p

    def _locked_rest(self, node: Node, tier: int, row: int, kept: bool) -> bool:
        """After its free cells of a kind went (`_free_cells`): whether the node is alive and
        still holds pages of that kind, which only a window lock can keep (no lock: none)."""
        return node.alive and node.full_lock > 0 and bool(
            np.count_nonzero(node.window_lock)) and self._has(node, tier, row, kept)

    def _has(self, node: Node, tier: int, row: int, kept: bool) -> bool:
        return bool(np.count_nonzero(self._kind_cells(node, tier, row, kept)))

    def _enqueue(self, node: Node, changed: np.ndarray | None = None) -> None:
        """Make `node` a candidate in the LRU heaps that may want it; with `changed`
        ([pools, n]: the cells that just gained a page or a keep mark), in a short-lived
        row's loose (kept) heap only where a changed cell of the row is loose (kept). One
        tier: its loose and kept pages appear no other way, and a heap that dropped it
        found none.

        Cheap on purpose: a heap checks on pop whether the node still holds
        pages of its kind and drops it if not.
        """
        if self.tiers == 1:
            if not node.children:
                self._leaves[0].add(node)
            loose, kept = self._loose[0], self._kept[0]
            for row in self.short_lived_rows:
                if changed is None:
                    loose[row].add(node)
                    kept[row].add(node)
                    continue
                marks = node.keep[row]
                if np.count_nonzero(changed[row] & ~marks):
                    loose[row].add(node)
                if np.count_nonzero(changed[row] & marks):
                    kept[row].add(node)
            return
        for tier in range(self.tiers):
            self._leaves[tier].add(node)
            for row in self.short_lived_rows:
                self._loose[tier][row].add(node)
                self._kept[tier][row].add(node)


def _any_node(node: Node) -> bool:
    """A heap's `wanted` for a caller that judges each node itself."""
    return True


class _Walk:
    """One LRU walk of `_evict_older`: whole unlocked leaves (row None), or the nodes with
    unlocked kept (kept) or loose (not kept) pages in short-lived pool `row`. `node` is the
    next one (None: the walk is over); locked nodes go to `skipped`. Each node it popped
    left its heap (and only that one): `requeue` puts back those still candidates."""

    def __init__(self, tree: Eviction, row: int | None, kept: bool) -> None:
        self.tree, self.row, self.kept = tree, row, kept
        self.skipped: list[Node] = []
        if row is None:
            self.heap = tree._leaves[DEVICE]
            self.it: Iterator[Node] = self.heap.oldest(lambda n: not n.children)
        else:
            self.heap = (tree._kept if kept else tree._loose)[DEVICE][row]
            self.it = self.heap.oldest(lambda n: tree._has(n, DEVICE, row, kept))
        self.node: Node | None = None

    def requeue(self) -> None:
        """The walk is over: its locked nodes and its next one go back to its heap."""
        for node in (*self.skipped, *((self.node,) if self.node is not None else ())):
            if node.alive:
                self.heap.add(node)

    def advance(self) -> None:
        for node in self.it:
            self.node = node  # `requeue` puts it back should what follows fault
            # A row's walk only meets nodes with cells of its kind (its `wanted`): with no
            # lock through the node (so no window lock) they are all free.
            locked = node.full_lock > 0 and (self.row is None or not np.count_nonzero(
                self.tree._free_cells(node, DEVICE, self.row, self.kept)))
            if not locked:
                return
            self.skipped.append(node)
        self.node = None


class _Tally:
    """Bytes let go in a device `Freed` whose rows it makes: each row adds what is appended
    to it, so asking costs O(1) however often."""

    def __init__(self, page_bytes: list[int]) -> None:
        self.total = 0
        self.rows: list[list[np.ndarray]] = [_Row(self, b) for b in page_bytes]

    def __call__(self) -> int:
        return self.total


class _Row(list[np.ndarray]):
    """One pool row of a `_Tally`'s Freed. Only `append` counts: every writer of a Freed
    appends (extend, += or insert would bypass the tally)."""

    __slots__ = ("page_bytes", "tally")

    def __init__(self, tally: _Tally, page_bytes: int) -> None:
        super().__init__()
        self.tally, self.page_bytes = tally, page_bytes

    def append(self, pages: np.ndarray) -> None:
        super().append(pages)
        self.tally.total += pages.size * self.page_bytes


@dataclass(slots=True)
class _Limbo:
    """A node's pages per tier and row, forgotten (or about to be: unlinked from `parent`
    under `key`, or one tier's `table` cleared) and not yet recorded."""

    pages: list[list[np.ndarray]]
    freed: Freed  # the walk's: its owner frees what it holds (see `_salvaging`)
    node: Node | None = None
    parent: Node | None = None
    key: bytes = b""
    table: np.ndarray | None = None
