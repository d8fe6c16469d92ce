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
    #                          (handed at its next `cache`)
    # [handed, grown_to)       its own pages, being written (whole pages only for the
    #                          checkpoint pools)

Every state change is recorded in the lease right after it happens, so `abort` undoes
exactly what is still the request's, whatever raised in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shadowradix.layout.spec import Retention
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.node import PAGE, Node
from shadowradix.tree.results import LockHandle
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
    tail: Node | None = None  # the deepest node it inserted (pruned at abort if left dead)
    live: bool = True


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
        ckpt = set(self.tree.rule.checkpoint_rows)
        self._whole_only = [row in ckpt for row in range(len(self.names))]
        self.short_rows = self.tree.short_lived_rows
        self.hold = self.tree.rule.lock_pages
        self.leases: set[Lease] = set()

    # ------------------------------------------------------------- sizing
    def peak_pages(self, tokens: int, chunk: int) -> dict[str, int]:
        """Per pool, the most pages one request of `tokens` positions, run in chunks of at
        most `chunk` tokens, holds at once (its window pools need only the window, the
        pages it keeps for its resume point and one chunk)."""
        ps = self.page_size
        total = -(-tokens // ps)
        out = {}
        for spec in self.cache.layout.pools:
            if spec.retention is Retention.ALL or not self.tree.policy.tombstones:
                out[spec.name] = total
            else:
                out[spec.name] = min(total, 2 * self.hold + -(-chunk // ps) + 1)
        return out

    def fits_ever(self, tokens: int, chunk: int) -> bool:
        """Whether such a request fits in the device pools with nothing else cached."""
        return all(self.cache.pools[n].num_pages >= k
                   for n, k in self.peak_pages(tokens, chunk).items())

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
              landed: int = 0, length: int | None = None) -> Lease | None:
        """Match `tokens`, lock the prefix, load back what the host holds, write stored
        pages that extend the match (`fetched`, L3 -> L1), and allocate pages for a first
        chunk of up to `chunk` tokens past the cached prefix (within `length`, default
        len(tokens)). None, changing nothing, when those pages do not fit even after
        evicting every unlocked page. `landed`: pages of the match that came from storage
        through the host (counted as storage hits)."""
        ps = self.page_size
        cache = self.cache
        m = cache.match(tokens if self.reuse else tokens[:0], record=False)
        done = m.prefix_len // ps
        direct = fetched if (fetched is not None and fetched.pages
                             and fetched.start == done) else None
        resume = direct.stop if direct is not None else done
        first_end = min(tokens.size if length is None else length, resume * ps + chunk)
        load = self.host.load_need(m) if self.host is not None else {}
        want = self._want(first_end, resume)
        # Of the stored pages [done, resume), only those the resume reads go to the device.
        stored = (self.tree.rule.needed(len(self.names), resume)[:, done:] if resume > done
                  else np.zeros((len(self.names), 0), dtype=bool))
        n_stored = np.count_nonzero(stored, axis=1)
        need = {n: int(n_stored[row]) + want[row] - resume + load.get(n, 0)
                for row, n in enumerate(self.names)}
        width = max(want)
        lease = Lease(np.full((len(self.names), width), -1, PAGE),
                      np.zeros((len(self.names), width), dtype=bool), [], done, done,
                      resume * ps, 0, 0, m.logical_len, stored=resume)
        self.leases.add(lease)  # registered before any state changes: abort undoes them
        try:
            lease.handles.append(cache.lock(m))
            if not cache.can_alloc(need):
                self.abort(lease)
                return None
        except BaseException:
            self.abort(lease)
            raise
        try:
            self.cache.record(m)
            got = self._alloc(need)
            assert got is not None  # checked above
            if load:
                lease.loading = {n: got[n][:load.get(n, 0)] for n in got}
            for row, n in enumerate(self.names):
                mine = got[n][load[n]:] if load.get(n) else got[n]
                k = int(n_stored[row])
                if k:
                    lease.table[row, done:resume][stored[row]] = mine[:k]
                lease.table[row, resume:want[row]] = mine[k:]
            lease.own[:, done:] = lease.table[:, done:] >= 0
            lease.grown_to = first_end
            prefix = m.page_table
            if self.host is not None:  # L2 -> L1 copies start now; the lease waits for them
                prefix = self.host.load(m, lease.loading or {})
                lease.loading = None  # the tree's now
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
        need = {n: want[row] - have[row] for row, n in enumerate(self.names)}
        if any(need.values()):
            got = self._alloc(need)  # checks first: None changes nothing
            if got is None:
                return False
            width = max(want)
            if width > lease.table.shape[1]:
                extra = width - lease.table.shape[1]
                lease.table = np.concatenate(
                    (lease.table, np.full((len(self.names), extra), -1, PAGE)), axis=1)
                lease.own = np.concatenate(
                    (lease.own, np.zeros((len(self.names), extra), dtype=bool)), axis=1)
            for row, n in enumerate(self.names):
                lease.table[row, have[row]:want[row]] = got[n]
                lease.own[row, have[row]:want[row]] = True
            lease.version += 1
            if self.host is not None:  # a backup or spill may still read these pages
                lease.ready = max(lease.ready, self.host.ready_ticket(got))
        lease.grown_to = end
        return True

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
        result = self.tree.insert(tokens, pages, start, finished=finished)
        lease.tail = None if finished else result.node  # finished: it ends at a checkpoint
        given = pages >= 0
        # Pages it did not adopt (it holds its own copy, or an eager policy dropped ours)
        # stay the lease's until freed; then the request reads the tree's copy.
        dups = np.zeros_like(given)
        for row, n in enumerate(self.names):
            if result.to_free[n].size:
                dups[row] = given[row] & np.isin(pages[row], result.to_free[n])
        own, view = lease.own[:, start:full], lease.table[:, start:full]
        own[given & ~dups] = False  # the tree's now
        lease.handed = max(lease.handed, full)
        lease.version += 1
        if np.count_nonzero(dups):
            held = self.tree.path_table(result.node, DEVICE)[:, start:full]
            cache.free({n: pages[row][dups[row]] for row, n in enumerate(self.names)})
            own[dups] = False
            view[dups] = held[dups]
        if not finished:  # it keeps running over the new prefix: the lock moves there
            lease.handles.append(cache.lock(result))
            while len(lease.handles) > 1:  # the older lock goes only once the new one holds
                cache.unlock(lease.handles[0])
                lease.handles.pop(0)
        if self.host is not None:
            self.host.after_insert(result.node)

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

    def preempt(self, lease: Lease, tokens: np.ndarray | Sequence[int], computed: int) -> None:
        """Release a running request under memory pressure: its computed full pages join
        the tree (so it resumes from what the cache still holds), the rest is freed."""
        self.finish(lease, tokens, computed, store=False)

    def abort(self, lease: Lease) -> None:
        """Free the pages that are still the request's own and release its lock.
        Idempotent; safe with copies in flight (whoever reuses a page waits for them)."""
        if lease.loading is not None:  # allocated for a load-back the tree never took
            loading, lease.loading = lease.loading, None
            self.cache.free(loading)
        if lease.own.any():
            self.cache.free(self.private(lease))
            lease.own[:] = False
        while lease.handles:
            handle = lease.handles[-1]
            if not handle.released:
                self.cache.unlock(handle)
            lease.handles.pop()
        if lease.tail is not None:  # a prefix inserted without its window, lock never taken
            tail, lease.tail = lease.tail, None
            self.cache.prune(tail)
        lease.live = False
        self.leases.discard(lease)

    def release_orphans(self, attached: set[Lease]) -> int:
        """Abort every lease not in `attached` (an exception left it without a request);
        returns how many. The engine runs this after a failed step."""
        orphans = [lease for lease in self.leases if lease not in attached]
        for lease in orphans:
            self.abort(lease)
        return len(orphans)

    # -------------------------------------------------------------- pages
    def private(self, lease: Lease) -> dict[str, np.ndarray]:
        """The request's own pages, per pool."""
        return {n: lease.table[row][lease.own[row]] for row, n in enumerate(self.names)}

    def _alloc(self, need: dict[str, int]) -> dict[str, np.ndarray] | None:
        got = self.cache.alloc(need) if self.host is None else self.host.alloc_device(need)
        if got is not None and self.poison:
            self._poison(got)
        return got

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
        self.cache.check_integrity(
            held={n: np.concatenate(v) if v else np.empty(0, PAGE) for n, v in held.items()})
