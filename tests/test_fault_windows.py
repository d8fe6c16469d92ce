"""Faults in the window between a change and its record (found by an attack's fault sweeps;
each test fails on the code before its mend): a compaction's old pages queued for release,
a write-back room's host pages noted as taken, a spilled node's host pages counted."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import CallFault, tiny_layout
from test_arena_compaction import ContentCache, _write, next_turn, tree_content_holds

from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.sim.replay import CountingMover
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.eviction import Eviction
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.spill import SpillRoom

PS = 4


def _chats(manager: CacheManager, rng: np.random.Generator, chats: list, turns: int,
           cache: ContentCache | None = None) -> None:
    """Turns of random chats, each admitted a page at a time; a request a fault cuts short
    is aborted, as the engine does, and the fault goes on."""
    for _ in range(turns):
        i, tokens = next_turn(rng, chats, 0.5)
        lease = manager.admit(tokens, PS)
        if lease is None:
            continue
        try:
            for end in range(2 * PS, tokens.size + PS, PS):
                if not manager.grow(lease, min(end, tokens.size)):
                    break
            else:
                if cache is not None:
                    _write(cache, lease, tokens)
                manager.finish(lease, tokens, tokens.size)
                chats[i] = tokens
                continue
        except BaseException:
            manager.abort(lease)
            raise
        manager.abort(lease)


@pytest.mark.parametrize("seed", range(3))
def test_a_compaction_whose_release_queue_cannot_grow_leaks_nothing(seed):
    """The move renamed the tree's pages, then queued the old ids for release: memory
    running out in that append left them in use, nobody's, for good (their frames never
    went back). The append is now part of the move: a fault there undoes the rename."""
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 24 * plan_frames(layout).frame_bytes)
    cache = ContentCache(layout, {}, CheckpointPolicy(every_pages=2), arena=arena)
    cache.content = [{} for _ in layout.pools]
    manager = CacheManager(cache)
    rng, chats = np.random.default_rng(seed), []
    fault = CallFault(PrefixCache._compact_pool, "append")
    with fault, pytest.raises(MemoryError):
        _chats(manager, rng, chats, 200, cache)
    assert fault.hit, "no compaction ran: the repro needs one"
    manager.check_integrity()
    tree_content_holds(cache)
    _chats(manager, rng, chats, 40, cache)  # and it keeps serving, compacting
    manager.check_integrity()
    cache.flush()
    assert all(p.used_pages == 0 for p in cache.pools.values())


def _write_back() -> tuple[PrefixCache, HostTier, CacheManager]:
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 24 * plan_frames(layout).frame_bytes)
    cache = PrefixCache(layout, {}, CheckpointPolicy(every_pages=2), host_pages=200,
                        arena=arena)
    host = HostTier(cache, CountingMover(), "write_back")
    manager = CacheManager(cache, host)
    _chats(manager, np.random.default_rng(0), [], 6)
    manager.check_integrity()
    return cache, host, manager


def _empties_both_tiers(cache: PrefixCache, host: HostTier, manager: CacheManager) -> None:
    manager.check_integrity()
    host.flush_device()
    cache.flush(1)
    manager.check_integrity()
    left = {n: p.used_pages for n, p in (*cache.pools.items(), *cache.host_pools.items())}
    assert not any(left.values()), f"pages left after flushing both tiers: {left}"


@pytest.mark.parametrize("event, kind", [("c_call", MemoryError),
                                         ("c_return", KeyboardInterrupt)])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_write_back_room_whose_books_cannot_grow_leaks_no_host_page(nth, event, kind):
    """A room took host pages, then noted them: memory running out as it noted them lost
    them (in use, nobody's). Now a fault before the note gives them back, and one just
    after it (the node's table not yet filled) has the spill's undo free them."""
    cache, host, manager = _write_back()
    fault = CallFault(SpillRoom.take, "append", nth, kind, event)
    with fault, pytest.raises(kind):
        host.flush_device()
    assert fault.hit
    _empties_both_tiers(cache, host, manager)


def test_an_interrupt_between_a_spill_and_its_count_leaves_the_counts_right(monkeypatch):
    """A spilled node's host table was filled and the interrupt came before its host
    pages were counted: the undo of the spill then took away counts never made, and they
    stayed wrong for good. A walk cut short now has the counts made again."""
    cache, host, manager = _write_back()
    real = Eviction._apply
    fired = []

    def apply(self, *args, **kwargs):
        if not fired and sys._getframe(1).f_code is Eviction._spill.__code__:
            fired.append(True)
            raise KeyboardInterrupt("injected between a spill and its count")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Eviction, "_apply", apply)
    with pytest.raises(KeyboardInterrupt):
        host.flush_device()
    monkeypatch.undo()
    assert fired
    _empties_both_tiers(cache, host, manager)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_fault_after_a_load_back_fills_the_tree_leaves_each_page_one_owner(policy,
                                                                            monkeypatch):
    """A load-back's device pages pass from the request to the tree as the tree fills
    them; the request let go of them only once `load` had returned, so a fault in between
    (its bookkeeping) had the request's abort free pages the tree then named: the next
    request wrote them, and a hit on the loaded prefix read its bytes. The hand-over is
    one step now: after a fault the tree holds none of them and the request all."""
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 24 * plan_frames(layout).frame_bytes)
    cache = PrefixCache(layout, {}, CheckpointPolicy(every_pages=2), host_pages=200,
                        arena=arena)
    host = HostTier(cache, CountingMover(), policy)
    manager = CacheManager(cache, host)
    tokens = np.random.default_rng(0).integers(0, 50, 5 * PS).astype(np.int32)
    lease = manager.admit(tokens, 64)
    manager.finish(lease, tokens, tokens.size)
    host.flush_device()  # the prefix lives on the host only
    manager.check_integrity()
    real = type(cache.tree).fill

    def fill(self, node, table, tier):
        real(self, node, table, tier)
        if tier == 0:
            raise KeyboardInterrupt("injected as the load-back's pages were filed")

    monkeypatch.setattr(type(cache.tree), "fill", fill)
    with pytest.raises(KeyboardInterrupt):
        manager.admit(tokens, 64)
    monkeypatch.undo()
    manager.check_integrity()
    lease = manager.admit(tokens, 64)  # and it loads the prefix again
    assert lease is not None and lease.from_host > 0
    manager.finish(lease, tokens, tokens.size)
    manager.check_integrity()


def test_a_copy_queued_as_an_interrupt_strikes_still_makes_its_pages_wait(monkeypatch):
    """A load-back's copy was queued, then an interrupt came as the submit returned: the
    ticket was never booked on the pages it writes, so once the admission aborted, the next
    owner of those pages did not wait for the copy, which then overwrote its KV. A copy the
    mover took is booked all the same now."""
    _, host, manager = _write_back()
    tokens = np.random.default_rng(1).integers(0, 50, 5 * PS).astype(np.int32)
    lease = manager.admit(tokens, 64)
    manager.finish(lease, tokens, tokens.size)
    host.flush_device()
    real = host.mover.submit
    seen = []

    def submit(copies):
        ticket = real(copies)
        if any(tier == 1 for _, tier, _, _ in copies):  # host -> device: a load-back
            seen.extend((name, np.asarray(dst)) for name, _, _, dst in copies)
            raise KeyboardInterrupt("injected as the submit returned")
        return ticket

    monkeypatch.setattr(host.mover, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        manager.admit(tokens, 64)
    monkeypatch.undo()
    assert seen, "no load-back was submitted: the repro needs one"
    pages = dict(seen)
    assert host.ready_ticket(pages) == host.mover.last
    manager.check_integrity()
