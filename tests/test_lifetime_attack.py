"""Adversarial tests for eviction under one byte budget with a learned loose-point lifetime
(tree/lifetime.py, tree/eviction.py `evict_bytes` / `_evict_older`).

Random operation sequences (the CacheMachine of test_tree_machine.py, under a shared
budget) with the stretch forced to its floor, to small values, below the floor, to the
cap, and moving; other layouts; many locks. Plus hand-built scenarios: ties between a
kept checkpoint and a leaf under the static policies, ghosts across node splits, ghosts
of prompts of one page, repeated identical prompts, huge prompts, and the cost of
eviction on a bundled trace."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from helpers import serve, tiny_layout
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_tree_machine import PS, AdaptiveMachine, CacheMachine, steps

from shadowradix.tiers import PrefixCache
from shadowradix.tree import CheckpointPolicy
from shadowradix.tree.lifetime import MAX_STRETCH

LIFETIME = CheckpointPolicy(learn_resume=True, every_pages=2, adaptive_lifetime=True)
LIFETIME16 = CheckpointPolicy(learn_resume=True, every_pages=16, adaptive_lifetime=True)


def _row_bytes(layout) -> list[int]:  # type: ignore[no-untyped-def]
    pb = layout.page_bytes()
    return [pb[p.name] for p in layout.pools]


def _snapshot(cache: PrefixCache) -> list[tuple]:
    return sorted((n.id, n.start_page, n.pages.tobytes(), n.keep.tobytes(), n.last_access)
                  for n in cache.tree.nodes())


# ------------------------------------------------------------------ state machines
class _BudgetMachine(AdaptiveMachine):
    """AdaptiveMachine plus: the budget holds after every step, evict_bytes(0) changes
    nothing, and the stretch may be pinned (observe then cannot move it)."""

    policy = LIFETIME
    log2_stretch: float | None = None
    frozen = False

    def __init__(self) -> None:
        super().__init__()
        life = self.cache.tree.lifetime
        if self.log2_stretch is not None:
            life.log2_stretch = self.log2_stretch
        if self.frozen:
            life.observe = lambda loose, leaf: None  # type: ignore[method-assign]

    @rule()
    def evict_nothing(self) -> None:
        before = _snapshot(self.cache)
        used = {n: p.used_pages for n, p in self.cache.pools.items()}
        r = self.cache.tree.evict_bytes(0, _row_bytes(self.layout))
        assert all(v.size == 0 for v in r.freed.values())
        assert _snapshot(self.cache) == before
        assert {n: p.used_pages for n, p in self.cache.pools.items()} == used

    @rule(data=st.data())
    def set_stretch(self, data: st.DataObject) -> None:
        """The stretch moving between evictions (not only through observe)."""
        if not self.frozen:
            self.cache.tree.lifetime.log2_stretch = data.draw(
                st.sampled_from([0.0, 0.5, 1.0, 7.0, math.log2(MAX_STRETCH)]))

    @invariant()
    def under_budget(self) -> None:
        assert self.cache.used_bytes() <= self.budget


class StretchFloorMachine(_BudgetMachine):
    log2_stretch, frozen = 0.0, True  # a plain LRU over leaves, checkpoints, loose pages


class StretchSmallMachine(_BudgetMachine):
    log2_stretch, frozen = 0.25, True


class StretchBelowFloorMachine(_BudgetMachine):
    log2_stretch, frozen = -4.0, True  # loose pages age slower than leaves


class StretchCapMachine(_BudgetMachine):
    log2_stretch, frozen = math.log2(MAX_STRETCH), True


class StretchMovingMachine(_BudgetMachine):
    log2_stretch = 0.0


class WideWindowLifetimeMachine(_BudgetMachine):
    layout = tiny_layout(PS, window=7)
    budget = 9 * sum(tiny_layout(PS, window=7).page_bytes().values())
    log2_stretch = 0.0


class WindowOnlyLifetimeMachine(_BudgetMachine):
    layout = tiny_layout(PS, all_pools=False, state=False)
    budget = 9 * sum(tiny_layout(PS, all_pools=False, state=False).page_bytes().values())
    log2_stretch = 0.5


class StateOnlyLifetimeMachine(_BudgetMachine):
    layout = tiny_layout(PS, window_pool=False)
    budget = 9 * sum(tiny_layout(PS, window_pool=False).page_bytes().values())
    log2_stretch = 0.0


class TightBudgetManyLocksMachine(_BudgetMachine):
    """A budget of 4 pages in every pool and up to many open requests: most of the tree
    is locked most of the time."""

    budget = 4 * sum(CacheMachine.layout.page_bytes().values())
    pages = 30
    log2_stretch = 1.0


class StaticBudgetMachine(_BudgetMachine):
    policy = CheckpointPolicy(learn_resume=True, every_pages=2)


def _case(machine: type, runs: int = 40) -> type:
    case = machine.TestCase
    case.settings = steps(runs)
    return case


TestStretchFloor = _case(StretchFloorMachine)
TestStretchSmall = _case(StretchSmallMachine)
TestStretchBelowFloor = _case(StretchBelowFloorMachine)
TestStretchCap = _case(StretchCapMachine)
TestStretchMoving = _case(StretchMovingMachine)
TestWideWindowLifetime = _case(WideWindowLifetimeMachine)
TestWindowOnlyLifetime = _case(WindowOnlyLifetimeMachine)
TestStateOnlyLifetime = _case(StateOnlyLifetimeMachine)
TestTightBudgetManyLocks = _case(TightBudgetManyLocksMachine)
TestStaticBudget = _case(StaticBudgetMachine)


# ------------------------------------------------------------------ static policies
def _tie_setup(policy: CheckpointPolicy) -> tuple[PrefixCache, list[int], list[int]]:
    """Prefix P (2 pages) forks into X and Y; P holds a kept checkpoint at its end (a
    branch point) and was touched by Y's insert, so P and leaf Y share one stamp, while
    leaf X is older. Loose pages are gone already."""
    lay = tiny_layout(PS)
    rb = _row_bytes(lay)
    cache = PrefixCache(lay, 40, policy, budget=10**9)
    p, x, y = [1] * 8, [2] * 4, [3] * 4
    serve(cache, p + x + [0])
    cache.release(cache.tree.evict_bytes(1, rb))  # its loose window and state together
    m, _ = serve(cache, p + y + [0])  # stops at P's end with no resume point: a branch
    assert (m.prefix_len, m.logical_len) == (0, 8)
    cache.release(cache.tree.evict_bytes(1, rb))  # the loose pages Y's insert brought
    cache.release(cache.tree.evict_bytes(1, rb))  # leaf X, the oldest
    return cache, p + x + [0], p + y + [0]


@pytest.mark.parametrize("policy", [CheckpointPolicy(), CheckpointPolicy(learn_resume=True)],
                         ids=["end-only", "learn_resume"])
def test_static_policy_drops_a_tied_kept_checkpoint_before_the_leaf_as_before(policy):
    """Before this change `_evict_older` let the kept checkpoint go first when it was as old
    as the oldest leaf (`ckpt.last_access <= leaf.last_access`); now the leaf walk comes
    first in `walks` and min() keeps the first of equal stamps, so a whole prefix (leaf Y,
    every pool) goes where only P's checkpoint (its window and state pages) went before.
    A static policy's choice of victim changed."""
    cache, _, py = _tie_setup(policy)
    lay = cache.layout
    r = cache.tree.evict_bytes(1, _row_bytes(lay))
    cache.release(r)
    assert r.freed["kv"].size == 0, (
        f"a whole leaf went (freed {({k: v.tolist() for k, v in r.freed.items()})}) where "
        "the equally old kept checkpoint went before")
    assert cache.peek(py).logical_len == 12  # leaf Y still there


