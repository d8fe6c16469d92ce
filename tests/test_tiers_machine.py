"""The foundation's state machine, extended with the host tier (HiCache L2).

Pages carry content in both tiers; the mover here copies that content at once
(the engine's real movers are tested against HF in test_engine_tiers.py). Every
write policy runs: a host hit must serve exactly the data written for its
tokens, a locked prefix survives both tiers' eviction, and after a long random
run nothing leaks in either tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from helpers import needed_pages, page_key
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_tree_machine import PS, CacheMachine, Open, _test_case

from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tree import MatchResult
from shadowradix.tree.tier import DEVICE, HOST


class ContentMover:
    """Copies page contents between the tiers' dicts, synchronously."""

    def __init__(self, content: list[list[dict[int, int]]], names: list[str]) -> None:
        self.content = content
        self.rows = {name: i for i, name in enumerate(names)}
        self.last = 0

    def submit(self, copies: Sequence[tuple[str, int, np.ndarray, np.ndarray]]) -> int:
        for name, tier, src, dst in copies:
            row = self.rows[name]
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                self.content[1 - tier][row][d] = self.content[tier][row][s]
        self.last += 1
        return self.last

    def run(self, fn: Callable[[], None]) -> int:
        fn()
        return self.last

    def done(self, ticket: int) -> bool:
        return True


class TieredMachine(CacheMachine):
    write_policy = "write_through"
    host_pages = 20

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(self.layout, self.pages, self.policy, host_pages=self.host_pages)
        self.host_content: list[dict[int, int]] = [{} for _ in self.layout.pools]
        mover = ContentMover([self.content, self.host_content], self.layout.pool_names)
        self.host = HostTier(self.cache, mover, self.write_policy,  # type: ignore[arg-type]
                             hit_threshold=2)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        tokens = self._tokens(data)
        if tokens:
            self.history.append(tokens)
            self._admit(tokens)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def revisit(self, data: st.DataObject) -> None:
        """Evict a finished sequence from the device, then send it again (a host hit)."""
        tokens = data.draw(st.sampled_from(self.inserted))
        self._evict_device(data.draw(st.sampled_from(self.layout.pool_names)),
                           data.draw(st.integers(1, 8)))
        self._admit(tokens + data.draw(st.lists(st.integers(0, 3), max_size=5)))

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def land_from_storage(self, data: st.DataObject) -> None:
        """Pages a store returned land on the host under the tree's prefix (L3 -> L2)."""
        tokens = data.draw(st.sampled_from(self.inserted))
        start = self.cache.match(tokens).prefix_len // PS
        stop = (len(tokens) - 1) // PS
        if stop <= start:
            return

        def write(pages: dict[str, np.ndarray]) -> None:
            for row, name in enumerate(self.layout.pool_names):
                for i, page in enumerate(pages[name].tolist()):
                    self.host_content[row][page] = page_key(tokens, start + i, row, PS)

        self.host.land(np.asarray(tokens, dtype=np.int32), start, stop, write)

    def _admit(self, tokens: list[int]) -> None:
        cache, ps = self.cache, PS
        m = cache.match(tokens)
        self._check_match(tokens, m)
        handle = cache.lock(m)
        done, full, total = m.prefix_len // ps, len(tokens) // ps, -(-len(tokens) // ps)
        load = self.host.load_need(m)
        need = {p.name: (full if p.ratio is None else total) - done + load.get(p.name, 0)
                for p in self.layout.pools}
        got = self.host.alloc_device(need)
        if got is None:
            cache.unlock(handle)
            return
        table = self.host.load(m, {n: got[n][:load.get(n, 0)] for n in got})
        self.host.after_match(m)
        own = np.empty((len(self.layout.pools), full - done), dtype=np.int32)
        partial = {}
        for row, spec in enumerate(self.layout.pools):
            mine = got[spec.name][load.get(spec.name, 0):]
            own[row] = mine[:full - done]
            partial[spec.name] = mine[full - done:]
            for i, page in enumerate(mine.tolist()):
                self.content[row][page] = page_key(tokens, done + i, row, ps)
        for row, pages in needed_pages(self.layout, done).items():  # what the request reads
            for i in pages:
                page = int(table[row, i])
                assert page >= 0 and self.content[row][page] == page_key(tokens, i, row, ps)
        resumed = MatchResult(m.prefix_len, m.logical_len, table, m.node)
        self.open.append(Open(tokens, resumed, handle, own, partial))

    def _check_match(self, tokens: list[int], m: MatchResult) -> None:
        """Sound in both tiers: every page named holds its tokens' data, and each page the
        resume reads is on the device or (marked for loading) on the host."""
        q = m.prefix_len // PS
        assert m.host_table is not None and m.load is not None and m.device_len is not None
        assert m.device_len <= m.prefix_len <= max(len(tokens) - 1, 0)
        for row, pages in needed_pages(self.layout, q).items():
            for i in pages:
                on_device = m.page_table[row, i] >= 0
                assert on_device or (m.load[row, i] and m.host_table[row, i] >= 0)
        for tier, table in ((DEVICE, m.page_table), (HOST, m.host_table)):
            content = self.content if tier == DEVICE else self.host_content
            for row in range(len(self.layout.pools)):
                for i in range(q):
                    page = int(table[row, i])
                    if page >= 0:
                        assert content[row].get(page) == page_key(tokens, i, row, PS), (
                            f"tier {tier} row {row}: page {page} at {i} holds other data")

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        result = self.cache.insert(req.tokens, req.own, req.match.prefix_len // PS)
        self.host.after_insert(result.node)
        self.cache.free(req.partial)
        self.cache.unlock(req.handle)
        self.inserted.append(req.tokens)

    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        tokens = self._tokens(data)
        self._check_match(tokens, self.cache.match(tokens))

    def _evict_device(self, pool: str, n: int) -> None:
        """Device pressure through the host tier (write-back copies what it drops)."""
        self.host.evict_device(pool, n)

    def _flush_device(self) -> None:
        self.host.flush_device()

    @precondition(lambda self: self.bounded)
    @rule(data=st.data(), n=st.integers(0, 6))
    def evict_host(self, data: st.DataObject, n: int) -> None:
        self.cache.evict(data.draw(st.sampled_from(self.layout.pool_names)), n, HOST)

    @precondition(lambda self: self.bounded)
    @rule()
    def flush_host(self) -> None:
        self.cache.flush(HOST)

    def teardown(self) -> None:
        while self.open:
            self._release(self.open.pop())
        self.host.flush_device()
        self.cache.flush(HOST)
        for pool in self.cache.host_pools.values():
            assert pool.free_pages == pool.num_pages, f"host pool {pool.name!r} leaked pages"
        super().teardown()


class WriteBackMachine(TieredMachine):
    write_policy = "write_back"


class SelectiveMachine(TieredMachine):
    write_policy = "write_through_selective"


class SmallHostMachine(TieredMachine):
    host_pages = 6


TestTiered = _test_case(TieredMachine, runs=60)
TestWriteBack = _test_case(WriteBackMachine, runs=30)
TestSelective = _test_case(SelectiveMachine, runs=20)
TestSmallHost = _test_case(SmallHostMachine, runs=20)
