"""A fault at any line of a lock or an unlock (an interrupt between two statements, as a
signal arrives) is all or nothing: a lock leaves every lock count as before or as after
the whole lock, and an unlock cut short is finished by the cache's next operation, each
node counted once. Before, a lock walk changed a node's counts one statement before it
noted the node as done, and an unlock marked its handle released one statement after its
walk: an interrupt between had the resumed unlock count a node twice (a negative lock
count, or a count other requests' locks rely on taken away: their pages evictable while
they read them), or the rolled-back lock leave a count for good (found by an attack with
line-level fault sweeps)."""

from __future__ import annotations

import copy

import pytest
from helpers import LineFault, interrupted_copies, serve, tiny_layout

from shadowradix.tiers import PrefixCache
from shadowradix.tree.radix import ShadowRadix

PS = 4
LOCK_CODE = [*(getattr(ShadowRadix, name) for name in (
    "lock", "unlock", "_lock_walk", "_undo_pending", "_pin") if hasattr(ShadowRadix, name)),
    PrefixCache.lock, PrefixCache.unlock]


def _counts(cache: PrefixCache) -> dict:
    """Every node's lock counts, by where it starts in the sequence."""
    return {(n.key(PS), n.start_page): (n.full_lock, n.window_lock.tolist())
            for n in cache.tree.nodes()}


def _world():
    """A tree of three requests sharing prefixes (a lock walk crosses several nodes), two
    of them locked, and the sequence the operation locks or unlocks."""
    cache = PrefixCache(tiny_layout(PS, window=5), 64)
    a = list(range(1, 5 * PS + 2))
    b = a[:2 * PS] + [99] * (2 * PS) + [7]
    c = a[:4 * PS] + [55] * PS + [8]
    for seq in (a, b, c):
        serve(cache, seq)
    for seq in (b, c):  # locks of others' that the operation's walk shares nodes with
        cache.lock(cache.match(seq))
    return cache, a


@pytest.mark.parametrize("level", ["cache", "tree"])
def test_a_fault_at_any_line_of_a_lock_locks_all_or_nothing_and_loses_no_lock(level):
    """All or nothing; and a lock that went through is in the owner's list (`into`), so
    the owner releases it (before, an interrupt as the lock returned left a lock nobody
    held: its prefix pinned for good)."""
    cache, a = _world()
    m = cache.match(a)
    arg = m if level == "cache" else m.node

    def lock(c: PrefixCache, target, into: list) -> None:  # type: ignore[no-untyped-def]
        if level == "cache":
            c.lock(target, into=into)
        else:
            c.tree.lock(target, into)

    before = _counts(cache)
    trial = copy.deepcopy((cache, arg))
    with LineFault(LOCK_CODE) as count:
        lock(*trial, [])
    after = _counts(trial[0])
    assert after != before
    for nth in range(1, count.lines + 1):
        t_cache, t_arg = copy.deepcopy((cache, arg))
        held: list = []
        with pytest.raises(KeyboardInterrupt), LineFault(LOCK_CODE, nth):
            lock(t_cache, t_arg, held)
        t_cache.check_integrity()  # mends first (a rollback a fault cut short)
        live = [h for h in held if not h.released]
        assert (_counts(t_cache), len(live)) in ((before, 0), (after, 1)), nth
        for handle in live:  # the owner lets go of what it holds
            t_cache.unlock(handle)
        assert _counts(t_cache) == before, nth


def test_a_fault_at_any_line_of_an_unlock_is_finished_once():
    """By the cache's next operation once the unlock began, else by the caller unlocking
    again (as `unlock` says); either way each node is counted once."""
    cache, a = _world()
    handle = cache.lock(cache.match(a))
    done = copy.deepcopy((cache, handle))
    done[0].unlock(done[1])
    after = _counts(done[0])
    for nth, (t_cache, t_handle) in interrupted_copies(
            LOCK_CODE, (cache, handle), lambda world: world[0].unlock(world[1])):
        t_cache.check_integrity()  # mends first: finishes the unlock once it began
        if not t_handle.released:  # the fault came first: the caller unlocks again
            t_cache.unlock(t_handle)
        assert t_handle.released and _counts(t_cache) == after, nth
        with pytest.raises(ValueError, match="already released"):
            t_cache.tree.unlock(t_handle)


def test_a_fault_at_any_line_of_a_split_leaves_the_tree_whole():
    """A request sharing a page of a node splits it (Node.split, ShadowRadix._split). An
    interrupt at any line leaves the tree as it was or split, whole either way; the
    request then goes through and nothing leaks. Before, an interrupt between linking the
    head into the parent and re-pointing the tail left the tail's parent link broken."""
    from shadowradix.tree.node import Node

    cache = PrefixCache(tiny_layout(PS, window=5), 64)
    a = list(range(1, 4 * PS + 2))
    serve(cache, a)
    b = a[:PS] + [99] * (3 * PS) + [7]  # shares a's first page: splits a's node
    for nth, t_cache in interrupted_copies([Node.split, ShadowRadix._split], cache,
                                           lambda c: serve(c, b)):
        t_cache.check_integrity()  # mends first
        serve(t_cache, b)
        t_cache.check_integrity()
        t_cache.flush()
        t_cache.check_integrity()
        assert not any(p.used_pages for p in t_cache.pools.values()), nth


def test_a_fault_at_any_line_of_a_transient_lock_never_pins_for_good():
    """A call's transient lock (an L3 landing's, HostTier.land), taken and ended as the
    landing does: a fault at any line of it, of the lock or of its end leaves nothing
    locked for good: once the cache's next operation ran, or, where the fault struck
    before the landing's end began, once the next landing started. Before, an interrupt
    as the lock returned (before the landing's try) left it locked, unexpired, for good."""
    cache, a = _world()
    before = _counts(cache)

    def landing(c: PrefixCache) -> None:
        c.begin_transient()
        try:
            c.lock(c.match(a), transient=True)
        finally:
            c.end_transient()

    code = [*LOCK_CODE, landing, PrefixCache.begin_transient, PrefixCache.end_transient]
    for nth, t_cache in interrupted_copies(code, cache, landing):
        t_cache.check_integrity()  # mends first: releases what the landing left
        landing(t_cache)  # the next landing
        t_cache.check_integrity()
        assert _counts(t_cache) == before and not t_cache._transient, nth
