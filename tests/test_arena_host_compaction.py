"""An arena's compaction under a host tier: it moves the tree's device pages only in frames
no host copy may still read or write (`HostTier.frames_in_flight`), nor those whose pages
a write-back eviction is about to copy out, and every answer stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from test_compaction_attack import SHAPE, assert_all_free_after_flush, chat_turns
from test_engine_arena import engine as arena_engine_pages
from tiny_model import tiny_model

from shadowradix.layout.presets import deepseek_v4_flash
from shadowradix.sim.replay import CountingMover, replay
from shadowradix.sim.simulate import make_cache, policy_choice
from shadowradix.sim.synth import ChatShape, synth_trace
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier

GIB = 2**30


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class ManualMover(CountingMover):
    """Copies that land only when waited for or told (`land`): a backup or load-back
    stays in flight across steps, as behind a slow PCIe link."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = 0

    def done(self, ticket: int) -> bool:
        return ticket <= self.landed

    def wait(self, ticket: int) -> None:
        self.landed = max(self.landed, ticket)

    def land(self) -> None:
        self.landed = self.last


def _host_cache(policy: str = "write_through") -> tuple[PrefixCache, HostTier, ManualMover]:
    cache = make_cache(deepseek_v4_flash(), policy_choice("shadowradix"), 0.5 * GIB, 4 * GIB,
                       arena=True)
    mover = ManualMover()
    return cache, HostTier(cache, mover, policy), mover  # type: ignore[arg-type]


def _watch_moves(cache: PrefixCache, host: HostTier, monkeypatch) -> list[int]:
    """Check each compaction copy against the frames in flight at that moment; returns
    [copies, copies made while some frame was in flight]."""
    seen = [0, 0]
    copy = PrefixCache.copy_pages

    def checked(self, name, old, new):
        busy = set(host.frames_in_flight())
        touched = set(self.arena_frames_of(name, old).tolist()) | set(
            self.arena_frames_of(name, new).tolist())
        assert not touched & busy, f"{name}: compaction touched frames in flight {touched & busy}"
        seen[0] += 1
        seen[1] += bool(busy)
        copy(self, name, old, new)

    monkeypatch.setattr(PrefixCache, "copy_pages", checked)
    return seen


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_compaction_runs_under_a_host_tier_and_leaves_copies_in_flight_alone(monkeypatch,
                                                                             policy):
    """Metadata-only replays of synthetic chats over a small arena and a host tier whose
    copies land only when a step waits for them: compaction moves pages (before, a host
    tier turned it off), never in a frame a copy in flight names, and the books hold
    after every request."""
    cache, host, mover = _host_cache(policy)
    seen = _watch_moves(cache, host, monkeypatch)
    trace = synth_trace(ChatShape(conversations=30, seed=0, **SHAPE))
    for i, req in enumerate(trace):
        st = replay(cache, [req], with_output=True, chunk_pages=2, host=host, check_every=1)
        assert st.refused == 0
        if i % 3 == 2:
            mover.land()
    assert sum(cache.moved.values()) > 0, "compaction never ran under the host tier"
    if policy == "write_through":  # a backup of every insert is in flight for a step
        assert seen[1] > 0, f"no compaction while a copy was in flight: {seen}"
    host.recover(mover.last)  # nothing in flight now: a flush leaves every pool empty
    mover.land()
    cache.flush()
    assert all(p.used_pages == 0 for p in cache.pools.values())


def test_frames_in_flight_follow_recover_not_the_movers_speed():
    """A frame stays in flight until `recover` is called with a ticket at or past its last
    copy that has landed: however fast copies land, the same calls give the same frames
    (the engine and the simulator then compact alike)."""
    cache, host, mover = _host_cache()
    trace = synth_trace(ChatShape(conversations=4, seed=1, **SHAPE))
    for req in trace:
        replay(cache, [req], with_output=True, chunk_pages=2)  # no host: no copies
    node = max(cache.tree.nodes(), key=lambda n: n.last_access)
    assert host.backup(node) > 0
    busy = host.frames_in_flight()
    assert busy
    mover.land()
    assert host.frames_in_flight() == busy  # landed, but not yet recovered
    host.recover(mover.last + 5)  # not done: nothing settles
    assert host.frames_in_flight() == busy
    host.recover(mover.last)
    assert host.frames_in_flight() == []


