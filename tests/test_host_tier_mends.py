"""The host tier over the engine's default arena, where a fault or a failed copy meets the
tree: found by an attack on the arena with L2 and L3; each test fails on the code before.

A write-back eviction over an arena spills to the host (it dropped every page: the free
frames counted as free pages of every pool, so no room was made); a failed backup whose
forgetting faults never lets a load-back read it unreported; a fault before a spill's copy
is submitted undoes the spill; a fault while the tree records a backup, or while an insert
frees what it did not adopt, leaks nothing; a node whose pages a failed copy took while a
request held it goes once the lock does."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fail_at, tiny_layout
from test_arena_host_compaction import ManualMover
from test_engine import check, rand_tokens
from tiny_model import tiny_model

import shadowradix.tiers.mover as mover_module
from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.layout.spec import KVLayout, PoolSpec, Retention
from shadowradix.pool.allocator import PagePool
from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.eviction import Eviction
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.radix import ShadowRadix
from shadowradix.tree.spill import SpillRoom
from shadowradix.tree.tier import DEVICE, HOST

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
P = SamplingParams(max_new_tokens=3, ignore_eos=True)


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def arena_engine(model, policy: str, device_tokens: int = 512) -> Engine:
    """The default arena (no window_tokens) over a host tier; pages poisoned when handed
    out, so a read of bytes that never arrived shows in the logits."""
    return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=device_tokens,
                                             host_tokens=2048, write_policy=policy,
                                             debug_poison=True), step_tokens=64)


def drain(eng: Engine, prompt: list[int]):
    """One request stepped to its end, with the cache's books checked between steps."""
    eng.add_request(prompt, P, return_logits=True)
    result = None
    for _ in range(60):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                result = out.result
        eng.check_integrity()
    assert result is not None
    return result


def wide_layout() -> KVLayout:
    """Window pages 8x the raw ones: a frame holds many pages of the small pools."""
    return KVLayout("wide", (
        PoolSpec("kv", 1, Retention.ALL, (2,), "float32", 1),
        PoolSpec("c2", 2, Retention.ALL, (2,), "float32", 1),
        PoolSpec("c4", 4, Retention.ALL, (1,), "float32", 1),
        PoolSpec("swa", 1, Retention.WINDOW, (8,), "float32", 1, window=5),
        PoolSpec("state", None, Retention.CHECKPOINT, (3,), "float32", 1)), 4)


def arena_host(policy: str, frames: int = 24, host_pages: int = 400,
               layout: KVLayout | None = None):
    """Metadata-only: an arena of `frames` over a host tier whose copies land when told."""
    layout = layout or tiny_layout()
    arena = Arena(layout, frames * plan_frames(layout).frame_bytes)
    cache = PrefixCache(layout, {}, CheckpointPolicy(every_pages=2), host_pages=host_pages,
                        arena=arena)
    mover = ManualMover()
    host = HostTier(cache, mover, policy)  # type: ignore[arg-type]
    return cache, host, mover, CacheManager(cache, host)


def serve_chat(manager: CacheManager, tokens: np.ndarray) -> None:
    """One request admitted, computed and finished; its copies land."""
    lease = manager.admit(tokens, 64)
    assert lease is not None
    manager.finish(lease, tokens, tokens.size)
    manager.host.mover.land()
    manager.host.recover(manager.host.mover.last)
    manager.check_integrity()


def test_write_back_over_an_arena_spills_what_eviction_drops():
    """Finished conversations fill a small arena under write-back while the host has room
    for all of them: every device page eviction lets go is spilled, none dropped. Before,
    a free frame counted as free pages of every pool, so while one was free the allocation
    made no room and its eviction (for frames) dropped everything: 0 of 330 spilled."""
    cache, host, _, manager = arena_host("write_back")
    rng = np.random.default_rng(0)
    for _ in range(30):
        serve_chat(manager, rng.integers(0, 50, 13).astype(np.int32))
    evicted = sum(cache.evicted.values())
    assert evicted > 100
    assert host.counts["spilled"] == evicted and host.counts["spill_skipped"] == 0


