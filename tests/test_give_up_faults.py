"""Faults while a lease gives pages back (CacheManager._give_up) and inside the undo of an
arena compaction (PrefixCache._compact_pool).

    shrink      a speculative step gives back the pages grown for rejected drafts
    hand over   a request hands over pages the tree already holds (two requests with one
                prompt at once, or a resume that recomputes cached pages): its copies go
    share       a running request's held window / state pages that the tree also holds go,
                and it reads the tree's copy (at its own hand-over, or from `_room` when
                another request's admission or growth is short)
    compaction  the copy of a move faults, and then the undo itself

A fault is a RuntimeError from a pool's `free` (PagePool.free, ArenaPool.free, or
Arena.give when a frame goes back), on its 1st, 2nd, ... call. After it, the engine aborts
the request whose booking raised; the books must balance (every page one owner, nothing
leaked, nothing freed twice), what every live lease reads must still be a page it owns or
that the tree holds for it, and a fresh request must get a sound match.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from helpers import assert_sound, fail_at, page_key, tiny_layout
from test_arena import ContentCache
from test_compaction_attack import HLAYOUT, HPS, frames_of
from test_tiers_machine import ContentMover

from shadowradix.pool.allocator import PagePool
from shadowradix.pool.arena import Arena, ArenaPool, plan_frames
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager, Lease
from shadowradix.tree import CheckpointPolicy
from shadowradix.tree.relocate import PageOwners
from shadowradix.tree.tier import HOST

PS = 4
LAYOUT = tiny_layout(PS, window=5)
NAMES = LAYOUT.pool_names
TOKENS = np.arange(25, dtype=np.int32)  # 6 full pages and one token
KINDS = ["pages", "arena"]
HOSTS = [False, True]


class Injected(RuntimeError):
    pass


def free_point(kind: str) -> tuple[type, str]:
    return (PagePool, "free") if kind == "pages" else (ArenaPool, "free")


def fault(monkeypatch: pytest.MonkeyPatch, point: tuple[type, str], nth: int,
          call: Callable[[], object], kind: type[BaseException] = Injected) -> int:
    """Run `call` with `point`'s nth call raising `kind` (it must reach the caller), then
    lift the fault; returns how many calls `point` saw."""
    calls = fail_at(monkeypatch, *point, nth, kind)
    with pytest.raises(kind):
        call()
    monkeypatch.undo()
    return calls[0]


def build(kind: str, host: bool, pages: int | dict[str, int] = 64, frames: int = 120,
          policy: CheckpointPolicy | None = None) -> tuple[ContentCache, CacheManager]:
    """A cache whose pages' content is modelled (pool row -> page -> key), over fixed pools
    or an arena, with or without a host tier (write-through, content copied by the mover)."""
    policy = policy or CheckpointPolicy(every_pages=1)
    host_pages = 64 if host else None
    if kind == "pages":
        cache = ContentCache(LAYOUT, pages, policy, host_pages=host_pages)
    else:
        arena = Arena(LAYOUT, frames * plan_frames(LAYOUT).frame_bytes)
        cache = ContentCache(LAYOUT, {}, policy, host_pages=host_pages, arena=arena)
    cache.content = [{} for _ in NAMES]
    tier = None
    if host:
        mover = ContentMover([cache.content, [{} for _ in NAMES]], list(NAMES))
        tier = HostTier(cache, mover, "write_through")  # type: ignore[arg-type]
    return cache, CacheManager(cache, tier)


def write(cache: ContentCache, lease: Lease, tokens: np.ndarray) -> None:
    """What a forward writes: each of the lease's own pages gets its tokens' key."""
    for row in range(len(NAMES)):
        for i in np.flatnonzero(lease.own[row]).tolist():
            cache.content[row][int(lease.table[row, i])] = page_key(tokens, i, row, PS)


def reads_are_held(manager: CacheManager) -> None:
    """Every page a live lease reads or writes is its own or a device page the tree holds:
    every ALL page up to where it grew, and in the window / state pools the pages from its
    held resume pages on. A page id it names but owns not, and the tree holds not, is on a
    free list: the next allocation hands it to another request while this one still
    reads (or writes) it."""
    tree = manager.tree
    held = {n: set(tree.all_pages(n).tolist()) for n in NAMES}
    for lease in manager.leases:
        want = manager._want(lease.grown_to, lease.cached // PS)
        lo_short = max(lease.handed - manager.hold, 0)
        for row, name in enumerate(NAMES):
            lo = lo_short if row in manager.short_rows else 0
            for col in range(lo, min(want[row], lease.table.shape[1])):
                page = int(lease.table[row, col])
                if page < 0 or lease.own[row, col]:
                    continue
                assert page in held[name], (
                    f"pool {name!r}: a live lease reads page {page} at logical page {col}, "
                    f"which it does not own and the tree does not hold (free: "
                    f"{not bool(manager.cache.pools[name].in_use(np.array([page]))[0])})")


def fresh_cycle(cache: ContentCache, manager: CacheManager, tokens: np.ndarray) -> None:
    """A new request over `tokens`: its match is sound, it grows, finishes, and the books
    balance; then the same prompt again hits what it left."""
    for _ in range(2):
        m = cache.match(tokens, record=False)
        assert_sound(cache, tokens.tolist(), m, cache.content)
        lease = manager.admit(tokens, PS)
        assert lease is not None
        assert manager.grow(lease, tokens.size)
        write(cache, lease, tokens)
        reads_are_held(manager)
        manager.finish(lease, tokens, tokens.size)
        manager.check_integrity()
    m = cache.match(tokens, record=False)
    assert m.prefix_len == (tokens.size - 1) // PS * PS
    assert_sound(cache, tokens.tolist(), m, cache.content)


def abort_all(manager: CacheManager) -> None:
    for lease in list(manager.leases):
        manager.abort(lease)
    manager.check_integrity()


def spec_step(cache: ContentCache, manager: CacheManager) -> tuple[Lease, int]:
    """A request at 9 tokens grown to 17 for 8 drafts: 2 spare pages in every pool once
    they are rejected at 10 (shrink frees 4 pools: 4 free calls)."""
    tokens = np.arange(17, dtype=np.int32)
    lease = manager.admit(tokens, 9, length=9)
    assert lease is not None
    write(cache, lease, tokens)
    manager.cache_prefix(lease, tokens, 9)
    assert manager.grow(lease, 17)
    write(cache, lease, tokens)
    return lease, 17


# ------------------------------------------------------------------------ shrink

@pytest.mark.parametrize("nth", [1, 2, 3, 4])
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_shrink_then_abort_balances_the_books(monkeypatch, kind, host, nth) -> None:
    """Regression: a fault in shrink's nth free, then the abort the engine does (the
    request fails alone): every page one owner, nothing leaked or freed twice, and a fresh
    request gets a sound match."""
    cache, manager = build(kind, host)
    other = manager.admit(np.arange(100, 113, dtype=np.int32), 13)  # a bystander
    assert other is not None
    lease, _ = spec_step(cache, manager)
    assert fault(monkeypatch, free_point(kind), nth, lambda: manager.shrink(lease, 10)) == nth
    manager.check_integrity()
    manager.abort(lease)
    manager.check_integrity()
    reads_are_held(manager)
    abort_all(manager)
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("nth", [2, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_shrink_leaves_the_table_naming_freed_pages(monkeypatch, kind, nth) -> None:
    """Regression (failed before the fix named last):
    manager.py `shrink` frees the spare pages pool by pool (`_give_up`) and only
    then clears the table (`lease.table[spare] = -1`) and lowers `grown_to`. A fault in a
    later pool's free leaves the earlier pools' pages freed (own marks cleared) but still
    named by the table, inside `grown_to`. Abort is right (it frees by `own`), but the
    lease's own books say it holds pages it gave back: a `grow` up to the old `grown_to`
    returns True without allocating (`end <= lease.grown_to`), the next allocation of
    another request gets the same page, and both read and write it. Latent in today's
    engine (a fault in `_advance` fails the request and aborts it; an interrupt requeues
    it through preempt and abort), live for any caller that retries the step.
    Fixed: `_give_up` clears each pool's cells right after that pool's free, `shrink` sets
    `grown_to = end` even when a free raises (and marks the lease torn), and `grow` then
    fills only the cells of [have, want) that hold no page of the lease's own."""
    cache, manager = build(kind, False)
    lease, top = spec_step(cache, manager)
    fault(monkeypatch, free_point(kind), nth, lambda: manager.shrink(lease, 10))
    manager.check_integrity()
    assert manager.grow(lease, top)  # the drafts of the retried step
    other = manager.admit(np.arange(200, 217, dtype=np.int32), 17)
    assert other is not None
    mine = {n: set(lease.table[row, 2:5].tolist()) for row, n in enumerate(NAMES)}
    theirs = {n: set(other.table[row][other.own[row]].tolist()) for row, n in enumerate(NAMES)}
    twice = {n: sorted(mine[n] & theirs[n]) for n in NAMES if mine[n] & theirs[n]}
    assert not twice, f"pages handed to two requests at once: {twice}"
    reads_are_held(manager)


