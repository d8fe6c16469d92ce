"""Faults halfway through the tree's eviction walks and around what they let go (found by
attacks on the salvage of stranded pages; every test here failed before its mend): nothing
leaks, nothing is owned twice, and every unlocked page can still be evicted."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fail_at, serve, tiny_layout

from shadowradix.sim.replay import CountingMover
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tree import eviction as eviction_module
from shadowradix.tree.eviction import Eviction
from shadowradix.tree.radix import ShadowRadix


def _cache():
    cache = PrefixCache(tiny_layout(4), 8)
    serve(cache, list(range(13)))
    serve(cache, list(range(100, 113)))
    return cache


def test_a_fault_after_skipping_a_locked_leaf_loses_it_from_the_heap(monkeypatch):
    cache = PrefixCache(tiny_layout(4, window_pool=False, state=False), 8)
    a = list(range(13))
    b = list(range(100, 113))
    serve(cache, a)                 # oldest leaf
    handle = cache.lock(cache.match(a))   # a running request holds A: the walk skips it
    serve(cache, b)
    fail_at(monkeypatch, Eviction, "_remove_leaf", 1, MemoryError)  # ... then faults on B
    # (an ALL-only layout: no tombstone heap finds the nodes another way)
    with pytest.raises(MemoryError):
        cache.flush()
    monkeypatch.undo()
    cache.unlock(handle)
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})
    assert cache.tree.evictable("kv") == 6
    cache.flush()                   # every unlocked page should go
    left = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v == 0 for v in left.values()), f"flush left unlocked pages: {left}"


def test_then_an_allocation_that_evictable_promised_raises(monkeypatch):
    cache = PrefixCache(tiny_layout(4, window_pool=False, state=False), 8)
    a = list(range(13))
    b = list(range(100, 113))
    serve(cache, a)
    handle = cache.lock(cache.match(a))
    serve(cache, b)
    fail_at(monkeypatch, Eviction, "_remove_leaf", 1, MemoryError)
    with pytest.raises(MemoryError):
        cache.flush()
    monkeypatch.undo()
    cache.unlock(handle)
    need = {n: 8 for n in cache.layout.pool_names}
    assert cache.can_alloc(need)
    got = cache.alloc(need)   # AssertionError: eviction delivered less than evictable() promised
    assert got is not None


def test_a_fault_in_the_rooms_second_pool_leaks_the_first_pools_host_pages(monkeypatch):
    layout = tiny_layout(4)
    cache = PrefixCache(layout, 8, host_pages=12)
    host = HostTier(cache, CountingMover(), "write_back")
    for i in range(3):
        serve(cache, list(range(i * 100, i * 100 + 9)))
    tree = cache.tree
    pool = cache.host_pools[layout.pool_names[1]]
    real = pool.alloc

    def alloc(n):  # the host pool's alloc faults while an eviction walk runs
        if tree._freeing is not None:
            raise MemoryError("injected in the room's host alloc")
        return real(n)

    monkeypatch.setattr(pool, "alloc", alloc)
    with pytest.raises(MemoryError):
        host.alloc_device({n: 8 for n in layout.pool_names})
    monkeypatch.undo()
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in layout.pool_names})


def test_a_fault_while_stranded_pages_are_queued_leaks_them(monkeypatch):
    """`_release_pending` popped a stranded result before it queued it: a fault (an
    interrupt) in between lost it. The walk's pages now become the cache's entries in one
    step, in place (`_entries`): a fault while they are made changes nothing."""
    cache = _cache()
    fail_at(monkeypatch, Eviction, "_remove_leaf", 2, MemoryError)
    with pytest.raises(MemoryError):
        cache.flush()
    monkeypatch.undo()
    assert cache.tree.stranded, "the walk stranded nothing: the repro needs a salvage"
    fail_at(monkeypatch, PrefixCache, "_entries", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        cache.alloc({"kv": 0})
    monkeypatch.undo()
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})


@pytest.mark.parametrize("mode, point", [
    (mode, point) for mode in ("fixed", "arena")
    for point in ("add", "_enqueue", "_count", "note", "_keep_mask", "_touch")
    if mode == "arena" or point != "note"])  # the page owners map is kept over an arena
@pytest.mark.parametrize("nth", [1, 3])
def test_a_fault_halfway_through_a_hand_over_leaves_one_owner_per_page(mode, point, nth,
                                                                       monkeypatch):
    """An insert that raises after adopting some of a finishing request's pages: the lease
    then freed them while the tree held them ('a physical page is shadowed twice': the
    next owner's bytes would be served as the cached prefix), and counts, queues or the
    page owners map were left half made. The manager now keeps adopted pages out of what
    the lease frees and has the tree make its derived state again (`repair`)."""
    from shadowradix.pool.arena import Arena, plan_frames
    from shadowradix.tiers.manager import CacheManager
    from shadowradix.tree.lru import LRUHeap
    from shadowradix.tree.radix import ShadowRadix
    from shadowradix.tree.relocate import PageOwners

    owner = {"add": LRUHeap, "_enqueue": Eviction, "_count": Eviction, "note": PageOwners,
             "_touch": ShadowRadix, "_keep_mask": ShadowRadix}[point]
    layout = tiny_layout(4)
    cache = (PrefixCache(layout, 16) if mode == "fixed" else
             PrefixCache(layout, {}, arena=Arena(layout, 40 * plan_frames(layout).frame_bytes)))
    manager = CacheManager(cache)
    real = getattr(owner, point)
    calls, faults = [0], 0

    def in_hand_over(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise MemoryError(f"injected at {point} call {nth} of a hand-over")
        return real(*args, **kwargs)

    for i in range(8):
        # a shared first 2 pages, then each its own: the second insert splits the first
        tokens = np.concatenate([np.arange(8), np.arange(100 + 20 * i, 109 + 20 * i)]
                                ).astype(np.int32)
        lease = manager.admit(tokens, 17)
        assert lease is not None and manager.grow(lease, 17)
        monkeypatch.setattr(owner, point, in_hand_over)
        try:
            manager.finish(lease, tokens, 17)
        except MemoryError:
            faults += 1
            manager.release_orphans(set())
        monkeypatch.undo()
        manager.check_integrity()
    assert faults == 1
    cache.flush()
    manager.check_integrity()
    assert all(p.used_pages == 0 for p in cache.pools.values())


@pytest.mark.parametrize("kind", [KeyboardInterrupt, MemoryError])
def test_a_fault_inside_a_split_leaves_no_node_half_linked(monkeypatch, kind):
    """Node.split linked the head under the parent, then read the tail's key again and
    copied its arrays: a fault there left the tail (here a running request's locked node)
    detached, its pages leaked and the next hand-over built a node with tombstones in ALL
    pools. The split now makes everything first and links with plain assignments. The
    fault is armed at every key() after the first inside a split (there is none now)."""
    from shadowradix.tiers.manager import CacheManager
    from shadowradix.tree.node import Node

    cache = PrefixCache(tiny_layout(4), 40)
    manager = CacheManager(cache)
    t1 = np.arange(1000, 1029, dtype=np.int32)
    t2 = np.concatenate([np.arange(1000, 1012), np.arange(2000, 2017)]).astype(np.int32)
    a, b = manager.admit(t1, 29), manager.admit(t2, 29)
    manager.cache_prefix(a, t1, 25)  # A's node [0, 6), locked by A
    real_key, real_split = Node.key, Node.split

    def split(self, j, ps):  # key() raises after its first call inside a split
        calls = [0]

        def key(node, size):
            calls[0] += 1
            if calls[0] >= 2:
                raise kind("injected inside Node.split")
            return real_key(node, size)

        monkeypatch.setattr(Node, "key", key)
        try:
            return real_split(self, j, ps)
        finally:
            monkeypatch.setattr(Node, "key", real_key)

    monkeypatch.setattr(Node, "split", split)
    try:
        manager.finish(b, t2, 29)  # B's insert splits A's node at page 3
    except kind:
        manager.release_orphans({a})
    monkeypatch.undo()
    manager.check_integrity()
    manager.finish(a, t1, 29)
    cache.flush()
    manager.check_integrity()
    assert all(p.used_pages == 0 for p in cache.pools.values())


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("point", ["_touch", "_enqueue"])
def test_a_running_requests_hand_over_that_faults_leaves_no_dead_leaf(monkeypatch, policy,
                                                                     point):
    """A running request's hand-over (cache_prefix) that faults after linking its new
    leaf: the leaf has no resume point (the request keeps its window) and took no lock,
    so it stayed as 'an unlocked leaf no tier can resume from', even after an abort. The
    lease now locks it and names it its tail, as a hand-over that completes does."""
    from shadowradix.tiers.manager import CacheManager
    from shadowradix.tree.radix import ShadowRadix

    layout = tiny_layout(4)
    cache = PrefixCache(layout, 32, host_pages=32)
    manager = CacheManager(cache, HostTier(cache, CountingMover(), policy))
    tokens = np.arange(40, dtype=np.int32)
    lease = manager.admit(tokens, 40)
    assert lease is not None
    manager.cache_prefix(lease, tokens, 25)
    owner = ShadowRadix if point == "_touch" else Eviction
    fail_at(monkeypatch, owner, point, 1 if point == "_touch" else 2, MemoryError)
    with pytest.raises(MemoryError):
        manager.cache_prefix(lease, tokens, 29)
    monkeypatch.undo()
    manager.check_integrity()
    manager.abort(lease)  # the request fails alone, as the engine's _fail does
    manager.check_integrity()
    cache.flush()
    cache.flush(1)
    manager.check_integrity()
    assert all(p.used_pages == 0 for p in cache.pools.values())


@pytest.mark.parametrize("second", ["held_path", "_descend"])
def test_a_second_fault_while_reclaiming_never_gives_a_page_two_owners(monkeypatch, second):
    """After an insert that adopted pages faulted, reading what the tree holds faulted too:
    the lease kept its marks and freed pages the tree held. Now, when it cannot tell, all
    it handed over is the tree's (a leak at worst)."""
    from shadowradix.tiers.manager import CacheManager
    from shadowradix.tree.radix import ShadowRadix

    cache = PrefixCache(tiny_layout(4), 32)
    manager = CacheManager(cache)
    tokens = np.arange(29, dtype=np.int32)
    lease = manager.admit(tokens, 29)
    fail_at(monkeypatch, ShadowRadix, "_touch", 1, MemoryError)  # after it adopted them all
    fail_at(monkeypatch, ShadowRadix, second, 2 if second == "_descend" else 1, MemoryError)
    with pytest.raises(MemoryError):
        manager.finish(lease, tokens, 29)
    monkeypatch.undo()
    manager.release_orphans(set())
    tree_pages = {n: cache.tree.all_pages(n, 0) for n in cache.layout.pool_names}
    for name, pool in cache.pools.items():  # no page the tree holds was freed
        assert pool.in_use(tree_pages[name]).all(), name


# A lock of three nodes pins: 1 the deepest node's path, 2 its window, 3 the middle node,
# 4 the top one; a rollback after a fault at pin 3 pins back 4, 5 (the deepest); after
# one at 4, it pins back 5, 6 (the deepest) and 7 (the middle: resumed where it stopped).
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("first,second", [(3, 4), (3, 5), (4, 5), (4, 7)])
def test_a_lock_whose_rollback_faults_too_pins_nothing_for_good(monkeypatch, first, second,
                                                                kind):
    """A lock that faults halfway unlocks the nodes it locked; a second fault in that
    rollback left them locked by a handle nobody holds (their pages never evictable). The
    cache's next operation finishes the rollback, from where it stopped."""
    cache = PrefixCache(tiny_layout(4), 16)
    a = list(range(9))
    serve(cache, a)
    serve(cache, a[:4] + list(range(50, 55)))
    c = a[:8] + list(range(70, 75))
    serve(cache, c)
    m = cache.match(c)
    assert len(list(cache.tree.path(m.node))) == 3
    fail_at(monkeypatch, ShadowRadix, "_pin", first, kind)  # in the lock walk
    fail_at(monkeypatch, ShadowRadix, "_pin", second, kind)  # in its rollback
    with pytest.raises(kind, match=f"call {second}$"):
        cache.lock(m)
    monkeypatch.undo()
    assert any(n.full_lock for n in cache.tree.nodes())  # held, by nobody
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})
    assert all(n.full_lock == 0 and not n.window_lock.any() for n in cache.tree.nodes())
    cache.flush()
    left = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v == 0 for v in left.values()), f"flush left locked pages: {left}"


