"""HiSparse's offline replay (shadowradix.sparse): access streams, LRU, Belady.

Belady is checked against exhaustive search over every eviction choice on tiny streams, and
LRU against a naive timestamp implementation; the rest are properties over random streams
shaped like the engine's (entries appear over time and are selected only once they exist).
"""

from __future__ import annotations

import json
from functools import cache
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.sparse import AccessStream, ReplayStats, min_capacity, replay, sweep


@st.composite
def streams(draw, max_k: int = 3, max_steps: int = 14, full: bool = False) -> AccessStream:
    """Counts grow by 0 or 1 per step from a random start; each step selects distinct existing
    entries, min(k, count) of them when `full` (as the engine does), else up to that many."""
    k = draw(st.integers(1, max_k))
    n = draw(st.integers(0, max_steps))
    count = draw(st.integers(0, 2 * k + 1))
    steps = []
    for _ in range(n):
        count += draw(st.integers(0, 1))
        m = min(k, count)
        size = m if full else draw(st.integers(0, m))
        picked = draw(st.lists(st.integers(0, max(count - 1, 0)), min_size=size, max_size=size,
                               unique=True)) if count else []
        steps.append((sorted(picked), count))
    return AccessStream.from_steps(k, steps)


def fast_start(stream: AccessStream, capacity: int) -> int:
    return sum(1 for c in stream.counts if c <= capacity)


def optimum_hits(stream: AccessStream, capacity: int) -> int:
    """The most hits any eviction choice achieves: exhaustive search, memoised per state."""
    start = fast_start(stream, capacity)
    preload = frozenset(range(int(stream.counts[start - 1]))) if start else frozenset()
    steps = [frozenset(stream.step(i).tolist()) for i in range(start, len(stream))]

    @cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(steps):
            return 0
        sel = steps[i]
        missing = sel - resident
        overflow = len(resident) + len(missing) - capacity
        choices = combinations(sorted(resident - sel), overflow) if overflow > 0 else [()]
        return len(sel & resident) + max(best(i + 1, (resident - set(v)) | missing)
                                         for v in choices)

    return best(0, preload)


def naive_lru_hits(stream: AccessStream, capacity: int) -> int:
    """LRU with explicit timestamps and a linear scan for the victim (same tie order as the
    library: within a step, hits are touched before misses, each in selection order)."""
    start = fast_start(stream, capacity)
    stamp: dict[int, tuple[int, int]] = {}
    if start:
        for e in range(int(stream.counts[start - 1])):
            last = max([i for i in range(start) if e in stream.step(i).tolist()], default=-1)
            stamp[e] = (last, e)
    clock, hits = len(stream), 0  # later than every preloaded stamp
    for i in range(start, len(stream)):
        sel = stream.step(i).tolist()
        missing = [e for e in sel if e not in stamp]
        for e in sel:
            if e in stamp:
                hits += 1
                stamp[e] = (clock, 0)
                clock += 1
        for e in missing:
            if len(stamp) >= capacity:
                victim = min((s, v) for v, s in stamp.items() if v not in sel)[1]
                del stamp[victim]
            stamp[e] = (clock, 0)
            clock += 1
    return hits


# ------------------------------------------------------------------ properties
@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(0, 6))
def test_belady_is_optimal_and_lru_never_beats_it(stream, extra):
    capacity = min_capacity(stream) + extra
    lru, opt = replay(stream, capacity, "lru"), replay(stream, capacity, "belady")
    assert opt.hits == optimum_hits(stream, capacity)
    assert lru.hits == naive_lru_hits(stream, capacity)
    assert opt.hits >= lru.hits


@settings(max_examples=300, deadline=None)
@given(streams(max_k=5, max_steps=30), st.integers(0, 12))
def test_counts_add_up(stream, extra):
    capacity = min_capacity(stream) + extra
    start = fast_start(stream, capacity)
    outside = int(stream.offsets[-1] - stream.offsets[start])
    lru, opt = replay(stream, capacity, "lru"), replay(stream, capacity, "belady")
    for r in (lru, opt):
        assert r.steps == len(stream) and r.fast_path_steps == start
        assert r.hits + r.misses == r.lookups == outside
        assert 0 <= r.compulsory <= r.misses
    assert lru.compulsory == opt.compulsory
    assert lru.fast_path_steps == opt.fast_path_steps


@settings(max_examples=100, deadline=None)
@given(streams(full=True), st.integers(0, 4))
def test_a_buffer_that_holds_the_whole_history_is_all_fast_path(stream, extra):
    capacity = max(min_capacity(stream), int(stream.counts.max(initial=0))) + extra
    for policy in ("lru", "belady"):
        r = replay(stream, capacity, policy)
        assert r.fast_path_steps == r.steps == len(stream)
        assert r.hits == r.misses == r.compulsory == 0 and r.hit_rate is None