def test_a_load_back_of_a_failed_backup_whose_forgetting_faulted_is_restarted(model,
                                                                              monkeypatch):
    """Turn one's backup fails; the step that collects the failure faults while the tree
    forgets it, so the tree still names the host pages. Turn two loads them back before the
    next recover: that load is as bad as the backup, and the next recover forgets it too
    (the request restarts). Before, turn two read bytes never written (NaN logits)."""
    eng = arena_engine(model, "write_through")
    copies = fail_at(monkeypatch, mover_module, "copy_pages", 1, Injected)
    forgets = fail_at(monkeypatch, Eviction, "_forget_cells", 1, KeyboardInterrupt)
    prompt = rand_tokens(60, 7)
    first = eng.generate([prompt], ONE, return_logits=True)[0]
    check(model, prompt, first)
    other = eng.add_request(rand_tokens(20, 99), ONE)
    with pytest.raises(KeyboardInterrupt):
        eng.step()  # collects the failed backup; forgetting it is interrupted
    eng.abort(other)
    assert copies[0] >= 1 and forgets[0] >= 1
    eng.cache.flush(tiers=("device",))  # turn one is on the host only (it seems)
    turn2 = prompt + first.output_ids + rand_tokens(20, 8)
    check(model, turn2, drain(eng, turn2))