def test_a_rollback_left_unfinished_resumes_after_its_target_is_pruned(monkeypatch):
    """The rollback runs from the locked node up: when it faults, that node is unlocked
    already, and a running request's new leaf (no resume point) could be pruned before
    the cache's next operation mended the lock (an abort prunes its tail at once). The
    mend walked from the removed node, stopped at once, and left its ancestors locked for
    good. It now resumes at the deepest node the rollback left, which stays locked."""
    cache = PrefixCache(tiny_layout(4), 32)
    a = list(range(9))
    serve(cache, a)
    serve(cache, a[:4] + list(range(50, 55)))
    c = a[:8] + list(range(70, 79))  # a running request below them, its leaf unfinished
    m = cache.match(c)
    done, full = m.prefix_len // 4, len(c) // 4
    got = cache.alloc({p.name: full - done for p in cache.layout.pools})
    own = np.stack([got[p.name] for p in cache.layout.pools]).astype(np.int32)
    kept = {}
    for row, p in enumerate(cache.layout.pools):  # it keeps its window and state
        if p.retention.name != "ALL":
            own[row] = -1
            kept[p.name] = got[p.name]
    result = cache.insert(c, own, done, finished=False)
    assert len(list(cache.tree.path(result.node))) == 3
    # The lock pins the leaf (1, 2: its window), the middle (3), the top (4: fault); the
    # rollback the leaf (5, 6), the middle (7: fault): the top is left locked.
    fail_at(monkeypatch, ShadowRadix, "_pin", 4)
    fail_at(monkeypatch, ShadowRadix, "_pin", 7)
    with pytest.raises(RuntimeError, match="call 7$"):
        cache.lock(result)
    monkeypatch.undo()
    cache.prune(result.node)  # what an abort does with the request's tail
    assert not result.node.alive
    cache.free(kept)
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})
    assert all(n.full_lock == 0 and not n.window_lock.any() for n in cache.tree.nodes())
    cache.flush()
    left = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v == 0 for v in left.values()), f"flush left locked pages: {left}"


