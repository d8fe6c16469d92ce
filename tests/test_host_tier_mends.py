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


def test_write_back_over_an_arena_spills_what_eviction_drops():
    """Finished conversations fill a small arena under write-back while the host has room
    for all of them: every device page eviction lets go is spilled, none dropped. Before,
    a free frame counted as free pages of every pool, so while one was free the allocation
    made no room and its eviction (for frames) dropped everything: 0 of 330 spilled."""
    layout = tiny_layout()
    arena = Arena(layout, 24 * plan_frames(layout).frame_bytes)
    cache = PrefixCache(layout, {}, CheckpointPolicy(every_pages=2), host_pages=400,
                        arena=arena)
    mover = ManualMover()
    host = HostTier(cache, mover, "write_back")  # type: ignore[arg-type]
    manager = CacheManager(cache, host)
    rng = np.random.default_rng(0)
    for _ in range(30):
        tokens = rng.integers(0, 50, 13).astype(np.int32)
        lease = manager.admit(tokens, 16)
        assert lease is not None
        manager.finish(lease, tokens, tokens.size)
        mover.land()
        host.recover(mover.last)
        manager.check_integrity()
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


def test_a_fault_before_a_spill_is_submitted_undoes_the_spill(model, monkeypatch):
    """Write-back: a fault while the spill's copies are read out of the room (before the
    submit) left host shadows no copy would fill; turn two loaded them back."""
    eng = arena_engine(model, "write_back")
    prompt = rand_tokens(60, 7)
    first = eng.generate([prompt], P, return_logits=True)[0]
    calls = fail_at(monkeypatch, SpillRoom, "copies", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.cache.flush(tiers=("device",))
    monkeypatch.undo()
    assert calls[0] == 1
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
