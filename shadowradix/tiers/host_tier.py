"""L2: host pools under the device pools, the write policies, and load-back.

The tree records where each page lives (ShadowRadix, `host` shadow); this class
decides what to copy and hands the copies to a Mover, which runs them off the
scheduler's thread in submission order. Books change at submit time: a page
filled in the tree may still be in flight. So each device page (each frame, over
an arena: its bytes serve another pool's pages once it goes back) remembers the
last copy that reads or writes it (`busy`), a request waits for the newest
ticket among the device pages it will touch (`ready_ticket`), and the scheduler
runs it only once that ticket is done. Reusing a page is safe: a page freed
while a copy still reads it is written next either by a later copy (copies run
in order) or by a request whose ready ticket covers that copy.

Write policies (CacheConfig.write_policy):
    write_through            back up every page the tree adopts, at insert
    write_through_selective  back up a node once matches reached it `hit_threshold` times
    write_back               back up a node's device pages only when eviction drops them:
                             device allocation and eviction go through `alloc_device` /
                             `evict_device`, which reserve host room, evict, and copy

A copy that fails on the mover's thread is a fault of the step, not of the engine: the
mover voids it and what was queued behind it, and `recover` (run by the engine before a
forward) forgets every page those tickets wrote, in the tier they wrote it: a backup or
spill that never landed leaves no host shadow, a load-back that never landed leaves no
device page, and the caller restarts whoever read one (it resumes from what is valid).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.node import PAGE, Node
from shadowradix.tree.results import MatchResult, joined
from shadowradix.tree.spill import SpillRoom
from shadowradix.tree.tier import DEVICE, HOST

if TYPE_CHECKING:
    from shadowradix.tiers.mover import Copy, Mover

log = logging.getLogger(__name__)
Written = list[tuple[str, int, np.ndarray]]  # (pool, tier written, page ids)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HostTier:
    def __init__(self, cache: PrefixCache, mover: Mover, write_policy: str = "write_through",
                 hit_threshold: int = 2) -> None:
        if not cache.has_host:
            raise ValueError("the cache has no host pools (PrefixCache(host_pages=...))")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if hit_threshold < 1:
            raise ValueError(f"hit_threshold must be >= 1, got {hit_threshold}")
        self.cache = cache
        self.tree = cache.tree
        self.mover = mover
        self.write_policy = write_policy
        self.hit_threshold = hit_threshold
        self.names = cache.layout.pool_names
        self.counts: Counter[str] = Counter()  # pages loaded / backed up / spilled / skipped
        # Bytes submitted per direction: "host->device" (load-back), "device->host" (backup).
        self.bytes: Counter[str] = Counter()
        self._page_bytes = cache.layout.page_bytes()
        # Per device page, the last ticket whose copy reads or writes it (0: none). Over an
        # arena, per frame instead: a frame's bytes pass from pool to pool as frames are
        # given back and taken, so a page of one pool may sit where a copy still reads a
        # page of another (`cache.arena_frames_of`).
        arena = cache.arena
        self._frame_busy = np.zeros(arena.frames if arena else 0, np.int64)
        self.busy = {name: np.zeros(pool.num_pages, np.int64)
                     for name, pool in cache.pools.items()
                     if arena is None or name not in arena.names}
        # Per ticket not known to have landed, the pages it writes (forgotten if it fails).
        self._writes: dict[int, Written] = {}
        # Every ticket up to this one landed or had its pages forgotten (`recover`): a
        # frame whose last ticket is older holds no copy in flight and no id a failed copy
        # still names, so an arena's compaction may move its pages (`frames_in_flight`).
        # Advanced only by `recover`, with the ticket the caller waited for: the same
        # calls give the same frames, however fast the copies ran.
        self._settled = 0
        self._floor = 0  # the newest ticket at the last `step_ticket`
        # What failed copies wrote, until the tree has forgotten it, and the device pages
        # that left the tree for them, until `recover` has reported them: a fault in
        # forgetting keeps both for the next `recover`.
        self._unforgotten: list[Written] = []
        self._dropped: dict[str, list[np.ndarray]] = {}
        if arena is not None:
            cache.frames_in_flight = self.frames_in_flight

    # ------------------------------------------------------------ load-back
    def load_need(self, match: MatchResult) -> dict[str, int]:
        """Device pages per pool that resuming at `match` must load from the host."""
        if match.load is None:
            return {}
        return {name: int(np.count_nonzero(match.load[row]))
                for row, name in enumerate(self.names)}

    def load(self, match: MatchResult, pages: dict[str, np.ndarray]) -> np.ndarray:
        """Copy the host-only pages the resume needs into the given device pages (as
        many per pool as `load_need` said), fill the tree, and return the request's
        device page table for [0, prefix) (-1 where the resume reads nothing).
        The copy is in flight: see `ready_ticket`. `pages` is the caller's holder: the
        tree takes them and it is emptied in one step; after a fault (an interrupt too)
        the tree holds none of them and the caller all."""
        table = match.page_table.copy()
        if match.load is None or not np.count_nonzero(match.load):
            return table
        assert match.host_table is not None
        fill = np.full_like(table, -1)
        copies: list[Copy] = []
        for row, name in enumerate(self.names):
            cells = match.load[row]
            if np.count_nonzero(cells):
                dst = np.asarray(pages[name], dtype=PAGE)
                fill[row, cells] = dst
                copies.append((name, HOST, match.host_table[row, cells], dst))
        self._submit(copies)  # before the tree adopts the pages: a copy never submitted
        given = dict(pages)  # must not leave them looking loaded (the holder, for a fault)
        try:
            self.tree.fill(match.node, fill, DEVICE)
            pages.clear()  # the tree's now
            self.counts["loaded"] += int(np.count_nonzero(fill >= 0))
            table[fill >= 0] = fill[fill >= 0]
            return table
        except BaseException:  # whatever the tree took (all or none) goes back to the caller
            self.tree.unfill(match.node, fill, DEVICE)
            pages.update(given)
            raise

    # ---------------------------------------------------------------- backup
    def after_match(self, match: MatchResult) -> None:
        """write_through_selective: back up the matched path's nodes that became hot."""
        if self.write_policy == "write_through_selective":
            self.backup(match.node, self.hit_threshold)

    def after_insert(self, node: Node) -> None:
        """write_through: back up what the tree just adopted (and anything above it)."""
        if self.write_policy == "write_through":
            self.backup(node)

    def backup(self, node: Node, min_hits: int = 0) -> int:
        """Copy the device pages on root..node that the host lacks; returns pages copied.
        All or nothing: when the host cannot make room, nothing is copied."""
        if not node.alive:
            return 0
        mask = self.tree.absent(node, HOST, min_hits)
        need = {name: int(np.count_nonzero(mask[row])) for row, name in enumerate(self.names)}
        if not any(need.values()):
            return 0
        got = self.cache.alloc(need, HOST)  # host LRU eviction; never touches the device
        if got is None or not node.alive:
            if got is not None:
                self.cache.free(got, HOST)
            self.counts["backup_skipped"] += sum(need.values())
            return 0
        try:
            ids = self._copy_out(self.tree.path_table(node, DEVICE), mask, got)
            self.tree.fill(node, ids, HOST)  # a fault: it changes nothing
        except BaseException:  # the pages go back (a copy in flight writes them before
            self.cache.free(got, HOST)  # any later one: copies run in order)
            raise
        self.counts["backed_up"] += sum(need.values())
        return sum(need.values())

    def _copy_out(self, src: np.ndarray, mask: np.ndarray,
                  host: Mapping[str, np.ndarray]) -> np.ndarray:
        """Submit device -> host copies of the `mask` cells of the device table `src` into
        the given host pages; returns the host ids laid out like `mask`."""
        ids = np.full(mask.shape, -1, PAGE)
        copies: list[Copy] = []
        for row, name in enumerate(self.names):
            cells = mask[row]
            if np.count_nonzero(cells):
                ids[row, cells] = host[name]
                copies.append((name, DEVICE, src[row, cells], ids[row, cells]))
        self._submit(copies)
        return ids

    def _submit(self, copies: list[Copy]) -> int:
        # Everything its books need is read first: once the copy is queued, only plain
        # writes stand between it and the tickets that make a page's next owner wait.
        spread = self._spread(copies) if self._unforgotten else []
        writes = [(name, 1 - tier, np.asarray(dst)) for name, tier, _, dst in copies]
        busy = [self._busy(name, src if tier == DEVICE else dst)
                for name, tier, src, dst in copies]
        before = self.mover.last
        try:
            ticket = self.mover.submit(copies)
        except BaseException:  # queued all the same (an interrupt as it returned): booked
            if self.mover.last == before:
                raise
            ticket = self.mover.last
            for table, cells in busy:
                table[cells] = ticket
            self._writes[ticket] = writes
            raise
        for table, cells in busy:
            table[cells] = ticket
        self._writes[ticket] = writes
        if spread:
            self._unforgotten.append(spread)
        for name, tier, src, _ in copies:
            direction = "device->host" if tier == DEVICE else "host->device"
            self.bytes[direction] += self._page_bytes[name] * len(src)
        return ticket

    def ready_ticket(self, pages: Mapping[str, np.ndarray]) -> int:
        """The ticket a request must wait for before it touches these device pages
        (per pool; -1 entries are ignored): the newest copy that reads or writes any."""
        newest = 0
        for name, ids in pages.items():
            ids = np.asarray(ids)
            ids = ids[ids >= 0]
            if ids.size:
                busy, cells = self._busy(name, ids)
                newest = max(newest, int(busy[cells].max()))
        return newest

    def _busy(self, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the tickets of device pages `ids` of pool `name` are kept: the array and
        its cells (their frames, over an arena)."""
        frames = self.cache.arena_frames_of(name, ids)
        if frames is None:
            return self.busy[name], np.asarray(ids)
        return self._frame_busy, frames

    def step_ticket(self, ready: int) -> int:
        """The ticket a step waits for (`mover.wait`) before its forward, and then
        `recover`s: `ready`, the newest its requests' pages need, and at least every copy
        submitted before the previous step's, so that a backup keeps its frames from
        compaction for two steps at most (a forward outlasts the copy of its pages)."""
        ticket = max(ready, self._floor)
        self._floor = self.mover.last
        return ticket

    def frames_in_flight(self) -> list[int]:
        """Arena frames whose last copy `recover` has not yet settled: one may still read
        or write their bytes, or name their ids when it fails."""
        return np.flatnonzero(self._frame_busy > self._settled).tolist()

    # ------------------------------------------------------- failed copies
    def recover(self, ticket: int) -> dict[str, np.ndarray]:
        """After `mover.wait(ticket)`: forget what failed copies should have written (the host
        shadows of failed backups, spills and landings, the device pages of failed
        load-backs); returns the device pages that left the tree, per pool, which nobody
        may read now (the caller restarts the requests that do). Run it only between
        cache operations (it changes the tree)."""
        landed = [t for t in self._writes if self.mover.done(t)]  # before `failures`
        failed = self.mover.failures(ticket)
        self._unforgotten += [self._writes.pop(t, []) for t, _ in failed]
        for t in landed:
            self._writes.pop(t, None)
        if failed:
            errors = [exc for _, exc in failed if exc is not None]
            self.counts["copy_errors"] += len(errors)
            self.counts["copies_voided"] += len(failed)
            log.warning("%d host copies failed (%d voided behind them), forgetting their "
                        "pages: %r", len(errors), len(failed) - len(errors), errors[:1])
        if self._unforgotten:
            self._forget(self._unforgotten)  # a fault here: the next `recover` goes on
            self._unforgotten = []
        lost_pages = {name: np.concatenate(p) for name, p in self._dropped.items()}
        self._dropped = {}
        self._settle_to(ticket)
        return lost_pages

    def _settle_to(self, ticket: int) -> None:
        """Every copy up to `ticket` landed (or was forgotten) for what follows: the
        caller waited for it, and copies land in order."""
        if ticket <= self.mover.last:
            self._settled = max(self._settled, ticket)

    def _forget(self, lost: list[Written]) -> None:
        """Tombstone the tree's cells that hold any of these pages and free them; the
        device pages that left the tree wait in `_dropped` for `recover` to report."""
        merged = self._merged(lost)
        before = len(self.tree.stranded)
        try:
            result = self.tree.forget(merged)
            self._note_dropped(result.freed)
        except BaseException:  # what it let go already leaves the tree all the same (a
            for freed in self.tree.stranded[before:]:  # page noted twice is still lost)
                if isinstance(freed, list):
                    self._note_dropped(self.tree.result_of(freed).freed)
            raise
        self.cache.release(result)

    def _spread(self, copies: list[Copy]) -> Written:
        """A copy that reads a page a failed copy should have written (its forgetting
        faulted: the tree still names it until the next `recover`) writes no valid bytes
        either: its destinations, to be forgotten with it. Reads only."""
        bad = self._merged(self._unforgotten)
        rows = {name: row for row, name in enumerate(self.names)}
        spread: Written = []
        for name, tier, src, dst in copies:
            lost = bad[tier][rows[name]]
            if lost.size:
                hit = np.isin(np.asarray(src), lost)
                if np.count_nonzero(hit):
                    spread.append((name, 1 - tier, np.asarray(dst)[hit]))
        return spread

    def _merged(self, written: list[Written]) -> list[list[np.ndarray]]:
        """The pages of `written`, one array per tier and pool row ([tier][row])."""
        rows = {name: row for row, name in enumerate(self.names)}
        parts: list[list[list[np.ndarray]]] = [[[] for _ in self.names] for _ in range(2)]
        for pieces in written:
            for name, tier, pages in pieces:
                parts[tier][rows[name]].append(np.asarray(pages, dtype=PAGE).ravel())
        return [[joined(p) for p in tier] for tier in parts]

    def _note_dropped(self, freed: dict[str, np.ndarray]) -> None:
        """Device pages that left the tree for a failed copy, for `recover` to report."""
        for name, pages in freed.items():
            if pages.size:
                self._dropped.setdefault(name, []).append(pages)

    # --------------------------------------------------------- from storage
    def land(self, tokens: np.ndarray, start: int, stop: int,
             write: Callable[[dict[str, np.ndarray]], None] | None = None) -> bool:
        """Put pages [start, stop) of `tokens`, read from storage, on the host under the
        tree's prefix (L3 -> L2); `write(pages)` fills the host pages, after the copies
        already submitted. False, changing nothing, when the prefix no longer ends at
        `start` or the host has no room."""
        cache, ps = self.cache, self.cache.layout.page_size
        peek = cache.match(tokens)
        if peek.prefix_len // ps != start:
            return False  # the tiers changed while storage answered
        # Host eviction must not take the prefix we attach to; transient: should the
        # unlock below be cut short, the cache's next operation releases it.
        cache.begin_transient()
        try:
            cache.lock(peek, transient=True)
            got = cache.alloc({n: stop - start for n in self.names}, HOST)
            if got is None:
                return False
            try:  # (a host page freed while a queued write still fills it is safe:
                if write is not None:  # whatever writes it next is queued after)
                    ticket = self.mover.run(lambda: write(got))
                    self._writes[ticket] = [(n, HOST, got[n]) for n in self.names]
                table = np.stack([got[n] for n in self.names])
            except BaseException:
                cache.free(got, HOST)
                raise
            try:
                cache.insert(tokens[:stop * ps], table, start, tier=HOST)
            except BaseException:  # what the tree did not adopt goes back
                cache.give_up(tokens[:stop * ps], table, start, HOST)
                raise
            return True
        finally:
            cache.end_transient()

    # ------------------------------------------------------------ write-back
    def alloc_device(self, need: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Device pages, as `PrefixCache.alloc`; under write-back the pages its eviction
        drops are copied to the host first (the host evicts its own LRU for room). None,
        changing nothing, when free plus evictable device pages fall short."""
        cache = self.cache
        if self.write_policy != "write_back":
            return cache.alloc(need)
        if not cache.can_alloc(need):
            return None
        # Leaf eviction frees every pool of a node at once: room for the largest shortfall
        # in every pool. Over an arena, free frames count in every pool's free pages: what
        # binds is the frames short, each as many pages as a frame holds of each pool (no
        # more than the device could spill: the host keeps what it need not let go).
        short = max((n - cache.pools[name].free_pages for name, n in need.items()), default=0)
        frames = cache.frames_short(need)
        if short <= 0 and frames <= 0:
            return cache.alloc(need)
        room = self._reserve({name: max(short, min(frames * cache.pages_per_frame(name),
                                                   self.tree.evictable(name)))
                              for name in self.names}, evict=True)
        got = None
        try:
            got = cache.alloc(need, DEVICE, room)
            self._settle(room)
        except BaseException:
            self._undo_spill(room)
            if got is not None:  # nobody will own them
                cache.free(got)
            raise
        return got

    def evict_device(self, pool: str, num_pages: int) -> int:
        """`PrefixCache.evict` on the device; under write-back what it drops goes to free
        host pages first (no host eviction). Returns the pages of `pool` that left."""
        if self.write_policy != "write_back":
            return self.cache.evict(pool, num_pages)
        room = self._reserve({}, evict=False)
        try:
            left = self.cache.evict(pool, num_pages, DEVICE, room)
            self._settle(room)
        except BaseException:
            self._undo_spill(room)
            raise
        return left

    def flush_device(self) -> None:
        """Drop every unlocked device page (write-back: into free host pages first)."""
        for name in self.names:
            self.evict_device(name, self.cache.pools[name].num_pages + 1)

    def _reserve(self, pages: Mapping[str, int], evict: bool) -> SpillRoom:
        """A room over the host pools for eviction to move device pages into; with
        `evict`, the host first lets its own LRU pages go until `pages[pool]` are free."""
        host = self.cache.host_pools
        if evict:
            for name in self.names:
                lack = pages.get(name, 0) - host[name].free_pages
                if lack > 0:
                    self.cache.evict(name, lack, HOST)
        return SpillRoom(self.names, host)

    def _settle(self, room: SpillRoom) -> None:
        """Copy what eviction moved into the room's host pages (before anything reuses the
        device pages: their copy tickets make the next owner wait). A fault before the copy
        is queued leaves `room.taken` for the caller's `_undo_spill`."""
        copies = room.copies()
        if copies:
            self._submit([(name, DEVICE, dev, host) for name, dev, host in copies])
            room.taken.clear()  # in flight: nothing left to undo
            self.counts["spilled"] += sum(host.size for _, _, host in copies)
        self.counts["spill_skipped"] += room.skipped

    def _undo_spill(self, room: SpillRoom) -> None:
        """After a fault: no copy will come for what the room still holds (an eviction
        that raised, or a `_settle` cut short), so the host shadows must not claim it. If
        undoing faults too, its host pages are forgotten as a failed copy's are (the next
        `recover`; a load of one before then is forgotten with it)."""
        if not room.taken:
            return
        never: Written = [(name, HOST, host) for name, _, host in room.copies()]
        try:
            self.cache.release(self.tree.unspill(room))
        except BaseException:
            self._unforgotten.append(never)
            raise