def test_static_policy_takes_loose_pages_before_anything_else():
    lay = tiny_layout(PS)
    cache = PrefixCache(lay, 40, CheckpointPolicy(every_pages=2), budget=10**9)
    serve(cache, list(range(8)) + [9] * 12 + [1])  # 5 pages, kept at 2, 4 and 5
    serve(cache, [7] * 21)  # a newer sequence with loose pages too
    old = next(n for n in cache.tree.nodes() if n.tokens[0] == 0)
    loose_before = int(np.count_nonzero((old.pages >= 0) & ~old.keep))
    assert loose_before
    r = cache.tree.evict_bytes(1, _row_bytes(lay))
    cache.release(r)
    assert r.freed["kv"].size == 0 and r.freed["c2"].size == 0
    # Every row's loose pages of the oldest node first; kept pages untouched.
    assert np.all(old.pages[old.keep] >= 0)


# ------------------------------------------------------------------ ghosts
def _lifetime_cache(pages: int = 200, log2: float = 0.0, budget: int = 10**9) -> PrefixCache:
    cache = PrefixCache(tiny_layout(PS), pages, LIFETIME16, budget=budget)
    cache.tree.lifetime.log2_stretch = log2
    return cache


def _evict_all_unlocked(cache: PrefixCache) -> None:
    cache.release(cache.tree.evict_bytes(10**9, _row_bytes(cache.layout)))