@pytest.mark.parametrize("owner, point", [(SpillRoom, "copies"), (HostTier, "_settle")])
def test_a_fault_before_a_spill_is_submitted_undoes_the_spill(model, monkeypatch, owner,
                                                              point):
    """Write-back: a fault while the spill's copies are read out of the room, or as the
    settling begins (before the submit), left host shadows no copy would fill; turn two
    loaded them back."""
    eng = arena_engine(model, "write_back")
    prompt = rand_tokens(60, 7)
    first = eng.generate([prompt], P, return_logits=True)[0]
    calls = fail_at(monkeypatch, owner, point, 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.cache.flush(tiers=("device",))
    monkeypatch.undo()
    assert calls[0] >= 1
    eng.check_integrity()
    eng.cache.flush(tiers=("device",))
    turn2 = prompt + first.output_ids + rand_tokens(20, 8)
    check(model, turn2, drain(eng, turn2))


def test_a_locked_node_a_failed_copy_emptied_goes_with_the_lock(model, monkeypatch):
    """Turn one's backup fails after the device let turn one go; turn two loads it back
    (voided behind the failure), holds its node, and is restarted: the node, with no resume
    point in any tier, stayed as an unlocked dead leaf once turn two let go."""
    eng = arena_engine(model, "write_through")
    fail_at(monkeypatch, mover_module, "copy_pages", 1, Injected)
    prompt = rand_tokens(60, 7)
    first = eng.generate([prompt], ONE, return_logits=True)[0]
    eng.cache.flush(tiers=("device",))
    turn2 = prompt + first.output_ids + rand_tokens(20, 8)
    check(model, turn2, drain(eng, turn2))
    assert eng.stats()["host"]["copy_errors"] == 1


def test_a_fault_while_the_tree_records_a_backup_leaks_no_host_page(model, monkeypatch):
    """Write-through: the tree's `fill` of the host pages faults after it wrote the node's
    cells: it changes nothing, and the backup's host pages go back."""
    eng = arena_engine(model, "write_through")
    calls = [0]
    original = ShadowRadix._count

    def count(self, mask, step, tier=DEVICE, node=None):
        if tier == HOST and step > 0:
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt("injected while recording a backup")
        return original(self, mask, step, tier, node)

    monkeypatch.setattr(ShadowRadix, "_count", count)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([rand_tokens(40, 5)], ONE)
    monkeypatch.undo()
    assert calls[0] >= 1
    eng.scheduler.release_orphans()
    eng.check_integrity()
    eng.cache.flush(("device", "host"))
    for pool in eng._prefix.host_pools.values():
        assert pool.used_pages == 0, pool.name


def test_a_fault_freeing_what_an_insert_did_not_adopt_leaks_nothing(monkeypatch):
    """The second insert of a prefix hands pages the tree holds already; they are freed
    after it. A fault in the first pool's free lost every pool's pages after it (in use,
    nobody's); now they wait for the next release."""
    layout = tiny_layout()
    cache = PrefixCache(layout, 32)
    tokens = np.arange(16, dtype=np.int32)
    need = {name: 4 for name in layout.pool_names}
    for _ in range(2):
        got = cache.alloc(need)
        table = np.stack([got[name] for name in layout.pool_names])
        if _ == 1:
            calls = fail_at(monkeypatch, PagePool, "free", 1, KeyboardInterrupt)
            with pytest.raises(KeyboardInterrupt):
                cache.insert(tokens, table)
            monkeypatch.undo()
            assert calls[0] == 1
        else:
            cache.insert(tokens, table)
    cache.release(cache.tree.evict(layout.pool_names[0], 0))  # a later release frees them
    cache.check_integrity(held={})
    assert sum(p.used_pages for p in cache.pools.values()) == sum(
        cache.tree.pages_held(name) for name in layout.pool_names)


def test_write_back_reserves_no_more_host_room_than_the_device_could_spill():
    """Frames short over an arena: the host made room for a frame's worth of pages of
    every pool, more than the device held of a dense pool, and let its own go for it. Its
    checkpoint pages went, and with them chats still on the device (no resume point left
    in any tier). With room for the whole device on the host, no admission loses a chat."""
    cache, _, _, manager = arena_host("write_back", frames=14, host_pages=60,
                                      layout=wide_layout())
    rng = np.random.default_rng(1)
    chats: list[np.ndarray] = []

    def cached() -> int:
        return sum(cache.match(c, record=False).prefix_len >= 12 for c in chats)

    for _ in range(12):
        tokens = rng.integers(0, 50, 13).astype(np.int32)
        room = all(cache.host_pools[n].free_pages >= cache.pools[n].used_pages
                   for n in cache.layout.pool_names)
        before = cached()
        serve_chat(manager, tokens)
        assert not room or cached() >= before, f"lost {before - cached()} cached chats"
        chats.append(tokens)


def test_a_fault_once_a_load_back_is_queued_leaves_its_pages_waiting_for_it(monkeypatch):
    """HostTier._submit booked the busy tickets (per arena frame) after the mover queued
    the copy: a fault there left a copy in flight that no frame named, so the next owner of
    those pages would not wait and the copy would land over its KV. Everything the books
    need is read before the submit now: a fault there queues nothing."""
    _, _, mover, manager = arena_host("write_through")
    tokens = np.random.default_rng(3).integers(0, 50, 17).astype(np.int32)
    serve_chat(manager, tokens)
    manager.flush_device()
    armed = {"on": False}
    submit, frames_of = HostTier._submit, PrefixCache.arena_frames_of

    def arming(self, copies):
        armed["on"] = True
        try:
            return submit(self, copies)
        finally:
            armed["on"] = False

    def failing(self, name, ids):
        if armed["on"]:
            raise KeyboardInterrupt("injected while booking a copy")
        return frames_of(self, name, ids)

    monkeypatch.setattr(HostTier, "_submit", arming)
    monkeypatch.setattr(PrefixCache, "arena_frames_of", failing)
    last = mover.last
    with pytest.raises(KeyboardInterrupt):
        manager.admit(np.concatenate([tokens, tokens[:4]]), 64)  # loads turn one back
    monkeypatch.undo()
    assert mover.last == last, "a copy was queued that no frame waits for"
    manager.check_integrity()


def test_a_fault_in_the_prune_after_an_unlock_is_retried(monkeypatch):
    """The prune that follows an unlock (mend above) faulted once the handle was released:
    the retried abort skipped released handles, and the dead leaf stayed for good."""
    _, host, mover, manager = arena_host("write_through", frames=30, host_pages=60)
    tokens = np.random.default_rng(1).integers(0, 50, 17).astype(np.int32)
    lease = manager.admit(tokens, 64)
    mover.wait(lease.ready)
    host.recover(lease.ready)
    failing_backup = mover.last + 1
    manager.finish(lease, tokens, tokens.size)
    manager.flush_device()
    turn2 = np.concatenate([tokens, tokens[:4]])
    lease2 = manager.admit(turn2, 64)  # loads turn one back, behind its backup
    mover.wait(mover.last)
    voided = [(failing_backup, RuntimeError("injected")),  # and the load-back behind it
              *((t, None) for t in range(failing_backup + 1, mover.last + 1))]
    monkeypatch.setattr(mover, "failures", lambda t: voided)
    lost = host.recover(mover.last)  # the backup failed: the locked node's pages go
    monkeypatch.undo()
    assert lost
    real = PrefixCache.prune
    fired = [0]

    def prune(self, node):
        if node.alive and not node.children and not node.full_lock and not fired[0]:
            fired[0] = 1
            raise KeyboardInterrupt("injected in the prune of an unlock")
        return real(self, node)

    monkeypatch.setattr(PrefixCache, "prune", prune)
    with pytest.raises(KeyboardInterrupt):
        manager.abort(lease2)
    monkeypatch.undo()
    assert fired[0]
    manager.release_orphans(set())  # the engine after a failed step
    manager.check_integrity()


def test_a_fault_in_a_landing_insert_leaks_no_host_page(monkeypatch):
    """L3 -> L2: the tree's insert of the landed host pages faults (before it adopts any):
    they were owned by nobody, and stayed in use after every tier was flushed."""
    cache, host, _, manager = arena_host("write_through", frames=30, host_pages=60)
    tokens = np.random.default_rng(7).integers(0, 50, 17).astype(np.int32)
    fail_at(monkeypatch, ShadowRadix, "insert", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        host.land(tokens, 0, 4, write=lambda pages: None)
    monkeypatch.undo()
    manager.check_integrity()
    manager.flush_device()
    cache.flush(HOST)
    assert all(p.used_pages == 0 for p in cache.host_pools.values())


def test_a_fault_between_an_eviction_and_its_release_leaks_nothing(monkeypatch):
    """The tree forgot the pages an eviction let go before the cache's release ran: a fault
    in between lost them. Every walk of a cache's tree is in its queue from its start."""
    cache, _, _, manager = arena_host("write_through")
    rng = np.random.default_rng(5)
    for _ in range(3):
        serve_chat(manager, rng.integers(0, 50, 13).astype(np.int32))
    calls = fail_at(monkeypatch, PrefixCache, "release", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        cache.flush()
    monkeypatch.undo()
    assert calls[0] == 1
    manager.check_integrity()
    cache.flush()
    cache.flush(HOST)
    assert all(p.used_pages == 0 for p in cache.pools.values())


# A third attack, on the mends above and what they touch: a second fault inside the
# mending itself (undo, sweep, repair), and lock walks cut short.


def test_a_fault_undoing_a_spill_leaves_no_host_shadow_without_bytes(monkeypatch):
    """Write-back: the spill's copy is never queued (a fault) and undoing it faults too,
    halfway: the nodes not undone kept host shadows no copy would fill, and a next turn
    loaded them. What the undo did not reach is now forgotten as a failed copy's pages."""
    cache, host, mover, manager = arena_host("write_back")
    rng = np.random.default_rng(2)
    for _ in range(2):
        serve_chat(manager, rng.integers(0, 50, 12).astype(np.int32))
    fail_at(monkeypatch, HostTier, "_submit", 1, KeyboardInterrupt)
    fail_at(monkeypatch, Eviction, "_forget_cells", 2, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        manager.flush_device()
    monkeypatch.undo()
    host.recover(mover.last)
    for name in cache.layout.pool_names:
        assert cache.tree.pages_held(name, HOST) == 0, name  # no copy wrote any
    manager.check_integrity()


def test_an_unlock_a_fault_cut_short_resumes_where_it_stopped(monkeypatch):
    """A fault in the second node of an unlock's walk left the first unlocked and the
    handle unreleased; the engine's retry (the abort again) unlocked the first node twice:
    a negative lock count, and a node another lock holds could have been evicted."""
    cache, _, _, manager = arena_host("write_through")
    a = (np.arange(16) % 50).astype(np.int32)
    serve_chat(manager, a)
    b = np.concatenate([a[:8], np.arange(60, 72, dtype=np.int32)])
    serve_chat(manager, b)  # the tree: a[:8] -> {a, b}
    lease = manager.admit(np.concatenate([b, np.arange(90, 95, dtype=np.int32)]), 16)
    assert lease is not None and lease.handles[-1].node.parent is not cache.tree.root
    fail_at(monkeypatch, ShadowRadix, "_pin", 2, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        manager.abort(lease)
    monkeypatch.undo()
    manager.release_orphans(set())  # the engine's retry after a failed step
    assert all(n.full_lock == 0 and not n.window_lock.any() for n in cache.tree.nodes())
    manager.check_integrity()


@pytest.mark.parametrize("owner", [ShadowRadix, PrefixCache])
def test_a_fault_in_a_landings_unlock_does_not_pin_its_prefix_for_good(monkeypatch, owner):
    """`HostTier.land` unlocks the prefix it attached to in a `finally`; that handle is no
    request's, so a fault there was retried by nobody and the prefix stayed locked (its
    pages never evictable). The cache's next operation finishes the unlock. With the fault
    as `PrefixCache.unlock` is called (none of it ran, so the cache had not recorded the
    unlock either), the landing's lock is transient, expired before the call, and the
    cache's next operation releases it."""
    cache, host, _, manager = arena_host("write_through", frames=30, host_pages=60)
    tokens = np.random.default_rng(7).integers(0, 50, 17).astype(np.int32)
    serve_chat(manager, tokens[:8])
    fail_at(monkeypatch, owner, "unlock", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        host.land(tokens, 2, 4, write=lambda pages: None)
    monkeypatch.undo()
    assert any(n.full_lock for n in cache.tree.nodes())  # held, by nobody
    manager.flush_device()
    cache.flush(HOST)
    assert all(n.full_lock == 0 for n in cache.tree.nodes())
    assert all(p.used_pages == 0 for p in cache.pools.values())
    assert all(p.used_pages == 0 for p in cache.host_pools.values())


def test_a_transient_lock_is_kept_while_its_owner_runs(monkeypatch):
    """The cache's operations inside the landing (its host allocation) leave its lock be."""
    cache, host, _, manager = arena_host("write_through", frames=30, host_pages=60)
    tokens = np.random.default_rng(7).integers(0, 50, 17).astype(np.int32)
    serve_chat(manager, tokens[:8])
    locked = []
    real = PrefixCache.alloc

    def alloc(self, need, tier=0, room=None):
        got = real(self, need, tier, room)
        locked.append(sum(n.full_lock for n in self.tree.nodes()))
        return got

    monkeypatch.setattr(PrefixCache, "alloc", alloc)
    assert host.land(tokens, 2, 4, write=lambda pages: None)
    monkeypatch.undo()
    assert locked and all(k > 0 for k in locked)
    assert all(n.full_lock == 0 for n in cache.tree.nodes())
    assert not cache._transient
    manager.check_integrity()


def test_a_fault_halfway_through_forgetting_leaves_no_dead_leaf(monkeypatch):
    """A failed spill's pages were being forgotten node by node; a fault at the second
    left the first node resident nowhere, and no later recover, eviction or flush removed
    it (check_integrity failed for good). The walk's salvage sweeps such leaves now."""
    cache, host, mover, manager = arena_host("write_back")
    rng = np.random.default_rng(4)
    for _ in range(2):
        serve_chat(manager, rng.integers(0, 50, 12).astype(np.int32))
    manager.flush_device()  # spills both to the host: their copy fails
    voided = [(mover.last, RuntimeError("injected"))]
    monkeypatch.setattr(mover, "failures", lambda t: voided)
    fail_at(monkeypatch, Eviction, "_forget_cells", 2, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        host.recover(mover.last)
    monkeypatch.undo()
    host.recover(mover.last)
    manager.flush_device()
    cache.flush(HOST)
    manager.check_integrity()
    assert not list(cache.tree.nodes())


@pytest.mark.parametrize("point", ["_drop_dead_leaf", "note"])
def test_a_fault_that_also_cuts_its_mending_short_is_mended_next(monkeypatch, point):
    """A fault that persists through the mending right after it (the same point fails
    again): an eviction that emptied a leaf, then faulted dropping it, then again in the
    sweep after; a split whose page owners map fault also cut its repair short. The tree
    stayed wrong for good; the cache's next operation mends it now (`needs_sweep`,
    `needs_repair`)."""
    from shadowradix.tree.relocate import PageOwners

    cache, _, _, manager = arena_host("write_through")
    a = np.arange(16, dtype=np.int32)
    serve_chat(manager, a)
    if point == "note":
        monkeypatch.setattr(PageOwners, "note", lambda *args: (_ for _ in ()).throw(
            KeyboardInterrupt("injected in PageOwners.note")))
        with pytest.raises(KeyboardInterrupt):  # forks inside a's node: a split
            cache.match(np.concatenate([a[:8], np.arange(100, 108, dtype=np.int32)]))
    else:  # a leaf on the device only, its checkpoint let go (as in the engine's default)
        layout = tiny_layout()
        cache = PrefixCache(layout, 32, CheckpointPolicy(), host_pages=32)
        manager = CacheManager(cache)
        got = cache.alloc({name: 3 for name in layout.pool_names})
        cache.insert(np.arange(12, dtype=np.int32),
                     np.stack([got[name] for name in layout.pool_names]))
        real = ShadowRadix._drop_dead_leaf

        def drop(self, node, freed):
            if self._dead(node):
                raise KeyboardInterrupt("injected dropping a dead leaf")
            return real(self, node, freed)

        monkeypatch.setattr(ShadowRadix, "_drop_dead_leaf", drop)
        with pytest.raises(KeyboardInterrupt):
            cache.evict("state", 100)
    monkeypatch.undo()
    cache.match(a)  # any operation
    manager.check_integrity()
    manager.flush_device()
    cache.flush(HOST)
    assert all(p.used_pages == 0 for p in cache.pools.values())


def test_an_unlock_resumed_after_a_split_of_a_node_it_did_unlocks_each_node_once(monkeypatch):
    """An unlock cut short above the handle's node resumes later; meanwhile an insert
    split the node it had done. Counting the nodes it did by position, the resumed walk
    took the split's head (with the counts already lowered) for one it had not done and
    lowered them again: a negative lock count. It counts by page now."""
    cache, _, _, manager = arena_host("write_through", frames=60, host_pages=120)
    tree = cache.tree

    def serve(t: np.ndarray) -> None:
        lease = manager.admit(t, 64)
        assert manager.grow(lease, t.size)
        manager.finish(lease, t, t.size)

    a = (np.arange(16) % 50).astype(np.int32)
    x = np.arange(100, 120, dtype=np.int32)
    serve(a)
    c = np.concatenate([a[:8], x[:12], np.arange(200, 208, dtype=np.int32)])
    running = manager.admit(c, 64)  # matches a[:8] only; hands c over later
    assert manager.grow(running, c.size)
    b = np.concatenate([a[:8], x])
    serve(b)
    serve(np.concatenate([a[:8], x[:4], np.arange(300, 308, dtype=np.int32)]))
    m = tree.match_prefix(b, record=False)
    handle = cache.lock(m)
    real = ShadowRadix._pin

    def pin(self, node, cols, step):
        if step < 0 and node is m.node.parent:
            raise KeyboardInterrupt("injected above the handle's node")
        return real(self, node, cols, step)

    monkeypatch.setattr(ShadowRadix, "_pin", pin)
    with pytest.raises(KeyboardInterrupt):
        cache.unlock(handle)
    monkeypatch.undo()
    manager.finish(running, c, c.size)  # its insert splits the node the unlock did
    cache.match(a[:4], record=False)  # the next operation finishes the unlock
    assert handle.released
    assert all(n.full_lock >= 0 and (n.window_lock >= 0).all() for n in tree.nodes())
    manager.check_integrity()


def test_a_fault_pruning_a_matchs_dead_tail_is_swept_next(monkeypatch):
    """A match that splits a node prunes the tail it left with no resume point; a fault at
    that prune left the dead leaf for good. The next operation sweeps it."""
    cache, _, _, manager = arena_host("write_through", frames=60, host_pages=120)
    t = (np.arange(28) % 50).astype(np.int32)
    lease = manager.admit(t, 64)
    assert manager.grow(lease, 24)
    manager.cache_prefix(lease, t, 24)  # running: its prefix without its live window
    manager.abort(lease)
    manager.check_integrity()
    fail_at(monkeypatch, ShadowRadix, "prune", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        cache.match(t, record=False)
    monkeypatch.undo()
    cache.match(t[:4], record=False)  # any later operation
    manager.check_integrity()
