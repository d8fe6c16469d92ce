"""One ShadowRadix tree over one allocator per pool and tier.

This is the composition every caller starts from (the engine, the simulator,
the benchmarks): device pools (L1) and, with `host_pages`, host pools (L2) that
mirror them. It owns the pools and the tree and keeps their books in step:
pages the tree lets go are freed here, never by the caller. It moves no bytes;
HostTier does (tiers/host_tier.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.pool.allocator import PAGE_DTYPE, PagePool, page_count
from shadowradix.pool.arena import Arena, ArenaPool
from shadowradix.tree.node import Node
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.radix import ShadowRadix
from shadowradix.tree.results import (
    EvictResult,
    InsertResult,
    LockHandle,
    MatchResult,
    Peek,
    joined,
)
from shadowradix.tree.spill import SpillRoom
from shadowradix.tree.stats import TreeStats
from shadowradix.tree.tier import DEVICE, HOST

log = logging.getLogger(__name__)

COMPACT_ROUNDS = 8  # frames a lock holds, set aside, before a pool's compaction gives up
# Before evicting for frames, a pool compacts once the holes in its frames make 1/this of
# the arena's frames (at least one): fewer, larger compactions, and at most that share of
# the arena left in holes per pool. On the conversation trace (benchmarks/arena.py) 1024
# costs 0.04 points of hit rate at 32 GB and none at 256 GB, and cuts the time spent per
# allocation by 10% and 20%.
COMPACT_SHARE = 1024


def _sizes(layout: KVLayout, pages: int | Mapping[str, int]) -> dict[str, int]:
    sizes = {p.name: pages for p in layout.pools} if isinstance(pages, int) else dict(pages)
    missing = set(layout.pool_names) - set(sizes)
    if missing:
        raise ValueError(f"no page count for pools {sorted(missing)}")
    return sizes


def _pools(layout: KVLayout, sizes: dict[str, int], device: Any, pin_memory: bool = False,
           in_host_memory: Collection[str] = ()) -> dict[str, PagePool]:
    cuda = device is not None and str(device).startswith("cuda")
    pools = {}
    for spec in layout.pools:
        if spec.name not in sizes:
            continue
        storage = None
        if device is not None:
            from shadowradix.pool.storage import PoolStorage

            where, pin = device, pin_memory
            if spec.name in in_host_memory:
                where, pin = "cpu", cuda
            storage = PoolStorage(spec, layout.page_size, sizes[spec.name], where, pin)
        pools[spec.name] = PagePool(spec, layout.page_size, sizes[spec.name], storage)
    return pools


class PrefixCache:
    """Tree plus pools. `pages` sizes every device pool alike (int) or each by name;
    `host_pages` likewise adds host pools (L2), in CPU memory (pinned when `device`
    is CUDA) when the device pools have tensors.

    `budget` (bytes; metadata-only pools, no host tier): the device pools share one byte
    budget instead of each owning a fixed share. `pages` are then only ceilings (see
    sim/sizing.py `pages_for_shared_budget`); allocation evicts across pools
    (ShadowRadix.evict_bytes) to stay under the budget, so the window pool grows and
    shrinks against the others with what the workload uses.

    `in_host_memory`: device-tier pools whose tensors live in CPU memory (pinned when
    `device` is CUDA). The tree treats them as any L1 pool; HiSparse keeps the C4 pool
    there and only hot copies of its entries on the device.

    `arena` (pool/arena.py): the device pools (all but `in_host_memory`) draw their pages
    from its frames, with or without tensors, host tier or not; `pages` then sizes only
    the pools in host memory. Allocation evicts until the frames the pages need are free
    (`_make_frames`)."""

    def __init__(self, layout: KVLayout, pages: int | Mapping[str, int],
                 policy: CheckpointPolicy | None = None, device: Any = None,
                 host_pages: int | Mapping[str, int] | None = None,
                 budget: int | None = None, in_host_memory: Collection[str] = (),
                 arena: Arena | None = None) -> None:
        if budget is not None and (isinstance(budget, bool)
                                   or not isinstance(budget, int | np.integer)):
            raise ValueError(f"budget must be an int number of bytes, got {budget!r}")
        if budget is not None and (device is not None or host_pages is not None or budget < 0
                                   or arena is not None):
            raise ValueError("a shared budget needs metadata-only device pools (device=None), "
                             "no host tier, no arena, and budget >= 0")
        self.layout = layout
        self.budget = budget
        self.arena = arena
        self._page_bytes = layout.page_bytes()
        self._row_bytes = [self._page_bytes[p.name] for p in layout.pools]
        self.tree = ShadowRadix(layout, policy, host=host_pages is not None)
        self.pools: dict[str, PagePool | ArenaPool]
        self._arena_pools: dict[str, ArenaPool] = {}
        if arena is None:
            self.pools = dict(_pools(layout, _sizes(layout, pages), device,
                                     in_host_memory=in_host_memory))
        else:
            on_device = set(layout.pool_names) - set(in_host_memory)
            if set(arena.names) != on_device:
                raise ValueError(f"the arena holds pools {sorted(arena.names)}; the device "
                                 f"pools are {sorted(on_device)}")
            self._arena_pools = arena.pools()
            self._arena_rows = [(n, layout.index(n), p) for n, p in self._arena_pools.items()]
            apart = {n: pages if isinstance(pages, int) else pages[n] for n in in_host_memory}
            self.pools = {**_pools(layout, apart, device, in_host_memory=in_host_memory),
                          **self._arena_pools} if apart else dict(self._arena_pools)
            self.pools = {n: self.pools[n] for n in layout.pool_names}
            self._owners = self.tree.track_owners({n: p.num_pages for n, p in self.pools.items()})
            # Bytes an eviction counts: a pool in host memory frees no frame.
            self._arena_row_bytes = [b if p.name in self._arena_pools else 0
                                     for p, b in zip(layout.pools, self._row_bytes, strict=True)]
            # Pool by pool, when the walk by age cannot free frames: short-lived first.
            self._arena_order = sorted(self._arena_pools.values(), key=lambda p: (
                p.spec.retention is Retention.ALL, -self._page_bytes[p.name]))
        self.host_pools: dict[str, PagePool | ArenaPool] = {}
        if host_pages is not None:
            cuda = device is not None and str(device).startswith("cuda")
            self.host_pools = dict(_pools(layout, _sizes(layout, host_pages),
                                          None if device is None else "cpu", pin_memory=cuda))
        self.evicted = {name: 0 for name in layout.pool_names}
        self.evicted_host = {name: 0 for name in layout.pool_names}
        self.moved = {name: 0 for name in layout.pool_names}  # pages an arena's compaction moved
        self.compact_seconds = 0.0
        self.compact_share = COMPACT_SHARE  # see COMPACT_SHARE
        # Arena frames a host copy may still read or write (a HostTier over this cache
        # sets it): compaction leaves them be. None with a host tier: no compaction.
        self.frames_in_flight: Callable[[], list[int]] | None = None
        self.evict_seconds = 0.0  # time spent in eviction, for benchmarks
        # Pages to free, in order: (tier, pool, pages, evicted: let go by the tree) or a
        # tree walk's Freed ([tier][pool row] -> arrays). The tree's `stranded` itself:
        # every walk is in it from its start (`sink_walks`), so no fault between a walk
        # and its release loses a page. See `release`.
        self.tree.sink_walks = True
        self._unreleased: list[Any] = self.tree.stranded
        # Run first by the next operation (`_mend`): hand-overs a fault cut short, whose
        # owner finishes them before anything may evict what the tree adopted
        # (CacheManager); each does nothing once its owner finished it.
        self.settle_first: list[Callable[[], None]] = []
        self._unlocking: list[LockHandle] = []  # unlocks under way (see `unlock`)
        self._transient: list[LockHandle] = []  # locks of one call (see `lock`)
        self.alloc_seconds = 0.0  # time spent in alloc (eviction included), for benchmarks
        self.allocs = 0
        self.release_errors = 0  # page ids a queued release dropped: see `_drop_freed`

    @property
    def has_host(self) -> bool:
        return bool(self.host_pools)

    def tier_pools(self, tier: int) -> dict[str, PagePool | ArenaPool]:
        return self.pools if tier == DEVICE else self.host_pools

    def tensor(self, pool: str, tier: int = DEVICE) -> Any:
        """The [layers, pages, ...] tensor behind one pool of one tier."""
        storage = self.tier_pools(tier)[pool].storage
        if storage is None:
            raise ValueError(f"pool {pool!r} is metadata-only (no tensors)")
        return storage.data

    # --------------------------------------------------------------- reuse
    def match(self, tokens: Sequence[int] | np.ndarray, *, record: bool = True) -> MatchResult:
        """The tree's match (see ShadowRadix.match_prefix); a node tail its splits left
        with no resume point goes at once."""
        self._mend()
        m = self.tree.match_prefix(tokens, record=False)
        if m.tail is not None:
            self.prune(m.tail)
        if record:
            self.record(m)
        return m

    def record(self, m: MatchResult) -> None:
        """Count a match that goes ahead (see ShadowRadix.record), pruning as `match`."""
        tail = self.tree.record(m)
        if tail is not None:
            self.prune(tail)

    def peek(self, tokens: Sequence[int] | np.ndarray) -> Peek:
        """A match without side effects (see ShadowRadix.peek)."""
        return self.tree.peek(tokens)

    def lock(self, target: MatchResult | InsertResult, *, transient: bool = False,
             into: list[LockHandle] | None = None) -> LockHandle:
        """Lock the prefix a match returned, or the one an insert just stored. `into`:
        the owner's list of handles, which gets it before the lock walk starts (see
        `ShadowRadix.lock`): the owner unlocks what its list holds unreleased, so an
        interrupt as the lock returns never pins the prefix for good. A `transient` lock
        (one call's, as an L3 landing's) goes into the cache's own list instead; its owner
        calls `begin_transient` before and `end_transient` after: should the end be cut
        short, the cache's next operation (or, before it began, the next such call)
        releases it, so it never pins the prefix for good either."""
        return self.tree.lock(target.node, self._transient if transient else into)

    def begin_transient(self) -> None:
        """A call that takes transient locks starts (one at a time: an L3 landing). Locks
        still here belong to calls that are over, whose end was cut short before it
        began: they expire now (the next operation releases them)."""
        for handle in self._transient:
            handle.expired = True

    def end_transient(self) -> None:
        """The call is done with its transient locks: all are marked expired, then
        unlocked. Cut short, the cache's next operation finishes it."""
        self.begin_transient()  # (expires them all)
        for handle in list(self._transient):
            if not handle.released:
                self.unlock(handle)

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock; a node it leaves an unlocked leaf with no resume point (a failed
        copy's pages were forgotten while it was locked) goes, with its pages."""
        self._unlocking.append(handle)  # a fault in the unlock: `_mend` finishes it
        self.tree.unlock(handle)
        self._unlocking.remove(handle)
        if handle in self._transient:
            self._transient.remove(handle)
        self.prune(handle.node)

    def prune(self, node: Node) -> None:
        """Drop `node` (and ancestors) while it is an unlocked leaf no tier can resume
        from, freeing its pages; anything else stays."""
        try:
            result = self.tree.prune(node)
        except BaseException:  # the dead leaf may stay: the next operation sweeps it
            self.tree.needs_sweep = True
            raise
        if result is not None:
            self.release(result)

    # ---------------------------------------------------------- allocation
    def can_alloc(self, need: Mapping[str, int], tier: int = DEVICE) -> bool:
        """Whether `alloc(need, tier)` would succeed: free plus evictable pages cover every
        pool. Changes nothing."""
        self._check_need(need, self.tier_pools(tier))
        return self._can_alloc(need, tier)

    def _can_alloc(self, need: Mapping[str, int], tier: int) -> bool:
        """`can_alloc` for a `need` already checked."""
        pools, tree = self.tier_pools(tier), self.tree
        shared = self._arena_pools if tier == DEVICE else {}  # frames any pool may free
        for name, n in need.items():
            if n > 0 and name not in shared and pools[name].free_pages + tree.evictable(
                    name, tier) < n:
                return False
        if shared:
            return self._frames_within_reach(need)
        if self.budget is None or tier != DEVICE:
            return True
        evictable = sum(tree.evictable(name) * self._page_bytes[name] for name in pools)
        return self._short_bytes(need) <= evictable

    def arena_bytes(self) -> dict[str, int] | None:
        """The arena's bytes per pool (the frames it holds) and "free"; None without an
        arena. O(pools)."""
        if self.arena is None:
            return None
        fb = self.arena.plan.frame_bytes
        return {**{n: p.frames_held * fb for n, p in self._arena_pools.items()},
                "free": self.arena.free_frames * fb}

    def frames_short(self, need: Mapping[str, int]) -> int:
        """Arena frames `need` takes beyond its pools' free slots and the free frames (0
        without an arena, or when it fits now)."""
        if self.arena is None:
            return 0
        return max(self.arena.frames_short(self._arena_pools, need), 0)

    def pages_per_frame(self, pool: str) -> int:
        """Pages of `pool` an arena frame holds (0 for a pool not in an arena)."""
        arena_pool = self._arena_pools.get(pool)
        return 0 if arena_pool is None else arena_pool.per_frame

    def arena_frames_of(self, pool: str, ids: np.ndarray) -> np.ndarray | None:
        """The arena frames that device pages `ids` of `pool` lie in (their bytes: pages of
        other pools take a frame after it goes back); None for a pool not in an arena."""
        arena_pool = self._arena_pools.get(pool)
        if arena_pool is None:
            return None
        return np.asarray(ids, dtype=np.int64) // arena_pool.per_frame

    def fits_arena(self, pages: Mapping[str, int], spread: Collection[str] = ()) -> bool:
        """Whether `pages` (per pool) fit in an empty cache: in the arena's frames, and in
        the pools of their own (in host memory). Pages of a pool in `spread` count a frame
        each: a request's window and state pages come and go while the tree's copies of the
        pages before them stay, so they may sit one to a frame; its ALL pages it allocates
        in order, at most one frame part-filled."""
        assert self.arena is not None
        if any(self.pools[n].num_pages < k for n, k in pages.items()
               if n not in self._arena_pools):
            return False
        return self.arena_frames(pages, spread) <= self.arena.frames

    def arena_frames(self, pages: Mapping[str, int], spread: Collection[str] = ()) -> int:
        """The arena frames `pages` (per pool) take: a frame each for a pool in `spread`,
        packed for the others (see `fits_arena`); pools not in the arena take none."""
        assert self.arena is not None
        return self.arena.plan.frames(pages, spread)

    def _frames_within_reach(self, need: Mapping[str, int]) -> bool:
        """Arena: whether `need` would fit were every evictable page gone and the rest
        packed tight. Eviction frees a frame only once all its pages go, so `alloc` may
        still come up short (it then returns None); this never refuses what could fit."""
        assert self.arena is not None
        held = frames = 0
        evictable = self.tree.evictable_rows()
        for name, row, pool in self._arena_rows:
            k = pool.per_frame
            kept = -(-(pool.used_pages - evictable[row]) // k)  # frames, packed tight
            held += kept
            spare = kept * k - pool.used_pages + evictable[row]
            n = need.get(name, 0)
            if n > spare:
                frames += -(-(n - spare) // k)
        return held + frames <= self.arena.frames

    def _make_frames(self, need: Mapping[str, int], room: SpillRoom | None) -> bool:
        """Arena: evict until the frames `need` takes beyond its pools' free slots are
        free. Without a host tier, across pools by age (`evict_bytes`, as under a byte
        budget); with one, or where that walk frees nothing, pool by pool: the short-lived
        pools first, then whole prefixes (device pages then stay reusable from the host).
        False when eviction runs dry first."""
        assert self.arena is not None
        arena, fb = self.arena, self.arena.plan.frame_bytes
        pools = self._arena_pools
        compacts = not self.has_host or self.frames_in_flight is not None
        least = max(1, arena.frames // self.compact_share)
        while (short := arena.frames_short(pools, need)) > 0:
            if compacts and self.compact(short, need, self._frames_busy(room), least):
                continue  # each frame it gave back is one fewer short
            before = sum(p.used_pages for p in pools.values())
            if not self.has_host:
                t0 = time.perf_counter()
                self.release(self.tree.evict_bytes(short * fb, self._arena_row_bytes))
                self.evict_seconds += time.perf_counter() - t0
            if sum(p.used_pages for p in pools.values()) == before:
                # A host tier, or what the walk by age cannot reach (kept checkpoints inside
                # a running request's own locked prefix): pool by pool.
                for pool in self._arena_order:
                    if arena.frames_short(pools, need) <= 0:
                        break
                    self.evict(pool.name, short * pool.per_frame, DEVICE, room)
            if sum(p.used_pages for p in pools.values()) == before:
                # The last resort: the holes compaction waits on (fewer than `least`).
                if compacts and least > 1 and self.compact(short, need,
                                                           self._frames_busy(room)):
                    continue
                return False
        return True

    def _frames_busy(self, room: SpillRoom | None) -> list[int]:
        """Arena frames compaction must not touch: those a host copy in flight may read
        or write, and those of the device pages a write-back `room` took (freed, their
        bytes wait for the copy submitted once the allocation is over)."""
        busy = [] if self.frames_in_flight is None else list(self.frames_in_flight())
        for name, dev, _ in room.copies() if room is not None else ():
            frames = self.arena_frames_of(name, dev)
            if frames is not None:
                busy.extend(np.unique(frames).tolist())
        return busy

    def compact(self, frames: int, need: Mapping[str, int] | None = None,
                busy: Collection[int] = (), least: int = 1) -> int:
        """Arena: move the tree's unlocked device pages out of the emptiest frames of a
        pool into the free slots of its others, until `frames` frames went back to the
        arena or no pool can give back a frame without a lock in the way; the frames that
        went back. A frame is left whole where a lock holds one of its pages (the next
        emptiest goes instead). With `need` (pages per pool about to be allocated), a pool
        keeps the free slots it needs: a frame it gave back would only be taken again.
        With `least` > 1, a pool compacts only once its free slots (beyond `need`) make
        that many frames, and then gives back all of them: each compaction's cost is
        mostly O(frames), so waiting for holes to gather (`_make_frames` waits for
        1/`compact_share` of the arena per pool) spends it on many frames at once.
        The bytes move with the pages (a device copy); nothing a request holds moves, and
        a fault leaves every page where it was. Frames in `busy` (see `_frames_busy`) give
        no page and take none. O(tree) per pool it compacts."""
        assert self.arena is not None
        t0 = time.perf_counter()
        start = self.arena.free_frames
        try:
            for name, pool in self._arena_pools.items():
                got = self.arena.free_frames - start
                if got >= frames:
                    break
                spare = (pool.slots_free - (need or {}).get(name, 0)) // pool.per_frame
                if spare >= least and min(spare, frames - got) >= 1:
                    self._compact_pool(name, pool, spare if least > 1 else
                                       min(spare, frames - got), busy)
        finally:
            self.compact_seconds += time.perf_counter() - t0
        return self.arena.free_frames - start

    def _compact_pool(self, name: str, pool: ArenaPool, frames: int,
                      busy: Collection[int] = ()) -> None:
        """Give up to `frames` of `pool`'s frames back (see `compact`)."""
        row, k = self.layout.index(name), pool.per_frame
        locked: set[int] = set()  # frames a lock holds a page of
        pages = np.empty(0, PAGE_DTYPE)
        for _ in range(COMPACT_ROUNDS):
            pages = pool.sparse(frames, locked, busy)
            ok, owners = self._owners.movable(row, pages)
            if ok.all():
                break
            frame = pages // k
            locked.update(np.unique(frame[~ok]).tolist())
        else:  # the frames no lock holds of the last choice
            pages = pages[~np.isin(pages // k, np.fromiter(locked, np.int64, len(locked)))]
            _, owners = self._owners.movable(row, pages)
        if pages.size == 0:
            return
        new = pool.claim(pages, busy)
        done = (DEVICE, name, pages, False)  # the old ids to free once the tree names `new`
        try:  # the bytes first: nothing names `new` until the rename, which checks every
            self.copy_pages(name, pages, new)  # id before it changes any
            self._owners.relocate(row, owners, new)
            self._unreleased.append(done)
        except BaseException:  # `pages` hold the bytes; the tree names them again
            if self._unreleased and self._unreleased[-1] is done:
                raise  # (a fault after the move was whole: it stays)
            try:  # (an interrupt may have cut the rename short: renaming back is idempotent)
                self._owners.relocate(row, owners, pages)
                pool.unclaim(new)
            except BaseException:  # in use, nobody's: they go at the next release
                self._unreleased.append((DEVICE, name, new, False))
            raise
        self.moved[name] += int(pages.size)
        self._release_pending()

    def copy_pages(self, name: str, old: np.ndarray, new: np.ndarray) -> None:
        """Device pages' bytes from `old` to `new` ids of one pool, for a compaction (on
        the current stream: in order with the forwards before and after). A no-op for
        metadata-only pools."""
        if self.pools[name].storage is None:
            return
        import torch

        data = self.tensor(name)
        src = torch.as_tensor(old.astype(np.int64), device=data.device)
        dst = torch.as_tensor(new.astype(np.int64), device=data.device)
        data[:, dst] = data[:, src]

    def _short_bytes(self, need: Mapping[str, int]) -> int:
        """Shared budget: bytes that must be let go before `need` fits (<= 0: none)."""
        assert self.budget is not None
        return self.used_bytes() + self.bytes_of(need) - self.budget

    def bytes_of(self, pages: Mapping[str, int]) -> int:
        """The bytes of `pages` (a count per pool; counts below 0 count none)."""
        pb = self._page_bytes
        return sum(n * pb[name] for name, n in pages.items() if n > 0)

    def used_bytes(self, tier: int = DEVICE) -> int:
        """Bytes of the pages in use in one tier's pools."""
        return self.bytes_of({name: pool.used_pages
                              for name, pool in self.tier_pools(tier).items()})

    def alloc(self, need: Mapping[str, int], tier: int = DEVICE,
              room: SpillRoom | None = None) -> dict[str, np.ndarray] | None:
        """Pages of one tier, evicting unlocked cache of that tier where a pool is short
        (device pages the eviction drops move into `room`'s host pages: write-back).

        Checks first: returns None, changing nothing, when free plus evictable pages do
        not cover some pool (`can_alloc`). Over an arena it may also return None after
        evicting, when the frames could not be freed (pages of running requests spread
        over them).
        """
        self._check_need(need, self.tier_pools(tier))
        self._mend()
        t_alloc = time.perf_counter()
        try:
            return self._alloc(need, tier, room)
        finally:
            self.alloc_seconds += time.perf_counter() - t_alloc
            self.allocs += 1

    @staticmethod
    def _check_need(need: Mapping[str, int], pools: Mapping[str, Any]) -> None:
        """ValueError for a pool not in the tier or a count not an int >= 0."""
        for name, n in need.items():
            if name not in pools:
                raise ValueError(f"no pool {name!r} in this tier; pools: {', '.join(pools)}")
            page_count(name, n)

    def _alloc(self, need: Mapping[str, int], tier: int,
               room: SpillRoom | None) -> dict[str, np.ndarray] | None:
        self._release_pending()
        if not self._can_alloc(need, tier):
            return None
        pools = self.tier_pools(tier)
        if self.arena is not None and tier == DEVICE and not self._make_frames(need, room):
            return None
        if self.budget is not None and tier == DEVICE:
            short = self._short_bytes(need)
            if short > 0:
                t0 = time.perf_counter()
                self.release(self.tree.evict_bytes(short, self._row_bytes))
                self.evict_seconds += time.perf_counter() - t0
        for name, n in need.items():  # evicting one pool never shrinks another's free list
            short = n - pools[name].free_pages
            if short > 0:
                self.evict(name, short, tier, room)
        if any(not pools[name].can_alloc(n) for name, n in need.items()):
            raise AssertionError(f"eviction delivered less than evictable() promised for {need}")
        if self.budget is not None and tier == DEVICE and self._short_bytes(need) > 0:
            raise AssertionError(f"eviction left the shared budget short for {need}")
        got: dict[str, np.ndarray] = {}
        try:
            for name, n in need.items():
                got[name] = pools[name].alloc(n)
        except BaseException:  # a fault in one pool: the pages of those before go back
            self.free(got, tier)
            raise
        return got

    def free(self, pages: Mapping[str, np.ndarray], tier: int = DEVICE) -> None:
        """Return pages nobody shadows, per pool (real ids only, no -1). Pool by pool: a
        fault in one leaves the pools before it freed (each pool's free is atomic)."""
        pools = self.tier_pools(tier)
        for name, ids in pages.items():
            if len(ids):
                pools[name].free(ids)

    def insert(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray,
               start: int = 0, *, finished: bool = True, tier: int = DEVICE,
               prompt: int | None = None) -> InsertResult:
        """Hand a request's own pages of `tier` for [start, ...) to the tree (see
        ShadowRadix.insert); the ones it does not adopt are freed here. ValueError
        (changing nothing) for an id that is not a page of its pool in use, or one given
        twice."""
        self._check_own(pages, tier)
        result = self.tree.insert(tokens, pages, start, finished=finished, tier=tier,
                                  prompt=prompt)
        # Queued in one step before any is freed: a fault in one pool's free leaves the
        # rest for the next release.
        self._unreleased.extend([(tier, name, ids, False)
                                 for name, ids in result.to_free.items() if ids.size])
        self._release_pending()
        if result.tail is not None:
            self.prune(result.tail)
        return result

    def give_up(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray, start: int,
                tier: int = DEVICE) -> None:
        """After an `insert` of `pages` (for [start, ...)) that raised: it may have adopted
        some (a fault halfway), which are the tree's; the caller gives up the rest, freed
        at the next release. The tree makes again what it derives from its nodes. When
        even reading the tree faults, all count as the tree's (a leak at worst, never a
        page with two owners)."""
        table = np.asarray(pages)
        if table.ndim != 2 or not table.size:
            return
        mine = table.astype(PAGE_DTYPE)
        adopted, _ = self.tree.adopted(tokens, mine, start, tier)
        lost = (mine >= 0) & ~adopted
        pools = self.tier_pools(tier)
        for row, name in enumerate(self.layout.pool_names):  # nor those the insert queued
            if not lost[row].any():                        # or freed (a fault after the
                continue                                   # tree's insert itself)
            ids = mine[row][lost[row]]
            gone = ~pools[name].in_use(ids)
            pending = self._pending_pages(tier, name)
            if pending:
                gone |= np.isin(ids, np.concatenate(pending))
            lost[row][lost[row]] = ~gone
        self._unreleased.extend([(tier, name, mine[row][lost[row]], False)
                                 for row, name in enumerate(self.layout.pool_names)
                                 if lost[row].any()])
        self.tree.repair(after_fault=True)

    def _check_own(self, pages: np.ndarray, tier: int) -> None:
        """The ids >= 0 of a [pools, n] table must be pages of their pools in use, each
        once (the tree checks the shape: anything else is left to it)."""
        table = np.asarray(pages)
        if table.ndim != 2 or table.shape[0] != len(self.layout.pools) or not table.size:
            return
        if not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"page ids must be integers, got {table.dtype}")
        pools = self.tier_pools(tier)
        for row, name in enumerate(self.layout.pool_names):
            ids = table[row][table[row] >= 0]
            if not ids.size:
                continue
            pool = pools[name]
            bad = ids >= pool.num_pages
            bad[~bad] = ~pool.in_use(ids[~bad])
            if bad.any():
                raise ValueError(f"pool {name!r}: insert of page ids not in use: "
                                 f"{ids[bad][:8].tolist()}")
            if np.unique(ids).size != ids.size:
                raise ValueError(f"pool {name!r}: insert of a page id twice")

    def evict(self, pool: str, num_pages: int, tier: int = DEVICE,
              room: SpillRoom | None = None) -> int:
        """Evict at least `num_pages` of `pool` from `tier` if possible; returns how many of
        `pool` left that tier. With `room`, dropped device pages move to its host pages."""
        self._mend()
        t0 = time.perf_counter()
        result = self.tree.evict(pool, num_pages, tier, room)
        self.release(result)
        self.evict_seconds += time.perf_counter() - t0
        return (result.freed_host if tier == HOST else result.freed)[pool].size

    def release(self, result: EvictResult) -> None:
        """Free the pages an eviction (or prune / unspill) let go, in both tiers. The tree
        has forgotten them: if a free raises, they and the rest wait in `_unreleased` (still
        in use, owned by the cache) and go back at the next release or allocation. A
        result of this tree's walks is there already (`queued`)."""
        if not result.queued:
            self._queue(result)
        self._release_pending()

    @property
    def release_queue(self) -> list[Any]:
        """Pages let go and not yet freed: (tier, pool, pages, evicted) entries (and walks'
        Freed lists), freed in order at the next release. A holder that lets go of pages
        appends them here in the statement that lets go (`q[len(q):], held = [entry], None`),
        so an interrupt finds them held or queued, never lost nor freed twice; then
        `release_queued` frees them."""
        return self._unreleased

    def release_queued(self) -> None:
        """Free what `release_queue` holds (a fault leaves the rest for the next release)."""
        self._release_pending()

    def _queue(self, result: EvictResult) -> None:
        for tier, freed in ((DEVICE, result.freed), (HOST, result.freed_host)):
            for name, pages in freed.items():
                if pages.size:
                    self._unreleased.append((tier, name, pages, True))

    def _release_pending(self) -> None:
        pending = self._unreleased
        while pending:
            head = pending[0]
            if isinstance(head, list):  # a walk's Freed: one entry per pool, in one step
                pending[0:1] = self._entries(head)
                continue
            pending.pop(0)  # before the free: a fault between leaks, never frees twice
            tier, name, pages, evicted = head
            try:
                self.tier_pools(tier)[name].free(pages)  # atomic
            except BaseException as err:  # nothing freed: it waits for the next release
                pending.insert(0, head)
                if isinstance(err, ValueError):  # unless it never would (`_drop_freed`)
                    good = self._drop_freed(tier, name, pages)
                    if good is not None:
                        pending[0] = (tier, name, good, evicted)
                        continue
                raise
            if evicted:
                (self.evicted if tier == DEVICE else self.evicted_host)[name] += pages.size

    def _drop_freed(self, tier: int, name: str, pages: np.ndarray) -> np.ndarray | None:
        """A queued release a pool refused (ValueError): the pages to free instead, when
        some of `pages` are not in use or not pages of the pool (None: all are; the
        refusal was something else). Only a bug puts such an id in the queue (a page freed
        twice); retried, it would make every later release raise and the cache stop
        serving, so those ids are dropped with an error logged (and counted in
        `release_errors`)."""
        pool = self.tier_pools(tier)[name]
        ids = np.asarray(pages).ravel()
        ok = np.zeros(ids.size, dtype=bool)
        if np.issubdtype(ids.dtype, np.integer):
            inside = (ids >= 0) & (ids < pool.num_pages)
            ok[inside] = pool.in_use(ids[inside])
        good = np.unique(ids[ok]).astype(PAGE_DTYPE)
        dropped = ids.size - good.size
        if not dropped:
            return None
        self.release_errors += dropped
        log.error("pool %r (%s): %d page id(s) queued for release were not in use or not "
                  "pages of the pool (freed twice: a bug); dropped (e.g. %s), %d freed",
                  name, "device" if tier == DEVICE else "host", dropped,
                  np.setdiff1d(ids, good)[:8].tolist(), good.size)
        return good

    def _mend(self) -> None:
        """Finish what a fault cut short twice (the change, then its mending): the tree's
        derived state (`repair`), the dead leaves a walk left (`sweep`, its pages queued
        to be freed), the rollback of a failed lock (`finish_rollbacks`); and unlocks a
        fault cut short (a lock nobody would retry, as a landing's, would pin its pages
        for good), and transient locks whose owner is done with them but whose unlock
        never ran. Run where an operation starts (match, alloc, evict, check_integrity),
        never inside a hand-over: a running request's new leaf, not locked yet, has no
        resume point."""
        while self.settle_first:
            self.settle_first[0]()
            self.settle_first.pop(0)
        tree = self.tree
        if tree.needs_repair:
            tree.repair()
        if tree.needs_sweep:
            tree.sweep()  # queued in `_unreleased` as it begins (sink_walks)
        if tree.unwinding:  # a failed lock whose rollback faulted too
            for node in tree.finish_rollbacks():
                self.prune(node)
        if self._transient:  # (one at most, while a landing runs)
            for handle in [h for h in self._transient if h.expired or h.released]:
                self._transient.remove(handle)  # its owner is done: an unlock never ran
                if not handle.released and handle not in self._unlocking:
                    self._unlocking.append(handle)
        while self._unlocking:  # unlocks a fault cut short (whoever asked may retry too)
            handle = self._unlocking[0]
            if not handle.released:
                tree.unlock(handle)  # resumes where it stopped
            self._unlocking.pop(0)
            self.prune(handle.node)

    def _entries(self, freed: list[list[list[np.ndarray]]]) -> list[Any]:
        """A walk's Freed as `_unreleased` entries (tier, pool, pages, evicted)."""
        names = self.layout.pool_names
        out = []
        for tier, rows in enumerate(freed):
            for row, arrays in enumerate(rows):
                pages = joined(arrays)
                if pages.size:
                    out.append((tier, names[row], pages, True))
        return out

    def flush(self, tier: int = DEVICE, room: SpillRoom | None = None) -> None:
        """Drop every unlocked page the tree holds in `tier` (device pages into `room`)."""
        pools = self.tier_pools(tier)
        for name in self.layout.pool_names:
            self.evict(name, pools[name].num_pages + 1, tier, room)

    # ---------------------------------------------------------- inspection
    def check_integrity(self, held: Mapping[str, np.ndarray] | None = None) -> None:
        """Tree invariants, pool free lists, and that every used page has exactly one
        owner: the tree, or a request (`held`, per pool). Raises AssertionError. What a
        second fault left for the next operation to mend is mended first, as any
        operation would (`_mend`)."""
        self._mend()
        self.tree.check_integrity()
        if self.arena is not None:
            self.arena.check_integrity(self._arena_pools)
        for tier in range(self.tree.tiers):
            where = "" if tier == DEVICE else " (host)"
            for name, pool in self.tier_pools(tier).items():
                if tier != DEVICE or name not in self._arena_pools:  # the arena checked those
                    pool.check_integrity()
                tree_pages = self.tree.all_pages(name, tier)
                owned = [tree_pages, *self._pending_pages(tier, name)]
                if held is not None and name in held and tier == DEVICE:
                    owned.append(np.asarray(held[name], dtype=PAGE_DTYPE))
                allp = np.concatenate(owned)
                if not pool.in_use(tree_pages).all():
                    raise AssertionError(f"pool {name!r}{where}: the tree shadows a free page")
                if np.unique(allp).size != allp.size:
                    raise AssertionError(f"pool {name!r}{where}: a page has two owners")
                if held is not None and allp.size != pool.used_pages:
                    raise AssertionError(f"pool {name!r}{where}: {pool.used_pages} pages in use "
                                         f"but {allp.size} owned (leak)")

    def _pending_pages(self, tier: int, name: str) -> list[np.ndarray]:
        """The pages of one pool and tier waiting in `_unreleased` (the next release frees
        them)."""
        row = self.layout.index(name)
        out = []
        for entry in self._unreleased:
            if isinstance(entry, list):
                if tier < len(entry):
                    out.extend(entry[tier][row])
            elif entry[0] == tier and entry[1] == name:
                out.append(entry[2])
        return out

    def stats(self) -> dict[str, Any]:
        tree: TreeStats = self.tree.stats()
        out = tree.as_dict()
        if self.arena is not None:
            out["arena"] = self.arena.stats(self._arena_pools)
        for name, pool in self.pools.items():
            entry = out["pools"][name]  # type: ignore[index]
            entry.update(capacity=pool.num_pages, free=pool.free_pages,
                         evicted=self.evicted[name])
            if name in self.host_pools:
                host = self.host_pools[name]
                entry.update(host_capacity=host.num_pages, host_free=host.free_pages,
                             host_evicted=self.evicted_host[name])
        return out
