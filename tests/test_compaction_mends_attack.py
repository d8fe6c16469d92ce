"""Attack on b930e69 (compaction mends): the undo path of a move, the `need` rule, `sparse`
with `exclude`, and the 'nothing moves here' memo keyed on (free slots, owners.version)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fail_at
from hypothesis import given, settings
from hypothesis import strategies as st
from test_arena_compaction import tree_content_holds
from test_compaction_attack import (
    HPS,
    Injected,
    content_cache,
    conversations,
    frames_of,
    lock_seq,
    random_pool,
)

from shadowradix.pool.arena import Arena, ArenaPool
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.relocate import PageOwners


def all_match(cache: PrefixCache, seqs) -> bool:
    return all(cache.match(np.append(t, 0), record=False).prefix_len == HPS for t in seqs)


# ------------------------------------------------------------------ the memo

def _memo_gone_stale():
    """c4 frames: F0 holds a cached page (unlocked), F1..F3 three locked pages each. A
    request takes a c4 page in each frame (the last in F0) and gives two back: every frame
    is then held by a lock or the request, and a compaction finds nothing to move (memo
    (4 free slots, version v)). Then one request grows a page (into a locked frame) and the
    other gives its page in F0 back (a spec step's rejected draft, a shared window page):
    free slots 4 again, no insert, no unlock, so the version is v again; F0's only page
    is now the tree's and unlocked, and fits in a free slot of F2/F3."""
    cache, seqs = frames_of([1, 3, 3, 3])
    handles = [lock_seq(cache, s) for s in seqs[1:]]
    got = [cache.alloc({"c4": 1})["c4"] for _ in range(4)]
    c4 = cache.pools["c4"]
    f0 = int(cache.match(np.append(seqs[0], 0), record=False).page_table[1, 0]) // 4
    assert int(got[3][0]) // 4 == f0  # the request's page shares F0 with the cached one
    cache.free({"c4": got[0]})
    cache.free({"c4": got[1]})
    assert cache.compact(1) == 0  # nothing may move: every frame has a pinned page
    slots = c4.slots_free
    grown = cache.alloc({"c4": 1})["c4"]
    assert int(grown[0]) // 4 != f0
    cache.free({"c4": got[3]})
    assert c4.slots_free == slots  # what a memo on the free slots would see unchanged
    assert int(c4.in_use(np.arange(f0 * 4, f0 * 4 + 4)).sum()) == 1
    return cache, seqs, handles


def test_a_request_freeing_its_page_lets_compaction_move_what_it_could_not_before() -> None:
    """The memo says 'nothing could move then, and nothing turned movable since', keyed on
    the pool's free slots and the owner map's version. A running request's free (shrink,
    a shared window page) makes a frame's tree pages movable without bumping the version,
    and an allocation elsewhere puts the free slots back where they were: the stale memo
    skips the pool, so the frame never goes back."""
    cache, _, _ = _memo_gone_stale()
    assert cache.compact(1) == 1, "a stale 'nothing moves' memo skipped a movable frame"
    cache.check_integrity()


def test_a_stale_memo_costs_a_cached_prefix() -> None:
    """The same state, the arena full: a kv page needs a frame. Moving F0's one c4 page
    gives it back; with the stale memo a cached prefix is evicted instead."""
    cache, seqs, _ = _memo_gone_stale()
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.evicted.values()) == 0, f"evicted {cache.evicted}, moved {cache.moved}"
    assert all_match(cache, seqs)


# ------------------------------------------------------------------ sparse with exclude


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 2**16)),
                    min_size=1, max_size=40),
       limit=st.integers(0, 6), pick=st.lists(st.integers(0, 40), max_size=6))
