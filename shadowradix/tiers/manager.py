"""One owner of a request's cache life across device, host and storage (DESIGN.md §4).

The engine's scheduler, the simulator's replay and the tests drive this one object;
the scheduler only decides who runs each step.

    admit    match, lock, load back host pages (L2 -> L1), write stored pages (L3 -> L1),
             allocate the first chunk's pages. Checks first: a refusal changes nothing.
    grow     pages for the next chunk, per pool, as the sequence grows.
    cache    hand computed full pages to the tree while the request runs: other requests
             hit its prefix, and the window it left behind becomes evictable cache.
    finish   hand everything over (a checkpoint at the end), write through to storage.
    preempt  the same without storage: the request resumes later from what is cached.
    abort    give back what is still the request's own, release its lock.

A request's pages, as a `Lease` records them:

    # [0, done)                borrowed from the tree by the match (locked)
    # [done, handed)           computed and handed to the tree (locked through the lease)
    # [handed - hold, handed)  window / state pages the request keeps: it still reads them
    #                          (handed at its next `cache`); where the tree holds the same
    #                          page, its lock pins that one and the request reads it instead
    # [handed, grown_to)       its own pages, being written (whole pages only for the
    #                          checkpoint pools)

Every state change is recorded in the lease right after it happens, so `abort` undoes
exactly what is still the request's, whatever raised in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shadowradix.tiers.bounds import RequestBounds
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.node import PAGE, Node
from shadowradix.tree.results import LockHandle
from shadowradix.tree.resume import check_prompt
from shadowradix.tree.tier import DEVICE

if TYPE_CHECKING:
    from shadowradix.tiers.host_tier import HostTier
    from shadowradix.tiers.storage_tier import Fetched


@dataclass(eq=False)
class Lease:
    """What the manager holds for one admitted request (compared by identity)."""

    table: np.ndarray  # [pools, pages] physical page of each logical page; -1: none
    own: np.ndarray  # [pools, pages] the request's own pages (freed on abort)
    handles: list[LockHandle]  # the lock on its prefix (two while one moves to a deeper node)
    done: int  # pages borrowed from the match
    handed: int  # pages [0, handed) belong to the tree
    cached: int  # prompt tokens served from cache, any tier
    from_host: int  # of those, loaded back from L2
    from_storage: int  # of those, read from L3
    logical_len: int  # the match's deepest logical hit (diagnostics)
    ready: int = 0  # the copy ticket to wait for before the next forward
    grown_to: int = 0  # positions [0, grown_to) have every page they need
    stored: int = 0  # pages [0, stored) are in storage or came from a cache tier
    version: int = 0  # bumped whenever `table` changes
    loading: dict[str, np.ndarray] | None = None  # allocated for a load-back not yet filed
    # Allocated and not yet filed in `table` / `own` (`CacheManager._alloc`): abort frees it.
    fresh: dict[str, np.ndarray] | None = None
    handing: _Handing | None = None  # a hand-over to the tree in flight (`_hand_over`)
    torn: bool = False  # a fault in `shrink` left own pages past `grown_to` in some pools
    tail: Node | None = None  # the deepest node it inserted (pruned at abort if left dead)
    prompt: int = 0  # tokens it was admitted with: where its prompt ends (resume learning)
    live: bool = True


@dataclass(eq=False)
class _Handing:
    """A hand-over of a lease's pages to the tree, in flight: called, it works out what
    the tree adopted (`CacheManager._reclaim`: those pages stop being the lease's) once,
    if it is still the lease's hand-over in flight. The hand-over's own handler calls it,
    and so do the lease's abort and the cache's next operation (`PrefixCache.settle_first`),
    whichever comes first: a second fault in the handler never leaves the lease owning
    pages the tree holds."""

    manager: CacheManager
    lease: Lease
    tokens: np.ndarray
    pages: np.ndarray
    start: int
    finished: bool
    tries: int = 0

    def __call__(self) -> None:
        if self.lease.handing is self:
            self.tries += 1
            self.manager._reclaim(self.lease, self.tokens, self.pages, self.start,
                                  self.finished, last=self.tries > 2)
            self.lease.handing = None


def _queued(pages: Mapping[str, np.ndarray]) -> list[tuple[int, str, np.ndarray, bool]]:
    """Device pages per pool as entries of the cache's release queue (not evictions)."""
    return [(DEVICE, name, ids, False) for name, ids in pages.items() if len(ids)]


def flush_device(cache: PrefixCache, host: HostTier | None) -> None:
    """Drop every unlocked page of `cache`'s device tier; with a host tier through it, so
    write-back moves what it can to the host first."""
    if host is not None:
        host.flush_device()
    else:
        cache.flush(DEVICE)


class CacheManager:
    """Admission, growth, caching, finish and abort of requests over one PrefixCache, an
    optional HostTier (L2) and an optional storage tier (L3: StorageTier, or the
    simulator's SimStorage)."""

    def __init__(self, cache: PrefixCache, host: HostTier | None = None,
                 storage: Any = None, *, poison: bool = False, reuse: bool = True) -> None:
        self.cache = cache
        self.reuse = reuse  # False: no request starts from cached pages (a baseline)
        self.tree = cache.tree
        self.host = host
        self.storage = storage
        self.poison = poison
        lay = cache.layout
        self.names = lay.pool_names
        self.page_size = lay.page_size
        self.short_rows = self.tree.short_lived_rows
        self.bounds = RequestBounds.of(lay, self.tree.policy)
        self.hold = self.bounds.hold
        self._whole_only = self.bounds.whole_only
        self._capped = self.bounds.capped  # rows a request holds only a window of
        self._pool_pages = [cache.pools[n].num_pages for n in self.names]
        self._spread = self.bounds.spread  # see PrefixCache.arena_frames
        # Live leases in admission order (a dict as an ordered set): what `_room` shares and
        # `release_orphans` aborts goes in that order, so a replay frees the same pages in
        # the same order every run (a set would follow the objects' addresses).
        self.leases: dict[Lease, None] = {}

    # ------------------------------------------------------------- sizing
    def peak_pages(self, tokens: int, chunk: int = 1) -> dict[str, int]:
        """Per pool, the most pages one request of `tokens` positions, run alone in chunks
        of at most `chunk` tokens, holds at once (RequestBounds.peak_pages)."""
        return self.bounds.peak_pages(tokens, chunk)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request of `tokens` positions runs to completion alone in the device
        pools (nothing else locked), its chunks cut to fit by `chunk_end`. Exact for these
        leases: with one page less in some pool there is a step where the request holds
        its resume pages (or, in an ALL pool, every page) and needs one more."""
        peak = self.peak_pages(tokens)
        if self.cache.arena is not None:
            return self.cache.fits_arena(peak, self._spread)
        return all(self.cache.pools[n].num_pages >= k for n, k in peak.items()) and (
            self._fits_budget(peak))

    def _fits_budget(self, pages: dict[str, int]) -> bool:
        """Under a shared byte budget, whether `pages` (per pool) fit in it on their own
        (every pool's own ceiling is the whole budget); True without one."""
        budget = self.cache.budget
        return budget is None or self.cache.bytes_of(pages) <= budget

    def chunk_end(self, lease: Lease, start: int, end: int) -> int:
        """Where a chunk [start, end) of a running request must end for its pages to fit
        in every window and checkpoint pool on their own: the scheduler cuts to this, so a
        pool smaller than one step runs the request in smaller chunks instead of refusing
        it. Never below start + 1 (a request that `fits_ever` has room for one token)."""
        if end <= lease.grown_to or not self._capped:
            return end
        h = lease.handed  # it holds or pins [h - hold, h) and owns what it grew past h
        base = (min(h, self.hold) + np.count_nonzero(lease.own[:, h:], axis=1)).tolist()
        have = self._want(lease.grown_to, lease.cached // self.page_size)
        return max(self._cut(end, base, have), start + 1)

    def _cut(self, end: int, base: Sequence[int], have: Sequence[int]) -> int:
        """The largest e <= end at which, in every window and checkpoint pool, the `base`
        pages a request holds or pins there, plus those it grows from `have` to `_want(e)`,
        fit in the pool."""
        ps = self.page_size
        arena = self.cache.arena
        for row in self._capped:
            if arena is not None and self.names[row] in arena.names:
                continue
            room = self._pool_pages[row] - base[row] + have[row]  # the most pages it may want
            end = min(end, room * ps + (ps - 1 if self._whole_only[row] else 0))
        if self._fits_alone(end, base, have):
            return end
        lo, hi = 0, end  # what it takes grows with e: the largest e that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits_alone(mid, base, have) else (lo, mid)
        return lo

    def _fits_alone(self, end: int, base: Sequence[int], have: Sequence[int]) -> bool:
        """Whether what a request takes on its own once it reaches `end` fits the memory
        its pools share (True where they share none): every page of an ALL pool, its `base`
        pages of a window or checkpoint pool and those it grows there from `have`. Over an
        arena, in frames (those pools a frame each: see `PrefixCache.fits_arena`); under a
        byte budget, in bytes."""
        arena = self.cache.arena
        if arena is None and self.cache.budget is None:
            return True
        want = self._want(end)
        pages = {n: base[row] + max(want[row] - have[row], 0) if row in self._capped
                 else want[row] for row, n in enumerate(self.names)}
        if arena is not None:
            return self.cache.arena_frames(pages, self._spread) <= arena.frames
        return self._fits_budget(pages)

    # -------------------------------------------------------------- admit
    def prefetch(self, tokens: np.ndarray) -> Future[Fetched] | None:
        """Start reading from storage what lies past the device and host for `tokens`;
        None without storage or with nothing to read. Changes nothing in the tree."""
        if self.storage is None or not self.reuse:
            return None
        peek = self.cache.peek(tokens)
        limit = (tokens.size - 1) // self.page_size
        if limit <= peek.held_table.shape[1]:
            return None  # the tiers above hold all a resume could use: no read to queue
        return self.storage.prefetch(tokens, peek.held_table, limit)

    def land(self, tokens: np.ndarray, fetched: Fetched) -> int:
        """Put stored pages on the host tier (L3 -> L2) under the tree's prefix; returns the
        pages landed (0: no host, no room, or the tiers moved meanwhile)."""
        if self.host is None or not fetched.pages:
            return 0
        write = None
        if fetched.blobs:
            storage, tensor = self.storage, self.cache.tensor

            def write(pages: dict[str, np.ndarray]) -> None:
                storage.write(fetched, pages, lambda name: tensor(name, 1))

        ok = self.host.land(tokens, fetched.start, fetched.stop, write)
        return fetched.pages if ok else 0

    def admit(self, tokens: np.ndarray, chunk: int, fetched: Fetched | None = None,
              landed: int = 0, length: int | None = None, *,
              fit: bool = False, prompt: int | None = None) -> Lease | None:
        """Match `tokens`, lock the prefix, load back what the host holds, write stored
        pages that extend the match (`fetched`, L3 -> L1), and allocate pages for a first
        chunk of up to `chunk` tokens past the cached prefix (within `length`, default
        len(tokens)). None, changing nothing (but the tail the match prunes: see
        `PrefixCache.match`), when those pages do not fit even after evicting every
        unlocked page. `landed`: pages of the match that came from storage
        through the host (counted as storage hits). `fit`: cut the first chunk so its pages
        fit in every window and checkpoint pool on their own (as `chunk_end`). `prompt`:
        where the request's prompt ends (default len(tokens); a preempted request comes
        back with its output), for the tree to learn where next turns resume."""
        check_prompt(prompt)
        ps = self.page_size
        cache = self.cache
        m = cache.match(tokens if self.reuse else tokens[:0], record=False)
        done = m.prefix_len // ps
        direct = fetched if (fetched is not None and fetched.pages
                             and fetched.start == done) else None
        direct, first_end, stored = self._first_chunk(
            done, direct, tokens.size if length is None else length, chunk, fit)
        resume = direct.stop if direct is not None else done
        load = self.host.load_need(m) if self.host is not None else {}
        want = self._want(first_end, resume)
        n_stored = np.count_nonzero(stored, axis=1)
        need = {n: int(n_stored[row]) + want[row] - resume + load.get(n, 0)
                for row, n in enumerate(self.names)}
        width = max(want)
        lease = Lease(np.full((len(self.names), width), -1, PAGE),
                      np.zeros((len(self.names), width), dtype=bool), [], done, done,
                      resume * ps, 0, 0, m.logical_len, stored=resume,
                      prompt=tokens.size if prompt is None else int(prompt))
        self.leases[lease] = None  # registered before any state changes: abort undoes them
        try:
            cache.lock(m, into=lease.handles)
            if not self._room(need):
                self.abort(lease)
                return None
        except BaseException:
            self.abort(lease)
            raise
        try:
            self.cache.record(m)
            got = self._alloc(need, lease)
            if got is None:  # an arena's frames stayed short after evicting (see alloc)
                self.abort(lease)
                return None
            loading = {n: got[n][:load.get(n, 0)] for n in got} if load else None
            for row, n in enumerate(self.names):
                mine = got[n][load[n]:] if load.get(n) else got[n]
                k = int(n_stored[row])
                if k:
                    lease.table[row, done:resume][stored[row]] = mine[:k]
                lease.table[row, resume:want[row]] = mine[k:]
            # Filed, in one statement: an interrupt finds them all fresh or all filed.
            mine_now = lease.table[:, done:] >= 0
            lease.own[:, done:], lease.loading, lease.fresh = mine_now, loading, None
            lease.grown_to = first_end
            prefix = m.page_table
            if self.host is not None:  # L2 -> L1 copies start now; the lease waits for them
                prefix = self.host.load(m, lease.loading or {})  # empties it: the tree's now
                lease.loading = None
                self.host.after_match(m)
            lease.table[:, :done] = prefix
            if direct is not None and direct.blobs:  # L3 -> L1: bytes into its own pages
                dst = {n: lease.table[row, done:resume] for row, n in enumerate(self.names)}
                if self.host is not None:  # a copy may still read these (reused) pages
                    self.host.mover.wait(self.host.ready_ticket(dst))
                self.storage.write(direct, dst, cache.tensor)
            from_host = done * ps - m.device_prefix_len
            from_landed = min(landed * ps, from_host)
            lease.from_host = from_host - from_landed
            lease.from_storage = from_landed + (resume - done) * ps
            lease.ready = self._ticket(lease.table)
        except BaseException:
            self.abort(lease)
            raise
        return lease

    def _first_chunk(self, done: int, direct: Fetched | None, limit: int, chunk: int,
                     fit: bool) -> tuple[Fetched | None, int, np.ndarray]:
        """The first chunk past a match at page `done`: the stored pages it starts after
        (`direct`, or None), where it ends, and which of the stored pages [done, resume)
        the resume reads (only those go to the device). With `fit` the chunk is cut to fit
        the window and checkpoint pools; stored pages that leave no room there for one
        token are not used (the request recomputes them rather than never running)."""
        ps = self.page_size
        while True:
            resume = direct.stop if direct is not None else done
            stored = (self.tree.rule.needed(len(self.names), resume)[:, done:]
                      if resume > done else np.zeros((len(self.names), 0), dtype=bool))
            end = min(limit, resume * ps + chunk)
            if not fit:
                return direct, end, stored
            # It pins the tree's pages of its resume point and holds the stored ones.
            base = [min(done, self.hold) + int(k) for k in np.count_nonzero(stored, axis=1)]
            cut = self._cut(end, base, [resume] * len(self.names))
            if cut > resume * ps or direct is None:
                return direct, max(cut, resume * ps + 1), stored
            direct = None

    def _want(self, end: int, floor_pages: int = 0) -> list[int]:
        """Per pool, how many logical pages a request that has reached position `end` has
        pages for: every page touched, but only whole pages for checkpoint pools."""
        ps = self.page_size
        touched, whole = -(-end // ps), end // ps
        return [max(whole if whole_only else touched, floor_pages)
                for whole_only in self._whole_only]

    # --------------------------------------------------------------- grow
    def grow(self, lease: Lease, end: int) -> bool:
        """Allocate the pages positions up to `end` need. False, changing nothing, when
        they do not fit even after evicting every unlocked page."""
        if end <= lease.grown_to:  # most decode steps: the page is already there
            return True
        floor = lease.cached // self.page_size
        have, want = self._want(lease.grown_to, floor), self._want(end, floor)
        kept = self._torn_pages(lease, have, want) if lease.torn else None
        need = {n: want[row] - have[row] - (0 if kept is None else int(kept[row].sum()))
                for row, n in enumerate(self.names)}
        if any(need.values()):
            try:
                got = self._alloc(need, lease) if self._room(need) else None
                if got is None:
                    return False
                self._file(lease, got, have, want, kept)
            except BaseException:  # not filed: they go back (filed, `fresh` is None)
                self._drop_fresh(lease)
                raise
            lease.version += 1
            if self.host is not None:  # a backup or spill may still read these pages
                lease.ready = max(lease.ready, self.host.ready_ticket(got))
        lease.grown_to = end
        return True

    def _file(self, lease: Lease, got: dict[str, np.ndarray], have: list[int],
              want: list[int], kept: list[np.ndarray] | None) -> None:
        """Name the pages `grow` allocated (`lease.fresh`) in the lease's table, cells
        [have, want) of each pool (around the `kept` pages a torn shrink left it), and make
        them its own: the new table and own marks are made aside, then taken, with `fresh`
        cleared, in one statement."""
        width = max(want)
        extra = max(width - lease.table.shape[1], 0)
        table = np.concatenate((lease.table, np.full((len(self.names), extra), -1, PAGE)),
                               axis=1)
        own = np.concatenate((lease.own, np.zeros((len(self.names), extra), dtype=bool)),
                             axis=1)
        for row, n in enumerate(self.names):
            cells = table[row, have[row]:want[row]]
            if kept is None:
                cells[:] = got[n]
            else:  # around the pages a torn shrink left the lease
                cells[~kept[row]] = got[n]
            own[row, have[row]:want[row]] = True
        lease.table, lease.own, lease.fresh = table, own, None

    def _torn_pages(self, lease: Lease, have: list[int], want: list[int]) -> list[np.ndarray]:
        """Per pool, which cells of [have, want) hold a page a torn shrink left the lease
        (its own: kept, not allocated again)."""
        width = lease.own.shape[1]
        return [np.pad(lease.own[row, lo:min(hi, width)], (0, max(hi - max(lo, width), 0)))
                for row, (lo, hi) in enumerate(zip(have, want, strict=True))]

    def shrink(self, lease: Lease, end: int) -> None:
        """Give back the pages grown past what positions up to `end` need (a speculative
        step grew pages for drafts the model rejected). They are the request's own: no
        full page past `end` was handed to the tree."""
        if end >= lease.grown_to:
            return
        floor = lease.cached // self.page_size
        have, want = self._want(lease.grown_to, floor), self._want(end, floor)
        spare = np.zeros_like(lease.own)
        for row, (lo, hi) in enumerate(zip(want, have, strict=True)):
            spare[row, lo:hi] = lease.own[row, lo:hi]
        try:
            if spare.any():
                lease.version += 1
                self._give_up(lease.table, lease.own, spare, lease.table)
        except BaseException:  # the pools not freed keep their pages past `end` (its own
            lease.torn = True  # still): `grow` allocates around them
            raise
        finally:
            lease.grown_to = end

    # -------------------------------------------------------------- cache
    def cache_prefix(self, lease: Lease, tokens: np.ndarray | Sequence[int],
                     computed: int) -> None:
        """Hand the computed full pages of a running request to the tree (finished=False):
        other requests can hit them, and its window and state pages older than the ones it
        still reads become evictable cache. The lock moves to the new prefix. With storage,
        the pages are written through first."""
        full = computed // self.page_size
        if full <= lease.handed:
            return
        self._write_through(lease, tokens, full)
        start = max(lease.handed - self.hold, lease.done)
        pages = np.where(lease.own[:, start:full], lease.table[:, start:full], -1)
        if self.hold:  # the window and state it still reads stay its own
            pages[self.short_rows, max(full - self.hold, start) - start:] = -1
        self._hand_over(lease, tokens, pages, start, full, finished=False)

    def _hand_over(self, lease: Lease, tokens: np.ndarray | Sequence[int], pages: np.ndarray,
                   start: int, full: int, finished: bool) -> None:
        cache, ps = self.cache, self.page_size
        tokens = np.asarray(tokens[:full * ps], dtype=np.int32)
        self._settle(lease)  # (one a fault cut short before)
        # In flight until the lease no longer calls what the tree adopted its own: noted on
        # the lease and with the cache, whose next operation settles it should a second
        # fault cut this one's handler short (before anything can evict what it adopted).
        handing, first = _Handing(self, lease, tokens, pages, start, finished), cache.settle_first
        first[len(first):], lease.handing = [handing], handing
        try:
            result = self.tree.insert(tokens, pages, start, finished=finished,
                                      prompt=lease.prompt)
            lease.tail = None if finished else result.node  # finished: ends at a checkpoint
            given = pages >= 0
            # Pages it did not adopt (it holds its own copy, or an eager policy dropped
            # ours) stay the lease's until freed; then the request reads the tree's copy.
            dups = np.zeros_like(given)
            for row, n in enumerate(self.names):
                if result.to_free[n].size:
                    dups[row] = given[row] & np.isin(pages[row], result.to_free[n])
            own, view = lease.own[:, start:full], lease.table[:, start:full]
            adopted = given & ~dups
            own[adopted], lease.handing = False, None  # the tree's now
        except BaseException:  # (the insert went through or not: it works out which)
            self._settle(lease)
            raise
        if first and first[-1] is handing:  # settled: the cache need not keep it
            first.pop()
        lease.handed = max(lease.handed, full)
        lease.version += 1
        if np.count_nonzero(dups):
            held = self.tree.path_table(result.node, DEVICE)[:, start:full]
            self._give_up(pages, own, dups, view, held)
        if not finished:  # it keeps running over the new prefix: the lock moves there
            cache.lock(result, into=lease.handles)
            while len(lease.handles) > 1:  # the older lock goes only once the new one holds
                if not lease.handles[0].released:  # (an unlock cut short before its pop)
                    cache.unlock(lease.handles[0])
                lease.handles.pop(0)
            self._share_held(lease)
        if result.tail is not None:  # split off with no resume point left: it goes now
            cache.prune(result.tail)
        if self.host is not None:
            self.host.after_insert(result.node)

    @staticmethod
    def _settle(lease: Lease) -> None:
        """Finish a hand-over of `lease` a fault cut short (see `_Handing`), if any."""
        handing = lease.handing
        if handing is not None:
            handing()

    def _reclaim(self, lease: Lease, tokens: np.ndarray, pages: np.ndarray, start: int,
                 finished: bool, last: bool = True) -> None:
        """An insert that raised may have adopted some of the lease's `pages` (for
        [start, ...)) already: those are the tree's now, so the lease must not free them,
        and the tree makes again what it derives from its nodes (`ShadowRadix.repair`). A
        running request's new leaf has no resume point (the request keeps its window): the
        lease locks it and names it its tail, as a hand-over does: it stays while the
        request runs, and `abort` prunes it. Should working out what the tree adopted
        fault, the lease keeps its marks for a retry (the hand-over stays in flight), but
        on the `last` try: then all it handed counts as the tree's (a leak at worst, never
        a page with two owners)."""
        handed = lease.own[:, start:start + pages.shape[1]]
        try:
            adopted, node = self.tree.adopted(tokens, pages, start)
        except BaseException:
            if last:
                handed[pages >= 0] = False
            raise
        handed[adopted] = False
        self.tree.repair(after_fault=True)
        if not finished and node is not None and not node.children and not node.full_lock:
            lease.tail = node  # as after a hand-over: locked while it runs, pruned after
            self.tree.lock(node, lease.handles)

    def _share_held(self, lease: Lease,
                    found: tuple[int, np.ndarray, np.ndarray] | None = None) -> None:
        """Free the window and state pages a running request keeps for its resume point
        where the tree holds the same logical page on the device, and read the tree's copy
        instead. Its lock pins the tree's copy whether it reads it or not, so keeping both
        would hold two pages for one (the tree gets its copy when this request recomputes
        a cached page, or when another hands the same prefix over) and a request alone in
        a pool its admission counted would preempt itself. `found`: `_held_copies(lease)`,
        when the caller has it already."""
        found = found or self._held_copies(lease)
        if found is None:
            return
        lo, dups, tree = found
        view, own = lease.table[:, lo:lo + dups.shape[1]], lease.own[:, lo:lo + dups.shape[1]]
        lease.version += 1
        self._give_up(view, own, dups, view, tree)
        if self.host is not None:  # the tree's copy may still be landing from the host
            lease.ready = max(lease.ready, self.host.ready_ticket(
                {n: tree[row][dups[row]] for row, n in enumerate(self.names)}))

    def _held_copies(self, lease: Lease) -> tuple[int, np.ndarray, np.ndarray] | None:
        """The lease's held pages [lo, handed) that the tree also holds on the device:
        (lo, which [pools, pages], the tree's pages there), or None when there are none."""
        hi = lease.handed
        lo = max(hi - self.hold, 0)
        if not self.short_rows or not lease.handles or hi <= lo:
            return None
        mine = np.zeros((len(self.names), hi - lo), dtype=bool)
        mine[self.short_rows] = lease.own[self.short_rows, lo:hi]
        if not np.count_nonzero(mine):
            return None
        tree = self.tree.path_tail(lease.handles[-1].node, hi - lo)  # what its lock pins
        if tree.shape[1] != hi - lo:
            return None
        dups = mine & (tree >= 0)
        return (lo, dups, tree) if np.count_nonzero(dups) else None

    def _room(self, need: dict[str, int]) -> bool:
        """Whether `need` fits after evicting every unlocked page. When it would only fit
        once running requests stop holding copies of pages the tree holds for them
        (another request handed the same prefix over), they share the tree's first; a
        refusal still changes nothing."""
        cache = self.cache
        if cache.can_alloc(need):
            return True
        if cache.budget is not None:  # bytes, not pages: the simulator runs one at a time
            return False
        found = {lease: hit for lease in self.leases
                 if (hit := self._held_copies(lease)) is not None}
        if not found:
            return False
        if cache.arena is None:  # pages: share only where that is enough (frames: ask after)
            gain = sum(np.count_nonzero(hit[1], axis=1) for hit in found.values())
            tree = self.tree
            if any(cache.pools[n].free_pages + tree.evictable(n) + gain[row] < k
                   for row, n in enumerate(self.names) if (k := need.get(n, 0))):
                return False
        for lease, hit in found.items():
            self._share_held(lease, hit)
        return cache.can_alloc(need)

    # ------------------------------------------------------------- finish
    def finish(self, lease: Lease, tokens: np.ndarray | Sequence[int], computed: int,
               *, store: bool = True) -> None:
        """Hand every computed full page to the tree (keeping a checkpoint at the end),
        write what this request computed and did not write yet through to storage
        (`store`), free the rest and release the lease."""
        if not lease.live:
            raise ValueError("lease already released")
        ps = self.page_size
        full = computed // ps
        try:
            if store:
                self._write_through(lease, tokens, full)
            start = max(lease.handed - self.hold, lease.done)
            if full > start:
                pages = np.where(lease.own[:, start:full], lease.table[:, start:full], -1)
                self._hand_over(lease, tokens, pages, start, full, finished=True)
        finally:
            self.abort(lease)  # whatever is still its own goes back; the lock goes

    def _write_through(self, lease: Lease, tokens: np.ndarray | Sequence[int],
                       full: int) -> None:
        """Store the computed full pages not stored yet (L3 write-through), while they are
        still the request's own: once handed to the tree, a window page may be evicted and
        handed to another request, so its bytes must be copied before that."""
        if self.storage is None or full <= lease.stored:
            return
        ps, lo = self.page_size, lease.stored
        self.storage.save(np.asarray(tokens[:full * ps], dtype=np.int32), lo, full,
                          {n: lease.table[row, lo:full] for row, n in enumerate(self.names)},
                          self.cache.tensor)
        lease.stored = full

    def flush_device(self) -> None:
        """Drop every unlocked device page (write-back first moves what it can to the
        host)."""
        flush_device(self.cache, self.host)

    def preempt(self, lease: Lease, tokens: np.ndarray | Sequence[int], computed: int) -> None:
        """Release a running request under memory pressure: its computed full pages join
        the tree (so it resumes from what the cache still holds), the rest is freed."""
        self.finish(lease, tokens, computed, store=False)

    def abort(self, lease: Lease) -> None:
        """Free the pages that are still the request's own and release its lock.
        Idempotent; safe with copies in flight (whoever reuses a page waits for them)."""
        self._settle(lease)  # a hand-over a fault cut short: the tree's pages stay the tree's
        queue = self.cache.release_queue
        if lease.loading is not None:  # allocated for a load-back the tree never took
            queue[len(queue):], lease.loading = _queued(lease.loading), None
            self.cache.release_queued()
        self._drop_fresh(lease)
        if lease.own.any():
            self._give_up(lease.table, lease.own, lease.own.copy())
        while lease.handles:
            handle = lease.handles[-1]
            if not handle.released:
                self.cache.unlock(handle)
            else:  # released, but a fault cut short the prune that follows (idempotent)
                self.cache.prune(handle.node)
            lease.handles.pop()
        if lease.tail is not None:  # a prefix inserted without its window, lock never taken
            tail, lease.tail = lease.tail, None
            self.cache.prune(tail)
        lease.live = False
        self.leases.pop(lease, None)

    def release_orphans(self, attached: set[Lease]) -> int:
        """Abort every lease not in `attached` (an exception left it without a request);
        returns how many. The engine runs this after a failed step."""
        orphans = [lease for lease in self.leases if lease not in attached]
        for lease in orphans:
            self.abort(lease)
        return len(orphans)

    # -------------------------------------------------------------- pages
    def _give_up(self, table: np.ndarray, own: np.ndarray, cells: np.ndarray,
                 view: np.ndarray | None = None, instead: np.ndarray | None = None) -> None:
        """Free the pages `table[cells]` a lease owns (`own`: its own marks over the same
        columns), pool by pool: in one statement a pool's cells are marked not the
        lease's own, in the lease's `view` of those columns (if given) name `instead`
        (the tree's copy; None: -1), and its pages join the cache's release queue; then
        the queue is freed. An interrupt at any point finds each pool's pages the lease's
        (an abort frees exactly those) or queued, never both, never lost."""
        queue = self.cache.release_queue
        for row, name in enumerate(self.names):
            mask = cells[row]
            if np.count_nonzero(mask):  # (all the statement's targets made before it)
                entry, mine, at = _queued({name: table[row][mask]}), own[row], len(queue)
                if view is None:
                    queue[at:], mine[mask] = entry, False
                else:
                    now, seen = -1 if instead is None else instead[row][mask], view[row]
                    queue[at:], mine[mask], seen[mask] = entry, False, now
        self.cache.release_queued()

    def private(self, lease: Lease) -> dict[str, np.ndarray]:
        """The request's own pages, per pool."""
        return {n: lease.table[row][lease.own[row]] for row, n in enumerate(self.names)}

    def _alloc(self, need: dict[str, int], lease: Lease) -> dict[str, np.ndarray] | None:
        """Pages for `lease`, held in `lease.fresh` from the statement the allocation
        returns in until the caller files them (an abort frees them there, so an interrupt
        between never leaks them); None when they do not fit."""
        self._drop_fresh(lease)  # (a fault before an earlier filing left them)
        alloc = self.cache.alloc if self.host is None else self.host.alloc_device
        got = lease.fresh = alloc(need)
        if got is not None and self.poison:
            self._poison(got)  # a fault: the caller's abort (or `grow`) frees `fresh`
        return got

    def _drop_fresh(self, lease: Lease) -> None:
        """Free what `_alloc` gave `lease` and nothing filed (see `Lease.fresh`): queued
        in the statement that lets go of them (see `PrefixCache.release_queue`)."""
        queue = self.cache.release_queue
        if lease.fresh is not None:
            queue[len(queue):], lease.fresh = _queued(lease.fresh), None
            self.cache.release_queued()

    def _poison(self, pages: dict[str, np.ndarray]) -> None:
        """Debug mode: fill newly allocated pages with NaN, so a request that still reads a
        page it gave up (or one not yet copied in) cannot go unnoticed."""
        if self.cache.pools[self.names[0]].storage is None:
            return
        if self.host is not None:  # copies still reading these pages from their last life
            self.host.mover.wait(self.host.ready_ticket(pages))
        for name, ids in pages.items():
            data = self.cache.tensor(name)
            if len(ids) and data.is_floating_point():
                import torch

                data[:, torch.as_tensor(np.asarray(ids, dtype=np.int64), device=data.device)] = (
                    float("nan"))

    def _ticket(self, table: np.ndarray) -> int:
        if self.host is None:
            return 0
        return self.host.ready_ticket({n: table[row] for row, n in enumerate(self.names)})

    # ---------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Every page has exactly one owner across the tree, the live leases and the free
        lists, in both tiers, and the tree's own invariants hold. Raises AssertionError."""
        held = {n: [] for n in self.names}  # type: dict[str, list[np.ndarray]]
        for lease in self.leases:
            assert lease.live, "a released lease is still registered"
            for n, ids in self.private(lease).items():
                held[n].append(ids)
            for n, ids in (lease.fresh or {}).items():  # allocated, not filed yet
                held[n].append(ids)
        self.cache.check_integrity(
            held={n: np.concatenate(v) if v else np.empty(0, PAGE) for n, v in held.items()})