def test_a_ghost_survives_a_split_of_its_parent_and_still_counts():
    """A leaf X under P is evicted (ghost keyed by P's id); then P is split by a third
    prompt. The tail keeps P's id and still ends where X hung, so a match that stops there
    finds the ghost; the head must not."""
    cache = _lifetime_cache(log2=0.0)
    p, x, y = [1] * 12, [2] * 8, [3] * 8
    serve(cache, p + x + [0])
    serve(cache, p + y + [0])
    serve(cache, p + y + [0])  # Y newer than X
    x_leaf = next(n for n in cache.tree.nodes() if n.tokens[0] == 2)
    h = cache.lock(cache.match(p + y + [0]))
    for _ in range(4):  # at stretch 1 X's loose pages go first (a tie), then X
        if x_leaf.alive:
            cache.release(cache.tree.evict_bytes(1, _row_bytes(cache.layout)))
    assert not x_leaf.alive, "the oldest leaf X should have gone"
    assert len(cache.tree.lifetime) >= 1
    cache.unlock(h)
    serve(cache, p[:4] + [5] * 8 + [0])  # splits P after its first page
    m = cache.match(p + x + [0], record=False)
    assert m.ghost is not None and not m.ghost.loose
    assert 1 <= m.ghost.pages <= (len(p + x + [0]) - 1) // PS - m.logical_len // PS
    m2 = cache.match(p[:4] + x + [0], record=False)  # stops at the head's end: no ghost
    assert m2.ghost is None
    cache.check_integrity()
    _evict_all_unlocked(cache)
    assert all(pool.used_pages == 0 for pool in cache.pools.values())


def test_a_ghost_under_the_root_and_a_prompt_of_one_page():
    cache = _lifetime_cache(log2=0.0)
    a = [4] * 8 + [0]
    serve(cache, a)
    _evict_all_unlocked(cache)
    assert cache.tree.stats().nodes == 0 and len(cache.tree.lifetime) >= 1
    assert cache.match([4] * PS).ghost is None  # one page: nothing past the stop
    short = cache.match([4] * PS + [1], record=False)  # a page and a token: one page
    assert short.ghost is not None and short.ghost.pages == 1
    m = cache.match(a, record=False)
    assert m.ghost is not None and m.ghost.pages <= 2
    cache.record(m)
    assert cache.match(a, record=False).ghost is None  # counted once, then forgotten
    cache.check_integrity()


def test_repeated_identical_prompts_between_evictions_keep_the_ghost_table_sound():
    cache = _lifetime_cache(log2=0.0)
    prompt = [9] * 40 + [1]
    for _ in range(50):
        m, _ = serve(cache, prompt)
        assert m.page_table.shape[1] == m.prefix_len // PS
        _evict_all_unlocked(cache)
        cache.check_integrity(held={})
    assert len(cache.tree.lifetime) <= max(1024, cache.tree._n_nodes)
    assert 0.0 <= cache.tree.lifetime.log2_stretch <= math.log2(MAX_STRETCH)
    assert all(pool.used_pages == 0 for pool in cache.pools.values())


