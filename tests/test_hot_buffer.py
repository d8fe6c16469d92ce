"""HiSparse's hot buffer against brute force: every read returns what the C4 pool holds at
the selected entries' current addresses (never a stale copy, whatever page tables do), and
its hits and misses equal the offline LRU replay of the same stream."""

from __future__ import annotations

import numpy as np
import torch
from conftest import STEPS
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_tree_machine import steps

from shadowradix.sparse import AccessStream, replay
from shadowradix.sparse.hot_buffer import HotBuffers

PER_PAGE = 4  # C4 entries per page
PAGES = 64  # physical pages in the pool
LAYER = 3


class Pool:
    """A C4 pool whose every entry holds (its address, the generation that wrote it), and a
    request's page table over it."""

    def __init__(self) -> None:
        self.data = torch.zeros((PAGES * PER_PAGE, 2))
        self.data[:, 0] = torch.arange(PAGES * PER_PAGE, dtype=torch.float32)
        self.table = np.arange(PAGES, dtype=np.int64)[::-1].copy()  # logical -> physical
        self.generation = 0

    def address(self, ids: torch.Tensor) -> torch.Tensor:
        table = torch.from_numpy(self.table)
        return table[ids // PER_PAGE] * PER_PAGE + ids % PER_PAGE

    def move(self, logical: int, physical: int) -> None:
        """Logical page `logical` now lives at `physical`, holding freshly written data (a
        page's data never changes while it stays at one place in the table)."""
        self.generation += 1
        self.table[logical] = physical
        rows = slice(physical * PER_PAGE, (physical + 1) * PER_PAGE)
        self.data[rows, 1] = self.generation


def read(hot, pool: Pool, selected: list[int], count: int, top_k: int) -> torch.Tensor:
    picked = torch.tensor(selected + [0] * (top_k - len(selected)))[None]
    valid = torch.arange(top_k)[None] < len(selected)
    out, = hot.fetch(LAYER, pool.data, [hot.plan(LAYER, pool.address, picked, valid, count)])
    assert out.shape == (1, top_k, 2)
    want = pool.data[pool.address(torch.tensor(selected, dtype=torch.long))]
    assert torch.equal(out[0, :len(selected)], want), "a read returned another entry's data"
    return out


@st.composite
def streams(draw) -> AccessStream:
    top_k = draw(st.integers(1, 5))
    count = draw(st.integers(0, 12))
    out = []
    for _ in range(draw(st.integers(1, 40))):
        count += draw(st.sampled_from([0, 0, 1]))
        if count:
            k = draw(st.integers(0, min(top_k, count)))
            out.append((draw(st.permutations(range(count)))[:k], count))
        else:
            out.append(([], 0))
    return AccessStream.from_steps(top_k, out)


@settings(max_examples=150, deadline=None)
@given(stream=streams(), extra=st.integers(1, 12))
def test_counters_equal_the_lru_replay_and_reads_are_right(stream, extra):
    capacity = stream.top_k + extra
    arena = HotBuffers([LAYER], 1, capacity, PER_PAGE, (2,), torch.float32, "cpu")
    hot, pool = arena.acquire(), Pool()
    hot.decoding = True
    for ids, count in stream.steps():
        if count:  # the model asks only once an entry exists
            read(hot, pool, ids.tolist(), count, stream.top_k)
    want = replay(stream, capacity, "lru")
    fast = arena.counts["fast_path_lookups"]
    assert (arena.hits[LAYER], arena.misses[LAYER]) == (want.hits, want.misses)
    assert fast == sum(1 for c in stream.counts if 0 < c <= capacity)


def test_prefill_chunks_stage_the_union_once_and_leave_residency_alone():
    arena = HotBuffers([LAYER], 1, 6, PER_PAGE, (2,), torch.float32, "cpu")
    hot, pool = arena.acquire(), Pool()
    picked = torch.tensor([[0, 5, 9], [5, 9, 2], [9, 0, 0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, False, False]])
    out, = hot.fetch(LAYER, pool.data, [hot.plan(LAYER, pool.address, picked, valid, 12)])
    assert torch.equal(out[valid], pool.data[pool.address(picked[valid])])
    assert arena.counts["staged"] == 4 and arena.hits[LAYER] == arena.misses[LAYER] == 0
    assert arena.counts["bytes_moved"] == 4 * 2 * 4


def test_sets_are_handed_out_once_and_come_back():
    arena = HotBuffers([1, 3], 2, 6, PER_PAGE, (2,), torch.float32, "cpu")
    a, b = arena.acquire(), arena.acquire()
    assert {a.slot, b.slot} == {0, 1} and arena.acquire() is None and arena.free == 0
    arena.release(a)
    arena.release(a)  # twice is harmless
    assert arena.free == 1 and arena.stats()["in_use"] == 1


class HotBufferMachine(RuleBasedStateMachine):
    """Decode steps interleaved with page-table changes (a duplicate page swapped for the
    tree's copy, a page freed and reallocated elsewhere): no read is ever stale."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.capacity = 3, 7
        self.arena = HotBuffers([LAYER], 1, self.capacity, PER_PAGE, (2,), torch.float32,
                                "cpu")
        self.hot = self.arena.acquire()
        self.hot.decoding = True
        self.pool = Pool()
        self.hot.remap(self.pool.table)
        self.count = 0
        self.steps = -1

    @rule(grow=st.integers(0, 3))
    def produce(self, grow: int) -> None:
        self.count = min(self.count + grow, 40)

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, min(self.top_k, self.count)))
        ids = data.draw(st.lists(st.integers(0, self.count - 1), min_size=k, max_size=k,
                                 unique=True))
        read(self.hot, self.pool, ids, self.count, self.top_k)

    @precondition(lambda self: self.count > 0)
    @rule(data=st.data())
    def move_a_page(self, data: st.DataObject) -> None:
        logical = data.draw(st.integers(0, (self.count - 1) // PER_PAGE))
        taken = set(self.pool.table[:PAGES // 2].tolist())
        free = [p for p in range(PAGES) if p not in taken]
        last = (self.count - 1) // PER_PAGE
        if last and data.draw(st.booleans()):  # swap with another logical page's page
            other = data.draw(st.integers(0, last).filter(lambda o: o != logical))
            a, b = self.pool.table[logical], self.pool.table[other]
            self.pool.move(logical, int(b))
            self.pool.move(other, int(a))
        else:
            self.pool.move(logical, data.draw(st.sampled_from(free)))
        self.hot.remap(self.pool.table)

    @invariant()
    def counted(self) -> None:
        self.steps += 1
        assert self.arena.counts["bytes_moved"] == 8 * (
            self.arena.misses[LAYER] + self.arena.counts["filled"])

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)


TestHotBuffer = HotBufferMachine.TestCase
TestHotBuffer.settings = steps(150)