@settings(max_examples=50, deadline=None)
@given(st.lists(streams(), max_size=4), st.lists(st.integers(0, 5), min_size=1, max_size=3))
def test_sweep_sums_replays(batch, extras):
    caps = sorted({4 + e for e in extras})  # >= max_k + 1 for every stream
    out = sweep(batch, caps)
    for policy in ("lru", "belady"):
        for c in caps:
            assert out[policy][c] == sum((replay(s, c, policy) for s in batch), ReplayStats())


# ------------------------------------------------------------------ worked examples
def test_worked_example():
    # k = 2, capacity 3. Steps 0-1 fit (counts <= 3): fast path, buffer = {0, 1, 2} after.
    stream = AccessStream.from_steps(2, [([0, 1], 3), ([1, 2], 3), ([0, 3], 4), ([1, 3], 4),
                                         ([2, 3], 4)])
    lru = replay(stream, 3, "lru")
    # Preload in LRU order: 0 (step 0), 1 and 2 (step 1). Step 2: hit 0, miss 3 evicts 1.
    # Step 3: miss 1 evicts 2, hit 3. Step 4: miss 2 evicts 0, hit 3.
    assert (lru.fast_path_steps, lru.hits, lru.misses, lru.compulsory) == (2, 3, 3, 1)
    opt = replay(stream, 3, "belady")
    # Step 2: miss 3 evicts 2 (used at step 4, after 1). Step 3: hits. Step 4: miss 2.
    assert (opt.hits, opt.misses, opt.compulsory) == (4, 2, 1)
    assert lru.hit_rate == 0.5 and opt.fast_path_share == 0.4


def test_empty_stream_and_a_stream_without_a_fast_path():
    empty = AccessStream.from_steps(4, [])
    assert replay(empty, 5, "belady") == ReplayStats()
    stream = AccessStream.from_steps(1, [([5], 9), ([5], 9), ([8], 9)])
    r = replay(stream, 2, "lru")
    assert (r.fast_path_steps, r.hits, r.misses, r.compulsory) == (0, 1, 2, 2)


def test_capacity_below_k_plus_one_names_the_minimum():
    stream = AccessStream.from_steps(16, [(list(range(16)), 40)])
    with pytest.raises(ValueError, match="minimum is top_k \\+ 1 = 17"):
        replay(stream, 16, "lru")
    with pytest.raises(ValueError, match="policy"):
        replay(stream, 17, "fifo")
    with pytest.raises(TypeError):
        replay(stream, 17.0, "lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="minimum"):
        sweep([stream], [32, 16])


def test_long_stream_replays_quickly():
    """~10^4 steps x k = 16 with a recency-biased indexer: both policies in well under a
    second each (one pass each; Belady's next uses come from one backward pass)."""
    rng = np.random.default_rng(0)
    steps = []
    for i in range(10_000):
        count = 300 + i // 4
        recent = count - 1 - rng.geometric(0.02, size=64)
        picked = np.unique(np.clip(recent, 0, count - 1))[:16]
        steps.append((picked, count))
    stream = AccessStream.from_steps(16, steps)
    out = sweep([stream], [17, 32, 64, 128])
    for c in (17, 32, 64, 128):
        assert out["belady"][c].hits >= out["lru"][c].hits > 0
    assert out["lru"][128].hits >= out["lru"][17].hits


# ------------------------------------------------------------------ the stream itself
@settings(max_examples=100, deadline=None)
@given(streams(max_k=6, max_steps=20))
def test_json_round_trip(stream):
    again = AccessStream.from_dict(json.loads(json.dumps(stream.to_dict())))
    assert again == stream
    assert [(s.tolist(), c) for s, c in again.steps()] == [(s.tolist(), c)
                                                          for s, c in stream.steps()]


@pytest.mark.parametrize(("steps", "match"), [
    ([([0, 0], 2)], "twice"),
    ([([3], 3)], "outside \\[0, 3\\)"),
    ([([-1], 3)], "outside"),
    ([([0, 1, 2], 5)], "more than top_k = 2"),
    ([([0], 5), ([0], 4)], "non-decreasing"),
])
def test_invalid_streams_are_refused(steps, match):
    with pytest.raises(ValueError, match=match):
        AccessStream.from_steps(2, steps)


def test_invalid_construction():
    with pytest.raises(ValueError, match="top_k"):
        AccessStream.from_steps(0, [])
    with pytest.raises(ValueError, match="offsets"):
        AccessStream(2, np.array([3]), np.array([0, 2]), np.array([1]))
    with pytest.raises(TypeError):
        AccessStream(2, np.array([3.5]), np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match="format"):
        AccessStream.from_dict({"top_k": 2})
    stream = AccessStream.from_steps(2, [([1, 0], 3)])
    assert not stream.ids.flags.writeable and stream.selections == 2