@pytest.mark.parametrize("kind", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_fault_between_forgetting_a_leaf_and_recording_its_pages_leaks_nothing(
        monkeypatch, nth, kind):
    """A walk unlinks a leaf, then records its pages as let go: a fault in between (an
    interrupt, or memory running out in the append) lost them for good, with the tree's
    counts still holding them. What was forgotten and not recorded is recorded when the
    walk unwinds, and the counts are made again."""
    cache = _cache()
    serve(cache, list(range(200, 213)))
    fail_at(monkeypatch, Eviction, "_record", nth, kind)
    with pytest.raises(kind):
        cache.flush()
    monkeypatch.undo()
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})
    cache.flush()
    left = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v == 0 for v in left.values()), f"flush left pages: {left}"


@pytest.mark.parametrize("kind", [KeyboardInterrupt, MemoryError])
def test_a_fault_as_a_walk_clears_a_tiers_table_leaks_nothing(monkeypatch, kind):
    """A device eviction under a host tier drops a node's device table (the node stays for
    the host): it cleared the table, then noted the pages as forgotten, so a fault in
    between (an interrupt) lost them for good. They are noted first now, with the table, so
    whichever side of the clear the fault falls on, each page has one owner."""
    layout = tiny_layout(4)
    cache = PrefixCache(layout, 12, host_pages=24)
    host = HostTier(cache, CountingMover(), "write_through")
    for i in range(3):
        serve(cache, list(range(i * 100, i * 100 + 9)))
    for node in list(cache.tree.nodes()):
        host.backup(node)
    calls = [0]
    real = eviction_module._Limbo

    def limbo(*args, **kwargs):  # the one a tier's table makes (a leaf's names its node)
        if len(args) < 3 and kwargs.get("node") is None:
            calls[0] += 1
            if calls[0] == 1:
                raise kind("injected as the device table is cleared")
        return real(*args, **kwargs)

    monkeypatch.setattr(eviction_module, "_Limbo", limbo)
    with pytest.raises(kind):
        host.flush_device()
    monkeypatch.undo()
    assert calls[0] == 1, "no device table was dropped: the repro needs one"
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in layout.pool_names})
    host.flush_device()
    cache.flush()
    left = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v == 0 for v in left.values()), f"flush left device pages: {left}"