@settings(max_examples=250, deadline=None, derandomize=True, database=None)
def test_sparse_with_exclude_matches_brute_force(ops, limit, pick) -> None:
    """`sparse(limit, exclude)` against a brute force: the most (up to `limit`) of the
    emptiest non-excluded frames whose pages fit in the free slots of the others (the
    excluded ones too); exclude may name free, full, foreign or repeated frames. Moving
    them gives back exactly those frames."""
    arena, pools, c4 = random_pool(ops, 30)
    k = c4.per_frame
    exclude = list(pick) + list(pick[:2])  # duplicates too
    pages = c4.sparse(limit, exclude)
    frames = sorted(set((pages // k).tolist()))
    in_use = c4.in_use(np.arange(c4.num_pages)).reshape(-1, k)
    held = np.flatnonzero(arena.owner == c4.row).tolist()
    cand = [f for f in held if not in_use[f].all() and f not in set(exclude)]
    used = {f: int(in_use[f].sum()) for f in cand}
    best = 0
    if c4.slots_free >= k and limit >= 1:
        order = sorted(cand, key=lambda f: used[f])  # stable, as argsort(kind="stable")
        for m in range(1, min(limit, len(order)) + 1):
            chosen = order[:m]
            room = c4.slots_free - sum(k - used[f] for f in chosen)
            if sum(used[f] for f in chosen) <= room:
                best = m
        want = sorted(order[:best])
    else:
        want = []
    assert frames == want
    assert not set(frames) & set(exclude)
    if frames:  # every page in use of those frames, nothing else
        expect = [f * k + s for f in frames for s in range(k) if c4._in_use[f * k + s]]
        assert sorted(pages.tolist()) == expect
        before = arena.free_frames
        new = c4.move(pages)
        assert not set((new // k).tolist()) & set(frames)
        assert arena.free_frames == before + len(frames)
    arena.check_integrity(pools)


# ------------------------------------------------------------------ the undo path

@pytest.mark.parametrize("kind", [Injected, KeyboardInterrupt])
def test_a_base_exception_in_the_copy_undoes_the_move(monkeypatch, kind) -> None:
    """KeyboardInterrupt (not an Exception) in copy_pages: the pages stay where they were,
    nothing leaks, nothing counted moved or evicted."""
    cache, seqs = frames_of([1, 3, 2])
    calls = fail_at(monkeypatch, PrefixCache, "copy_pages", 1, kind)
    with pytest.raises(kind):
        cache.alloc({"kv": 1})
    monkeypatch.undo()
    assert calls[0] == 1
    assert sum(cache.moved.values()) == 0 and sum(cache.evicted.values()) == 0
    cache.check_integrity()
    assert all_match(cache, seqs)
    c4 = cache.pools["c4"]
    assert c4.used_pages == len(seqs)
    assert cache.alloc({"kv": 1}) is not None  # and the next try moves it
    assert sum(cache.moved.values()) == 1 and sum(cache.evicted.values()) == 0
    cache.check_integrity()


@pytest.mark.parametrize("owner, name", [(ArenaPool, "free"), (Arena, "give")])
def test_a_fault_freeing_the_old_slots_after_a_move_counts_no_eviction(monkeypatch, owner,
                                                                        name) -> None:
    """The move is done (tree renamed, bytes copied); freeing the old slots faults: they
    wait in `_unreleased` (flagged not evicted), the next allocation frees them, and the
    eviction counters never count a moved page."""
    cache, seqs = frames_of([1, 3, 2])
    calls = fail_at(monkeypatch, owner, name, 1, Injected)
    with pytest.raises(Injected):
        cache.alloc({"kv": 1})
    monkeypatch.undo()
    assert calls[0] == 1
    assert sum(cache.moved.values()) == 1
    cache.check_integrity()
    assert all_match(cache, seqs)
    got = cache.alloc({"kv": 1})
    assert got is not None
    assert sum(cache.evicted.values()) == 0, cache.evicted
    assert sum(cache.moved.values()) == 1
    assert all_match(cache, seqs)
    cache.free(got)
    cache.check_integrity()
    cache.flush()
    cache.check_integrity()
    assert sum(cache.evicted.values()) == 2 * len(seqs)  # what the tree held, once each


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("owner, name", [(PageOwners, "relocate"), (ArenaPool, "claim")],
                         ids=["relocate", "claim"])
def test_faults_around_moves_in_a_manager_workload(monkeypatch, owner, name, nth) -> None:
    """The earlier attack's workload with faults where the mend added calls: every page
    the tree holds holds its data, the books balance, nothing leaks after a flush, and the
    pages evicted never exceed the pages the tree ever let go."""
    cache = content_cache(24)
    manager = CacheManager(cache)
    calls = fail_at(monkeypatch, owner, name, nth, Injected)
    conversations(manager, cache, 0, steps_=80, running=2)
    monkeypatch.undo()
    assert calls[0] >= nth
    cache.flush()
    manager.check_integrity()
    tree_content_holds(cache)
    for pname, pool in cache.pools.items():
        assert pool.used_pages == 0, f"{pname}: {pool.used_pages} pages leaked"
    assert cache.arena.free_frames == cache.arena.frames


def test_an_abort_that_faulted_halfway_can_be_retried() -> None:
    """`CacheManager.abort` says it is idempotent, and the engine (release_orphans) aborts
    again after a failed step. A fault freeing the second pool's pages (Arena.give of a
    frame going back) leaves the first pool's pages freed but still the lease's own: the
    retry frees them twice (ValueError: double free)."""
    cache = content_cache(24)
    manager = CacheManager(cache)
    tokens = np.arange(3 * 4 + 1, dtype=np.int32) % 50
    lease = manager.admit(tokens, tokens.size)
    assert lease is not None and lease.own.any(axis=1).sum() >= 2
    mp = pytest.MonkeyPatch()
    calls = fail_at(mp, ArenaPool, "free", 2, Injected)
    try:
        with pytest.raises(Injected):
            manager.abort(lease)
    finally:
        mp.undo()
    assert calls[0] == 2
    manager.abort(lease)  # the retry
    manager.check_integrity()
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in cache.layout.pool_names})
