"""Two interrupts, the second inside the handler of the first (helpers.DoubleFault: the
first at any line of a lock, an unlock or a request's life in the cache manager, the
second at one of the next calls), then the documented recovery: nothing is locked for
good or counted twice, and no page leaks, is freed twice or is both the tree's and a
request's. Before (found by an attack): a lock's rollback cut short left its nodes locked
by nobody, or an owner's unlock walked the wrong nodes (negative lock counts); a resumed
walk left the pinned counts off; a second fault as a hand-over's handler began left the
request owning pages the tree had adopted (an abort freed them: the next request would
write into them); and one as pages were being freed leaked them."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
from helpers import DoubleFault, LineFault, tiny_layout
from test_lock_faults import LOCK_CODE, _counts, _world
from test_manager_faults import CODE as MANAGER_CODE
from test_manager_faults import PS, _request

from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.radix import ShadowRadix

SECOND = 4  # the calls after the first fault the second is tried at


def _double_faults(codes, world, run):  # type: ignore[no-untyped-def]
    """(where, copy of `world`) for every first line and second call `run` goes through."""
    with LineFault(codes) as count:
        run(copy.deepcopy(world))
    for nth in range(1, count.lines + 1):
        for k in range(1, SECOND + 1):
            trial = copy.deepcopy(world)
            with DoubleFault(codes, nth, k) as fault, contextlib.suppress(KeyboardInterrupt):
                run(trial)
            if fault.hits < 2:
                break  # no call this far after the first fault
            yield fault.where, trial


@pytest.mark.parametrize("op", ["lock", "unlock"])
def test_a_second_interrupt_in_a_lock_or_unlock_handler_locks_nothing_for_good(op):
    cache, a = _world()
    before = _counts(cache)
    held: list = []
    if op == "unlock":
        cache.lock(cache.match(a), into=held)
    codes = [*LOCK_CODE, *(getattr(ShadowRadix, name) for name in ("_roll_back", "repair")
                           if hasattr(ShadowRadix, name))]

    def run(world) -> None:  # type: ignore[no-untyped-def]
        c, mine = world
        if op == "lock":
            c.lock(c.match(a), into=mine)
        else:
            c.unlock(mine[0])

    tried = 0
    for where, (t_cache, t_held) in _double_faults(codes, (cache, held), run):
        tried += 1
        t_cache.check_integrity()  # mends first
        for handle in t_held:  # the owner lets go of what it holds
            if not handle.released:
                t_cache.unlock(handle)
        t_cache.check_integrity()
        assert _counts(t_cache) == before, where
    assert tried > 20


def test_a_second_interrupt_in_a_managers_handler_leaks_nothing_and_frees_nothing_twice():
    cache = PrefixCache(tiny_layout(PS, window=5), 40, CheckpointPolicy(every_pages=2))
    manager = CacheManager(cache)
    tokens = np.random.default_rng(0).integers(0, 50, 6 * PS + 1).astype(np.int32)
    _request(manager, tokens[:3 * PS + 1])
    tried = 0
    for where, trial in _double_faults([*MANAGER_CODE, CacheManager.abort], manager,
                                       lambda m: _request(m, tokens)):
        tried += 1
        trial.release_orphans(set())  # the engine's recovery: what no request holds goes
        trial.check_integrity()
        assert not trial.cache.release_errors, where  # (a page queued twice: freed twice)
        _request(trial, tokens)
        trial.cache.flush()
        trial.check_integrity()
        assert not {n: p.used_pages for n, p in trial.cache.pools.items() if p.used_pages}, where
    assert tried > 100


def _unlock_cut_short_twice_then(pages_for, then) -> None:  # type: ignore[no-untyped-def]
    """An unlock of `a` cut short twice with a node's counts changed and not put back,
    then `then(cache, pages)` (before anything mends), then the mend and the owner's
    retry: every count as after a clean unlock and `then`."""
    cache, a = _world()
    held: list = []
    cache.lock(cache.match(a), into=held)
    got = cache.alloc({p.name: pages_for(a) for p in cache.layout.pools})
    pages = np.stack([got[p.name] for p in cache.layout.pools])
    codes = [*LOCK_CODE, *(getattr(ShadowRadix, name) for name in ("_roll_back", "repair")
                           if hasattr(ShadowRadix, name))]
    ref, ref_held, ref_pages = copy.deepcopy((cache, held, pages))
    ref.unlock(ref_held[0])
    then(ref, ref_pages, a)
    want = _counts(ref)
    with LineFault(codes) as count:
        copy.deepcopy(cache).unlock(copy.deepcopy(held)[0])
    tried = 0
    for nth in range(1, count.lines + 1):
        c, h, pg = copy.deepcopy((cache, held, pages))
        with DoubleFault(codes, nth, 1) as fault, contextlib.suppress(KeyboardInterrupt):
            c.unlock(h[0])
        phase, _, pending, _ = h[0].progress
        if fault.hits < 2 or phase == "free" or pending is None or pending[1] is None:
            continue  # wanted: a node's counts changed and not put back
        tried += 1
        then(c, pg, a)
        c.check_integrity()  # the cache's next operation mends first
        if not h[0].released:
            c.unlock(h[0])  # the owner's retry
        c.check_integrity()
        assert _counts(c) == want, fault.where
    assert tried


def test_an_unlock_cut_short_twice_then_a_split_of_its_node_counts_once():
    """An unlock walk cut short with a node's counts changed, its handler cut short too
    (the counts not put back), then an insert splits that node before the walk resumes:
    before, the new head copied the changed counts, only the tail was put back, and the
    resumed walk counted the head down twice (another request's lock on it gone: its
    pages evictable while it reads them). Splits now put back such a walk's node first."""

    def insert_splitting(c: PrefixCache, pg: np.ndarray, a: list[int]) -> None:
        d = a[:PS] + [78] * PS + [9]  # diverges inside the first node of a's path
        result = c.tree.insert(np.asarray(d, np.int32), pg, 0)  # as a hand-over does
        c.free({p.name: result.to_free[p.name] for p in c.layout.pools})

    _unlock_cut_short_twice_then(lambda a: 2, insert_splitting)


def test_an_unlock_cut_short_twice_then_another_lock_over_its_node_holds():
    """The same unlock cut short twice, then a hand-over locks the same prefix before the
    walk resumes (an insert and a lock run no mend first): before, the resumed walk wrote
    back the counts it had saved, erasing the new lock's count on that node (held by
    nobody there: its pages evictable while read). Every walk now puts back such a node
    before it changes any count."""

    def hand_over(c: PrefixCache, pg: np.ndarray, a: list[int]) -> None:
        result = c.insert(np.asarray(a, np.int32), pg, 0)  # (a is there: nothing adopted)
        c.lock(result, into=[])  # then a lock, no mend between

    _unlock_cut_short_twice_then(lambda a: len(a) // PS, hand_over)