@pytest.mark.parametrize("nth", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_shrink_retried_after_a_fault_frees_nothing_twice(monkeypatch, kind, nth) -> None:
    """Regression: shrink retried after a fault halfway frees only what is still the
    lease's own (no double free), and the pages grown again are fresh ones."""
    cache, manager = build(kind, False)
    lease, top = spec_step(cache, manager)
    fault(monkeypatch, free_point(kind), nth, lambda: manager.shrink(lease, 10))
    manager.shrink(lease, 10)
    manager.check_integrity()
    assert lease.grown_to == 10
    assert manager.grow(lease, top)
    write(cache, lease, np.arange(17, dtype=np.int32))
    manager.check_integrity()
    reads_are_held(manager)
    manager.finish(lease, np.arange(17, dtype=np.int32), 10)
    manager.check_integrity()
    fresh_cycle(cache, manager, TOKENS)


# -------------------------------------------------------------------- hand over

def twins(cache: ContentCache, manager: CacheManager) -> tuple[Lease, Lease]:
    """Two requests with one prompt at once; b hands its first 2 pages over first, so a's
    hand-over of the same pages finds the tree's copies (dups in all 4 pools)."""
    a = manager.admit(TOKENS, TOKENS.size)
    b = manager.admit(TOKENS, TOKENS.size)
    assert a is not None and b is not None
    write(cache, a, TOKENS)
    write(cache, b, TOKENS)
    manager.cache_prefix(b, TOKENS, 8)
    return a, b


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_freeing_dups_at_cache_prefix_then_abort(monkeypatch, kind, host, nth) -> None:
    """Regression: a's `cache_prefix` frees its copies of the pages b handed over; a fault
    at the nth free, the engine aborts a (it fails alone), b runs to its end: the books
    balance and every match stays sound."""
    cache, manager = build(kind, host)
    a, b = twins(cache, manager)
    assert fault(monkeypatch, free_point(kind), nth,
                 lambda: manager.cache_prefix(a, TOKENS, 8)) == nth
    manager.check_integrity()
    manager.abort(a)
    manager.check_integrity()
    reads_are_held(manager)
    manager.cache_prefix(b, TOKENS, 16)
    reads_are_held(manager)
    manager.finish(b, TOKENS, TOKENS.size)
    manager.check_integrity()
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_freeing_dups_at_finish(monkeypatch, kind, host, nth) -> None:
    """Regression: b finished first; a's finish finds the tree holding every page it
    computed and frees its copies; a fault there (finish aborts in its `finally`)."""
    cache, manager = build(kind, host)
    a, b = twins(cache, manager)
    manager.finish(b, TOKENS, TOKENS.size)
    finished = fault(monkeypatch, free_point(kind), nth,
                     lambda: manager.finish(a, TOKENS, TOKENS.size))
    assert finished >= nth  # finish's abort frees more after the fault
    assert not a.live
    manager.check_integrity()
    manager.abort(a)
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_freeing_recomputed_cached_pages(monkeypatch, kind, host, nth) -> None:
    """Regression: the state checkpoints inside a cached prompt were evicted (tombstones),
    so a request sharing its first 4 pages resumes at the root and recomputes pages the
    tree still holds in kv, c2 and swa; the fault hits freeing its copies at its first
    hand-over."""
    cache, manager = build(kind, host, policy=CheckpointPolicy())
    first = manager.admit(TOKENS, TOKENS.size)
    assert first is not None
    write(cache, first, TOKENS)
    manager.finish(first, TOKENS, TOKENS.size)
    cache.evict("state", 1)
    if host:  # and its host copies
        cache.evict("state", 1, HOST)
    other = np.concatenate([TOKENS[:18], np.arange(90, 97, dtype=np.int32)])
    again = manager.admit(other, other.size)
    assert again is not None and again.done == 0 and again.logical_len == 16
    write(cache, again, other)
    assert fault(monkeypatch, free_point(kind), nth,
                 lambda: manager.cache_prefix(again, other, 16)) == nth
    manager.check_integrity()
    manager.abort(again)
    manager.check_integrity()
    fresh_cycle(cache, manager, other)
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("nth", [2, 3])
@pytest.mark.parametrize("where", ["shrink", "hand over"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_interrupt_halfway_then_the_requeue_path(monkeypatch, kind, where, nth) -> None:
    """Regression: a KeyboardInterrupt halfway through shrink or a dups hand-over; the
    engine's `_interrupted` requeues the request: `preempt` (its computed full pages
    join the tree) then `abort`. Nothing is handed or freed twice, nothing leaks."""
    cache, manager = build(kind, False)
    if where == "shrink":
        lease, _ = spec_step(cache, manager)
        tokens, computed = np.arange(17, dtype=np.int32), 10
        step = partial(manager.shrink, lease, computed)
    else:
        lease, _ = twins(cache, manager)
        tokens, computed = TOKENS, 8
        step = partial(manager.cache_prefix, lease, tokens, computed)
    fault(monkeypatch, free_point(kind), nth, step, KeyboardInterrupt)
    manager.preempt(lease, tokens, computed)
    manager.abort(lease)
    manager.check_integrity()
    reads_are_held(manager)
    abort_all(manager)
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("nth", [1, 2])
def test_a_fault_when_a_frame_goes_back_in_shrink(monkeypatch, nth) -> None:
    """Regression: over an arena, the fault is the frame's return (Arena.give) inside a
    pool's free during shrink; abort, then the books balance."""
    cache, manager = build("arena", False)
    lease, _ = spec_step(cache, manager)
    assert fault(monkeypatch, (Arena, "give"), nth, lambda: manager.shrink(lease, 10)) == nth
    manager.check_integrity()
    manager.abort(lease)
    manager.check_integrity()
    fresh_cycle(cache, manager, TOKENS)


# ------------------------------------------------------------------------ share

def bystander_with_a_copy(cache: ContentCache, manager: CacheManager) -> tuple[Lease, Lease]:
    """a and b with one prompt; b handed pages [0, 2) first, so a's hand-over at 8 found
    those; a's hand-over at 16 then gives the tree its copy of b's held window and state
    page 1: b holds a copy of pages the tree holds (`_held_copies`), which the next
    `_room` that comes up short shares (frees b's, b reads the tree's)."""
    a, b = twins(cache, manager)
    manager.cache_prefix(a, TOKENS, 8)
    manager.cache_prefix(a, TOKENS, 16)
    found = manager._held_copies(b)
    assert found is not None
    assert found[1][[2, 3]].all(), "b holds copies in both the window and the state pool"
    reads_are_held(manager)
    return a, b


def short_by_one(cache: ContentCache, kind: str) -> int:
    """Pages of swa an allocation asks for so that `_room` shares held copies: fixed pools,
    short by exactly what sharing b's copy gains (it shares only when that is enough); an
    arena shares before asking again, so any request too large."""
    if kind == "pages":
        return cache.pools["swa"].free_pages + cache.tree.evictable("swa") + 1
    return 40


@pytest.mark.parametrize("via", ["admit", "grow"])
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_sharing_a_bystanders_pages_leaves_it_reading_a_freed_page(
        monkeypatch, kind, host, via) -> None:
    """Regression (failed before the fix named last):
    another request's admission is short and `_room` (manager.py) shares b's
    held copies: `_share_held` calls `_give_up(view, own, dups)`, which frees b's window
    page (swa) and marks it not b's own, then faults freeing b's state page; the line
    `view[dups] = tree[dups]` that points b at the tree's copies never runs. The admission
    raises (the engine keeps every running request: 'exact on retry'), so b keeps running
    with its table naming the freed swa page as the window it reads; the next allocation
    hands that page to another request, which overwrites it. The books
    (`check_integrity`) see nothing: b's own marks are right, only its table is wrong.
    The same through `grow` of a (the scheduler's plan): the step raises, every request
    stays running.
    Fixed: `_give_up` points each pool's cells at their replacement (the tree's copy
    here, -1 in shrink, the tree's held copy in `_hand_over`) right after that pool's
    free, before the next pool's free can raise."""
    pages = {"kv": 96, "c2": 96, "swa": 32, "state": 96}
    cache, manager = build(kind, host, pages=pages, frames=48)
    a, b = bystander_with_a_copy(cache, manager)
    k = short_by_one(cache, kind)
    fresh = np.arange(300, 300 + k * PS + 1, dtype=np.int32)
    if via == "admit":  # another request's admission (it is aborted by admit)
        step = partial(manager.admit, fresh, k * PS)
    else:  # a's growth, k more pages in swa (the scheduler's plan: a stays running)
        step = partial(manager.grow, a, (7 + k) * PS)
    assert fault(monkeypatch, free_point(kind), 2, step) == 2
    manager.check_integrity()  # the books balance: only b's table is wrong
    assert a.live and b.live
    small = manager.admit(np.arange(400, 409, dtype=np.int32), 9)
    assert small is not None
    write(cache, small, np.arange(400, 409, dtype=np.int32))
    lo = b.handed - manager.hold
    row = NAMES.index("swa")
    window = set(b.table[row, lo:b.handed].tolist())
    theirs = set(small.table[row][small.own[row]].tolist())
    assert not window & theirs, (
        f"b reads window page(s) {sorted(window & theirs)} another request now owns")
    reads_are_held(manager)


@pytest.mark.parametrize("nth", [1, 3, 5, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_sharing_at_its_own_hand_over_then_abort(monkeypatch, kind, nth) -> None:
    """Regression: b's next hand-over (to 12) finds the tree holding all it gives (frees
    1-4: its dups), then shares the held window and state page it keeps, which the tree
    holds too (`_hand_over` -> `_share_held`, frees 5-6); the fault fails b alone, the
    abort balances the books."""
    cache, manager = build(kind, False)
    a, b = bystander_with_a_copy(cache, manager)
    assert fault(monkeypatch, free_point(kind), nth,
                 lambda: manager.cache_prefix(b, TOKENS, 12)) == nth
    manager.abort(b)
    manager.check_integrity()
    reads_are_held(manager)
    manager.finish(a, TOKENS, TOKENS.size)
    manager.check_integrity()
    fresh_cycle(cache, manager, TOKENS)


@pytest.mark.parametrize("kind", KINDS)
def test_sharing_without_a_fault_keeps_every_read(kind) -> None:
    """Regression (the guard for the test above): the same short admission, no fault; b
    reads the tree's copies, nothing any request reads is another's."""
    pages = {"kv": 96, "c2": 96, "swa": 32, "state": 96}
    cache, manager = build(kind, False, pages=pages, frames=48)
    _, b = bystander_with_a_copy(cache, manager)
    k = short_by_one(cache, kind)
    got = manager.admit(np.arange(300, 300 + k * PS + 1, dtype=np.int32), k * PS)
    assert manager._held_copies(b) is None
    if got is not None:
        manager.abort(got)
    manager.check_integrity()
    reads_are_held(manager)
    abort_all(manager)
    fresh_cycle(cache, manager, TOKENS)


# ------------------------------------------------------------------- compaction

def frames_with_content(keep: list[int],
                        host: bool = False) -> tuple[ContentCache, list[np.ndarray]]:
    """test_compaction_attack.frames_of with content, the rest of the arena held by a
    request; `host`: with a host tier (HostTier lets the arena compact frames no copy is
    in flight for)."""
    def make(arena: Arena) -> ContentCache:
        cache = ContentCache(HLAYOUT, {}, host_pages=64 if host else None, arena=arena)
        cache.content = [{}, {}]
        if host:  # sets the cache's frames_in_flight
            mover = ContentMover([cache.content, [{}, {}]], list(HLAYOUT.pool_names))
            HostTier(cache, mover, "write_through")  # type: ignore[arg-type]
        return cache

    cache, seqs = frames_of(keep, make=make)
    assert isinstance(cache, ContentCache)
    return cache, seqs


def compaction_sound(cache: ContentCache, seqs: list[np.ndarray]) -> None:
    """No leak (every page in use has one owner), the tree's pages hold their data."""
    cache.check_integrity(held={"kv": cache.held["kv"], "c4": np.empty(0, np.int32)})
    for tokens in seqs:
        probe = np.append(tokens, 0)
        m = cache.match(probe, record=False)
        assert m.prefix_len == HPS
        for row in range(2):
            page = int(m.page_table[row, 0])
            assert cache.content[row].get(page) == page_key(probe, 0, row, HPS), (
                f"row {row}: the tree's page {page} holds other data")


@pytest.mark.parametrize("host", HOSTS)
def test_a_fault_in_the_copy_undoes_the_move(host) -> None:
    """Regression: copy_pages faults, the undo runs whole: nothing moved, nothing leaked,
    the next allocation moves the page."""
    cache, seqs = frames_with_content([1, 3, 2], host)
    mp = pytest.MonkeyPatch()
    calls = fail_at(mp, ContentCache, "copy_pages", 1, Injected)
    try:
        with pytest.raises(Injected):
            cache.alloc({"kv": 1})
    finally:
        mp.undo()
    assert calls[0] == 1
    compaction_sound(cache, seqs)
    got = cache.alloc({"kv": 1})
    assert got is not None and sum(cache.moved.values()) == 1
    cache.held["kv"] = np.concatenate((cache.held["kv"], got["kv"]))
    compaction_sound(cache, seqs)


@pytest.mark.parametrize("host", HOSTS)
def test_a_fault_in_the_undos_relocate_leaves_the_tree_on_uncopied_pages(host) -> None:
    """Regression (failed before the fix named last):
    prefix_cache.py `_compact_pool` renames the tree's pages to the claimed
    slots (`relocate`) before it copies their bytes (`copy_pages`); when the copy faults
    the undo must rename them back. A fault in that rename (`PageOwners.relocate`, say a
    MemoryError growing its arrays) skips `pool.unclaim` too: the tree is left on the new
    slots, whose bytes were never copied (a match serves another prefix's data), and
    the old slots stay in use with no owner (a leak `check_integrity` reports).
    Fixed: it copies before it renames (claim, copy, relocate), so the undo is one
    `unclaim`, and `relocate` makes everything it writes before it writes any."""
    cache, seqs = frames_with_content([1, 3, 2], host)
    mp = pytest.MonkeyPatch()
    copies = fail_at(mp, ContentCache, "copy_pages", 1, Injected)
    fail_at(mp, PageOwners, "relocate", 2, Injected)
    try:
        with pytest.raises(Injected):
            cache.alloc({"kv": 1})
    finally:
        mp.undo()
    assert copies[0] == 1
    compaction_sound(cache, seqs)


@pytest.mark.parametrize("host", HOSTS)
def test_a_fault_in_the_undos_unclaim_leaks_the_claimed_slots(host) -> None:
    """Regression (failed before the fix named last):
    the copy faults, the undo renames the tree back, then `pool.unclaim(new)`
    faults: the claimed slots stay in use and nobody owns them (not the tree, not
    `_unreleased`), for good: the next claim overwrites `ArenaPool._claimed`, so no later
    undo finds them. Fixed: when unclaim raises they are queued in `_unreleased` (as
    `release` does for a free that faults), so the next allocation frees them."""
    cache, seqs = frames_with_content([1, 3, 2], host)
    mp = pytest.MonkeyPatch()
    fail_at(mp, ContentCache, "copy_pages", 1, Injected)
    unclaims = fail_at(mp, ArenaPool, "unclaim", 1, Injected)
    try:
        with pytest.raises(Injected):
            cache.alloc({"kv": 1})
    finally:
        mp.undo()
    assert unclaims[0] == 1
    got = cache.alloc({"kv": 1})  # whatever the next allocation frees or moves
    if got is not None:
        cache.held["kv"] = np.concatenate((cache.held["kv"], got["kv"]))
    compaction_sound(cache, seqs)


def interrupt_at_line(code: object, text: str, nth: int) -> Callable[..., object]:
    """A sys.settrace function that raises KeyboardInterrupt (a signal arriving between
    two bytecodes) the nth time the line of `code` containing `text` is about to run."""
    lines, first = inspect.getsourcelines(code)  # type: ignore[arg-type]
    target = first + next(i for i, line in enumerate(lines) if text in line)
    seen = [0]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target:
            seen[0] += 1
            if seen[0] == nth:
                raise KeyboardInterrupt(f"line {target}, time {nth}")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is getattr(code, "__code__", code) else None

    return trace


@pytest.mark.parametrize("host", HOSTS)
def test_an_interrupt_halfway_through_the_rename_undoes_it(host) -> None:
    """Regression: a KeyboardInterrupt between two of `relocate`'s writes of the nodes'
    ids (the map already names the new slots, one node renamed): the undo unclaimed the
    new slots, so the renamed node named a free slot whose bytes the next allocation
    overwrites (and the page it moved from stayed in use, nobody's). Fixed: the undo
    renames the tree back (idempotent) before it unclaims."""
    cache, seqs = frames_with_content([2, 3, 3], host)  # frame 0's 2 pages move
    sys.settrace(interrupt_at_line(PageOwners.relocate, "node.pages[row, col] = page", 2))
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.alloc({"kv": 1})
    finally:
        sys.settrace(None)
    assert sum(cache.moved.values()) == 0
    compaction_sound(cache, seqs)
    got = cache.alloc({"kv": 1})
    assert got is not None and sum(cache.moved.values()) == 2
    cache.held["kv"] = np.concatenate((cache.held["kv"], got["kv"]))
    compaction_sound(cache, seqs)