def test_a_stale_match_recorded_after_its_ghost_was_forgotten_changes_nothing_bad():
    cache = _lifetime_cache(log2=3.0)
    a = [6] * 16 + [0]
    serve(cache, a)
    _evict_all_unlocked(cache)
    m1 = cache.match(a, record=False)
    m2 = cache.match(a, record=False)
    assert m1.ghost is not None and m2.ghost == m1.ghost
    cache.record(m1)
    before = cache.tree.lifetime.log2_stretch
    cache.record(m2)  # the same ghost a second time: forget() is idempotent
    assert cache.tree.lifetime.log2_stretch >= before
    assert 0.0 <= cache.tree.lifetime.log2_stretch <= math.log2(MAX_STRETCH)


def test_huge_prompts_under_a_tight_budget_keep_the_budget_and_leak_nothing():
    lay = tiny_layout(PS)
    page = sum(lay.page_bytes().values())
    for log2 in (0.0, 2.0, math.log2(MAX_STRETCH)):
        cache = PrefixCache(lay, 20_000, LIFETIME16, budget=6000 * page)
        cache.tree.lifetime.log2_stretch = log2
        rng = np.random.default_rng(int(log2 * 10))
        base = rng.integers(0, 50, 4 * 4000).tolist()
        for i in range(6):
            tokens = base[:4 * 1000 * (i % 4 + 1)] + rng.integers(0, 50, 4 * 700).tolist()
            serve(cache, tokens)
            assert cache.used_bytes() <= cache.budget
        cache.check_integrity(held={})
        cache.flush()
        assert all(pool.used_pages == 0 for pool in cache.pools.values())


def test_many_locks_hold_their_pages_through_adaptive_eviction():
    lay = tiny_layout(PS)
    page = sum(lay.page_bytes().values())
    cache = PrefixCache(lay, 400, LIFETIME16, budget=120 * page)
    cache.tree.lifetime.log2_stretch = 0.0
    rng = np.random.default_rng(3)
    handles, held = [], []
    for i in range(40):
        tokens = [i % 5] * 8 + rng.integers(0, 4, 12).tolist()
        serve(cache, tokens)
        m = cache.match(tokens)
        if i % 2 == 0 and m.prefix_len:
            handles.append(cache.lock(m))
            held.append(m)
        assert cache.used_bytes() <= cache.budget
    tree_pages = {p.name: set(cache.tree.all_pages(p.name).tolist()) for p in lay.pools}
    for m in held:  # the pages each lock's resume needs are still in the tree
        q = m.prefix_len // PS
        for row, spec in enumerate(lay.pools):
            need = range(q) if spec.ratio is not None or spec.retention.name == "ALL" else ()
            for i in need:
                assert int(m.page_table[row, i]) in tree_pages[spec.name]
    for h in handles:
        cache.unlock(h)
    cache.check_integrity(held={})
    cache.flush()
    assert all(pool.used_pages == 0 for pool in cache.pools.values())


# ------------------------------------------------------------------ cost
def test_adaptive_eviction_costs_no_more_than_twice_the_static_on_a_bundled_trace():
    from shadowradix.layout import deepseek_v4_pro
    from shadowradix.sim.replay import replay
    from shadowradix.sim.simulate import PolicyChoice, make_cache
    from shadowradix.sim.sizing import GB
    from shadowradix.sim.trace import bundled_trace, load_trace

    lay = deepseek_v4_pro(dtype="fp8")
    trace = load_trace(bundled_trace("conversation"), limit=1500)
    spent = {}
    for name, pol, log2 in (("static", CheckpointPolicy(learn_resume=True, every_pages=16),
                             None), ("floor", LIFETIME16, 0.0), ("learned", LIFETIME16, None)):
        cache = make_cache(lay, PolicyChoice(name, pol, None), 16 * GB)
        if log2 is not None:
            cache.tree.lifetime.log2_stretch = log2
        t0 = time.perf_counter()
        replay(cache, trace, with_output=True, chunk_pages=32)
        spent[name] = (time.perf_counter() - t0, cache.evict_seconds)
        assert cache.used_bytes() <= cache.budget
        cache.flush()
        assert all(p.used_pages == 0 for p in cache.pools.values())
    for name in ("floor", "learned"):
        assert spent[name][1] <= 2 * spent["static"][1] + 0.5, spent