def test_a_write_back_rooms_frames_are_busy():
    """Within one write-back allocation, the device pages eviction dropped into the room
    wait, freed, for their copy to the host: their frames count as busy for a compaction
    later in the same allocation (`_frames_busy`)."""
    cache, host, _ = _host_cache("write_back")
    trace = synth_trace(ChatShape(conversations=10, seed=2, **SHAPE))
    for req in trace:
        replay(cache, [req], with_output=True, chunk_pages=2, host=host)
    room = host._reserve(0, evict=False)
    cache.evict("c4", 20, 0, room)
    copies = room.copies()
    assert copies, "the eviction spilled nothing: the case tests nothing"
    busy = set(cache._frames_busy(room))
    for name, dev, _ in copies:
        assert set(cache.arena_frames_of(name, dev).tolist()) <= busy
    assert set(host.frames_in_flight()) <= busy
    host._settle(room)


@pytest.mark.parametrize("seed", range(6))
def test_sparse_and_claim_never_touch_an_avoided_frame(seed):
    """Against a brute force over random pool states: `sparse(limit, exclude, avoid)` names
    no page of an excluded or avoided frame, its pages fit in the free slots outside the
    frames it empties and the avoided ones (claim takes them, never in an avoided frame),
    and it empties as many frames as the brute force finds."""
    rng = np.random.default_rng(seed)
    cache = make_cache(deepseek_v4_flash(), policy_choice("shadowradix"), 0.5 * GIB,
                       arena=True)
    pool = cache._arena_pools["c4_index"]
    k = pool.per_frame
    held = pool.alloc(int(k * 12))
    gone = rng.choice(held, size=int(held.size * 0.6), replace=False)
    pool.free(gone)
    frames = np.unique(np.setdiff1d(held, gone) // k)
    for _ in range(20):
        avoid = rng.choice(frames, size=int(rng.integers(0, 4)), replace=False).tolist()
        exclude = rng.choice(frames, size=int(rng.integers(0, 3)), replace=False).tolist()
        limit = int(rng.integers(1, 8))
        pages = pool.sparse(limit, exclude, avoid)
        assert not set((pages // k).tolist()) & set(avoid + exclude)
        emptied = set((pages // k).tolist())
        # brute force: the most of the emptiest candidate frames whose pages fit elsewhere
        in_use = pool.in_use(np.arange(pool.num_pages)).reshape(-1, k)
        mine = pool.arena.owner == pool.row
        free = np.where(mine, k - in_use.sum(axis=1), 0)
        room = int(free.sum()) - int(free[avoid].sum()) if avoid else int(free.sum())
        cands = sorted((f for f in np.flatnonzero(mine & (free > 0))
                        if f not in avoid and f not in exclude), key=lambda f: -free[f])
        best = 0
        for m in range(1, min(limit, len(cands)) + 1):
            top = cands[:m]
            if sum(k - free[f] for f in top) <= room - sum(free[f] for f in top):
                best = m
        assert len(emptied) == best or (pages.size == 0 and best == 0), (emptied, best)
        if pages.size:
            new = pool.claim(pages, avoid)
            assert not set((new // k).tolist()) & (set(avoid) | emptied)
            pool.unclaim(new)


@pytest.mark.parametrize("policy, pages, group", [("write_through", 14, 2),
                                                  ("write_back", 16, 1)])
def test_an_engine_over_an_arena_and_a_host_tier_compacts_and_stays_exact(model, policy,
                                                                          pages, group):
    """The engine with real copies on the mover's thread: conversations in a tight arena
    over a host tier, every output checked against transformers, compaction moving pages
    (and their bytes) between steps while backups, spills and load-backs run."""
    eng = arena_engine_pages(model, pages, step_tokens=64, host_tokens=512,
                             write_policy=policy, debug_poison=True)
    cached = chat_turns(model, eng, 4, group=group)
    assert cached > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    assert eng.host.counts["loaded"] > 0, "nothing came back from the host"
    assert_all_free_after_flush(eng)
