"""Random operation sequences against a brute-force model of what the cache must do.

The model is simple on purpose: every page's content is a function of the
tokens it was written for (helpers.page_key), requests are held open across
steps so locks matter, and the brute-force answer for completeness is the
longest page-aligned prefix shared with any inserted sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from conftest import STEPS
from helpers import assert_sound, common_prefix, needed_pages, page_key, tiny_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from shadowradix.layout import KVLayout
from shadowradix.tiers import PrefixCache
from shadowradix.tree import CheckpointPolicy, LockHandle, MatchResult

PS = 4
# CI runs ~5,700 steps on the main machine and ~800 on each variant (<= 50 a run);
# SHADOWRADIX_HYPOTHESIS_SCALE=10 (or more) multiplies them for longer runs on demand
# (`make test-long` runs 20x).
SCALE = float(os.environ.get("SHADOWRADIX_HYPOTHESIS_SCALE", "1"))


def steps(runs: int) -> settings:
    return settings(max_examples=max(1, int(runs * SCALE)), stateful_step_count=50,
                    deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


@dataclass
class Open:
    """A request between admission and finish: it holds a lock and private pages."""

    tokens: list[int]
    match: MatchResult
    handle: LockHandle
    own: np.ndarray  # [pools, full pages - resume pages]: the request's own pages
    partial: dict[str, np.ndarray]


class CacheMachine(RuleBasedStateMachine):
    layout: KVLayout = tiny_layout(PS)
    policy = CheckpointPolicy()
    pages = 14
    budget: int | None = None  # bytes shared by every pool (pages are then ceilings)
    bounded = True  # eviction rules on; completeness is checked only when False

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(self.layout, self.pages, self.policy, budget=self.budget)
        self.content: list[dict[int, int]] = [{} for _ in self.layout.pools]
        self.open: list[Open] = []
        self.inserted: list[list[int]] = []
        self.history: list[list[int]] = []
        self.steps = -1  # the invariants also run once before the first rule

    # ----------------------------------------------------------- requests
    def _tokens(self, data: st.DataObject) -> list[int]:
        """Sharing is where bugs live: a cut of an earlier sequence plus a new tail, or
        whole pages drawn from a tiny set (so the same page recurs at other depths)."""
        tail = data.draw(st.lists(st.integers(0, 3), max_size=14))
        how = data.draw(st.sampled_from(["cut", "pages", "fresh"]))
        if how == "cut" and self.history:
            base = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(0, len(base)))
            return base[:cut] + tail
        if how == "pages":
            pages = data.draw(st.lists(st.integers(0, 2), max_size=6))
            return [p for p in pages for _ in range(PS)] + tail[:data.draw(st.integers(0, 3))]
        return tail

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        tokens = self._tokens(data)
        if not tokens:
            return
        self.history.append(tokens)
        cache, ps = self.cache, PS
        matched = data.draw(st.booleans())
        if matched:
            m = cache.match(tokens)
            assert_sound(cache, tokens, m, self.content)
        else:  # admitted before the tree held its prefix: computes everything, splits at insert
            m = MatchResult(0, 0, np.empty((len(self.layout.pools), 0), np.int32),
                            cache.tree.root)
        if matched and not self.bounded:
            shared = max((common_prefix(tokens, s) for s in self.inserted), default=0)
            want = min(shared // ps, (len(tokens) - 1) // ps) * ps
            assert m.prefix_len == want, (m.prefix_len, want)
        handle = cache.lock(m)
        done, full, total = m.prefix_len // ps, len(tokens) // ps, -(-len(tokens) // ps)
        got = cache.alloc({p.name: (full if p.ratio is None else total) - done
                           for p in self.layout.pools})
        if got is None:
            cache.unlock(handle)
            return
        own = np.empty((len(self.layout.pools), full - done), dtype=np.int32)
        partial = {}
        for row, spec in enumerate(self.layout.pools):
            own[row] = got[spec.name][:full - done]
            partial[spec.name] = got[spec.name][full - done:]
            for i, page in enumerate(got[spec.name].tolist()):
                self.content[row][page] = page_key(tokens, done + i, row, ps)
        self.open.append(Open(tokens, m, handle, own, partial))

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        prompt = data.draw(st.none() | st.integers(0, len(req.tokens) + 2 * PS))
        self.cache.insert(req.tokens, req.own, req.match.prefix_len // PS, prompt=prompt)
        self.cache.free(req.partial)
        self.cache.unlock(req.handle)
        self.inserted.append(req.tokens)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self._release(req)

    def _release(self, req: Open) -> None:
        self.cache.free({spec.name: np.concatenate([req.own[row], req.partial[spec.name]])
                         for row, spec in enumerate(self.layout.pools)})
        self.cache.unlock(req.handle)

    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        """A match that is never locked (a scheduler peeking): must be sound too."""
        tokens = self._tokens(data)
        assert_sound(self.cache, tokens, self.cache.match(tokens), self.content)

    # ------------------------------------------------------------ pressure
    @precondition(lambda self: self.bounded)
    @rule(data=st.data(), n=st.integers(0, 6))
    def evict(self, data: st.DataObject, n: int) -> None:
        self._evict_device(data.draw(st.sampled_from(self.layout.pool_names)), n)

    @precondition(lambda self: self.bounded)
    @rule()
    def flush(self) -> None:
        self._flush_device()

    def _evict_device(self, pool: str, n: int) -> None:
        self.cache.evict(pool, n)

    def _flush_device(self) -> None:
        self.cache.flush()

    # ---------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.steps += 1
        held: dict[str, list[np.ndarray]] = {name: [] for name in self.layout.pool_names}
        for req in self.open:
            for row, spec in enumerate(self.layout.pools):
                held[spec.name] += [req.own[row], req.partial[spec.name]]
        self.cache.check_integrity({k: np.concatenate(v) if v else np.empty(0, np.int32)
                                    for k, v in held.items()})

    @invariant()
    def locked_data_survives(self) -> None:
        for req in self.open:
            q = req.match.prefix_len // PS
            for row, pages in needed_pages(self.layout, q).items():
                name = self.layout.pools[row].name
                tree_pages = set(self.cache.tree.all_pages(name).tolist())
                for i in pages:
                    page = int(req.match.page_table[row, i])
                    assert page in tree_pages, f"locked page {page} of {name} left the tree"
                    assert self.content[row][page] == page_key(req.tokens, i, row, PS)

    def teardown(self) -> None:
        """No leak: release everything, evict everything, and every pool is entirely free."""
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        while self.open:
            self._release(self.open.pop())
        self.cache.flush()
        self.cache.check_integrity(held={})
        for pool in self.cache.pools.values():
            assert pool.free_pages == pool.num_pages, f"pool {pool.name!r} leaked pages"
        assert self.cache.tree.stats().nodes == 0


class WideWindowMachine(CacheMachine):
    layout = tiny_layout(PS, window=7)  # the window spans two pages


class EagerMachine(CacheMachine):
    policy = CheckpointPolicy(eager_window_release=True)


class PeriodicMachine(CacheMachine):
    policy = CheckpointPolicy(every_pages=2)


class AdaptiveMachine(CacheMachine):
    """Learned checkpoints in pools that share one byte budget; the evict rule asks the
    budget's own eviction (every pool at once) for a pool's worth of bytes."""

    policy = CheckpointPolicy(learn_resume=True)
    budget = 9 * sum(CacheMachine.layout.page_bytes().values())

    def _evict_device(self, pool: str, n: int) -> None:
        pb = self.layout.page_bytes()
        self.cache.release(self.cache.tree.evict_bytes(
            n * pb[pool], [pb[p.name] for p in self.layout.pools]))
        assert self.cache.used_bytes() <= self.budget


class LifetimeMachine(AdaptiveMachine):
    """The default's eviction under one budget: loose pages, kept checkpoints and leaves
    compete by age (tree/lifetime.py), from a small stretch so the three walks interleave
    from the first eviction on, and with the stretch moving with the misses."""

    policy = CheckpointPolicy(learn_resume=True, every_pages=2, adaptive_lifetime=True)

    def __init__(self) -> None:
        super().__init__()
        self.cache.tree.lifetime.log2_stretch = 1.0


class UnboundedAdaptiveMachine(CacheMachine):
    policy = CheckpointPolicy(learn_resume=True)
    pages = 10_000
    bounded = False


class NoShadowsMachine(CacheMachine):
    policy = CheckpointPolicy(tombstones=False)


class WindowOnlyMachine(CacheMachine):
    layout = tiny_layout(PS, all_pools=False, state=False)


class UnboundedMachine(CacheMachine):
    """Completeness: with memory to spare, a match reaches the longest shared prefix."""

    pages = 10_000
    bounded = False


class UnboundedNoShadowsMachine(UnboundedMachine):
    policy = CheckpointPolicy(tombstones=False)



def _test_case(machine: type[CacheMachine], runs: int = 20) -> type:
    case = machine.TestCase
    case.settings = steps(runs)
    return case


TestCache = _test_case(CacheMachine, runs=140)
TestWideWindow = _test_case(WideWindowMachine)
TestEager = _test_case(EagerMachine)
TestPeriodic = _test_case(PeriodicMachine)
TestNoShadows = _test_case(NoShadowsMachine)
TestAdaptive = _test_case(AdaptiveMachine)
TestLifetime = _test_case(LifetimeMachine)
TestUnboundedAdaptive = _test_case(UnboundedAdaptiveMachine)
TestWindowOnly = _test_case(WindowOnlyMachine)
TestUnbounded = _test_case(UnboundedMachine)
TestUnboundedNoShadows = _test_case(UnboundedNoShadowsMachine)
