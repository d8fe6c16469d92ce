"""The CacheManager against a brute-force model of what a request must read.

Requests are admitted, grow chunk by chunk, hand their computed prefix to the tree while
they run, finish, get preempted and get aborted, in random orders, over tiny pools where
eviction is constant. Every page carries a content key (a function of its pool and the
tokens up to its end); a chunk reads exactly what the model would (every ALL page so far,
the window before each position, the state at the resume point) and each of those must
hold its own tokens' content. A refused admission or growth must change nothing, and
nothing may leak in either tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from conftest import STEPS
from helpers import page_key, tiny_layout
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_tiers_machine import ContentMover
from test_tree_machine import PS, steps

from shadowradix.layout import Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager, Lease
from shadowradix.tree import CheckpointPolicy
from shadowradix.tree.tier import HOST


@dataclass(eq=False)
class Running:
    tokens: list[int]
    lease: Lease
    computed: int


class ManagerMachine(RuleBasedStateMachine):
    layout = tiny_layout(PS, window=5)
    policy = CheckpointPolicy()
    pages = 16
    host_pages: int | None = None
    write_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(self.layout, self.pages, self.policy, host_pages=self.host_pages)
        self.content: list[dict[int, int]] = [{} for _ in self.layout.pools]
        host = None
        if self.host_pages is not None:
            self.host_content: list[dict[int, int]] = [{} for _ in self.layout.pools]
            mover = ContentMover([self.content, self.host_content], self.layout.pool_names)
            host = HostTier(self.cache, mover, self.write_policy)  # type: ignore[arg-type]
        self.manager = CacheManager(self.cache, host)
        self.running: list[Running] = []
        self.history: list[list[int]] = []
        self.steps = -1

    def _tokens(self, data: st.DataObject) -> list[int]:
        tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=24))
        if self.history and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.history))
            return base[:data.draw(st.integers(0, len(base)))] + tail
        return tail

    def _books(self) -> tuple:
        tiers = [self.cache.pools] + ([self.cache.host_pools] if self.host_pages else [])
        return (tuple(p.free_pages for t in tiers for p in t.values()),
                self.cache.tree.stats().as_dict()["pools"])

    # ---------------------------------------------------------------- rules
    def _before_refusal(self) -> object:
        """What a refused admission or growth must leave as it was (see `_after_refusal`)."""
        return self._books()

    def _after_refusal(self, before: object, what: str) -> None:
        assert self._books() == before, f"a refused {what} changed the books"

    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        tokens = self._tokens(data)
        self.history.append(tokens)
        # A match drops the tail its split leaves with no resume point in any tier (no
        # lookup can ever resume there): garbage the admission's own match collects first.
        self.cache.match(np.asarray(tokens, dtype=np.int32), record=False)
        before = self._before_refusal()
        lease = self.manager.admit(np.asarray(tokens, dtype=np.int32), chunk)
        if lease is None:
            self._after_refusal(before, "admission")
            return
        req = Running(tokens, lease, lease.cached)
        self._read(req, lease.cached, resume=True)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 10))
    def step(self, data: st.DataObject, n: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        end = min(req.computed + n, len(req.tokens))
        if end == req.computed:
            return
        before = self._before_refusal()
        if not self.manager.grow(req.lease, end):
            self._after_refusal(before, "growth")
            self.running.remove(req)
            self.manager.preempt(req.lease, req.tokens, req.computed)
            return
        self._write(req, req.computed, end)
        self._read(req, end)
        req.computed = end
        self.manager.cache_prefix(req.lease, req.tokens, req.computed)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), how=st.sampled_from(["finish", "preempt", "abort"]))
    def leave(self, data: st.DataObject, how: str) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        if how == "finish":
            self.manager.finish(req.lease, req.tokens, req.computed)
        elif how == "preempt":
            self.manager.preempt(req.lease, req.tokens, req.computed)
        else:
            self.manager.abort(req.lease)
        assert not req.lease.live and not req.lease.handles

    @rule(data=st.data(), n=st.integers(1, 6))
    def evict(self, data: st.DataObject, n: int) -> None:
        pool = data.draw(st.sampled_from(self.layout.pool_names))
        if self.manager.host is not None:  # write-back copies what it drops
            self.manager.host.evict_device(pool, n)
        else:
            self.cache.evict(pool, n)

    @precondition(lambda self: self.host_pages is not None)
    @rule(data=st.data(), n=st.integers(1, 6))
    def evict_host(self, data: st.DataObject, n: int) -> None:
        self.cache.evict(data.draw(st.sampled_from(self.layout.pool_names)), n, HOST)

    # --------------------------------------------------------------- model
    def _write(self, req: Running, start: int, end: int) -> None:
        """The model writes every page the chunk touches (whole pages for checkpoints)."""
        for row, spec in enumerate(self.layout.pools):
            stop = end // PS if spec.retention is Retention.CHECKPOINT else -(-end // PS)
            for i in range(start // PS, stop):
                page = int(req.lease.table[row, i])
                assert page >= 0, f"row {row}: page {i} not allocated for a write"
                assert req.lease.own[row, i] or i >= req.lease.handed, "writes a tree page"
                self.content[row][page] = page_key(req.tokens, i, row, PS)

    def _read(self, req: Running, end: int, resume: bool = False) -> None:
        """What a forward reaching `end` reads: every ALL page touched, the window before
        `end`, and (at a resume) the state at the resume point."""
        table = req.lease.table
        for row, spec in enumerate(self.layout.pools):
            if spec.retention is Retention.ALL:
                pages = range(-(-end // PS) if not resume else end // PS)
            elif spec.retention is Retention.WINDOW:
                lo = max(end - spec.window + 1, 0) if end else 0
                pages = range(lo // PS, -(-end // PS) if not resume else end // PS)
            else:
                pages = [end // PS - 1] if resume and end else []
            for i in pages:
                page = int(table[row, i])
                assert page >= 0, f"row {row}: page {i} missing at {end}"
                assert self.content[row].get(page) == page_key(req.tokens, i, row, PS), (
                    f"row {row}: page {i} (physical {page}) holds other data at {end}")

    @invariant()
    def sound(self) -> None:
        self.steps += 1
        self.manager.check_integrity()
        assert len(self.manager.leases) == len(self.running)

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        while self.running:
            self.manager.abort(self.running.pop().lease)
        if self.manager.host is not None:
            self.manager.host.flush_device()
            self.cache.flush(HOST)
        else:
            self.cache.flush()
        self.manager.check_integrity()
        for tier in ([self.cache.pools] + ([self.cache.host_pools] if self.host_pages else [])):
            for pool in tier.values():
                assert pool.free_pages == pool.num_pages, f"pool {pool.name!r} leaked pages"


class EagerManagerMachine(ManagerMachine):
    policy = CheckpointPolicy(eager_window_release=True)


class NoShadowsManagerMachine(ManagerMachine):
    policy = CheckpointPolicy(tombstones=False)


class HostManagerMachine(ManagerMachine):
    host_pages = 12


class WriteBackManagerMachine(HostManagerMachine):
    write_policy = "write_back"


def _case(machine: type, runs: int) -> type:
    case = machine.TestCase
    case.settings = steps(runs)
    return case


TestManager = _case(ManagerMachine, 75)
TestEagerManager = _case(EagerManagerMachine, 20)
TestNoShadowsManager = _case(NoShadowsManagerMachine, 20)
TestHostManager = _case(HostManagerMachine, 30)
TestWriteBackManager = _case(WriteBackManagerMachine, 30)
