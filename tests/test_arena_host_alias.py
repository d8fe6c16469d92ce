"""A frame's bytes pass from pool to pool over an arena: a device page of one pool may sit
where an in-flight host copy still reads (or writes) a page of another. The host tier must
make the new page's user wait for that copy, as it does for a page of the same pool."""

from __future__ import annotations

import threading

import numpy as np
import torch
from helpers import tiny_layout

from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.mover import ThreadMover
from shadowradix.tree.tier import HOST

PS = 4


def _gated_cache(policy: str) -> tuple[PrefixCache, HostTier, threading.Event]:
    """Two ALL pools of different page sizes (kv: a frame a page; c2: two a frame) over 6
    frames with tensors, a host tier, and a mover whose copies wait for `gate`."""
    layout = tiny_layout(PS, all_pools=True, window_pool=False, state=False)
    arena = Arena(layout, 6 * plan_frames(layout).frame_bytes, device="cpu")
    cache = PrefixCache(layout, {}, None, device="cpu", host_pages=16, arena=arena)
    gate = threading.Event()

    def tensor(pool: str, tier: int) -> torch.Tensor:
        gate.wait(30)
        return cache.tensor(pool, tier)

    return cache, HostTier(cache, ThreadMover(tensor, workers=1), policy), gate


def _cached_sequence(cache: PrefixCache, host: HostTier, pages: int) -> np.ndarray:
    """A finished sequence of `pages` pages in the tree, every kv page's bytes its id + 1."""
    got = cache.alloc({n: pages for n in cache.layout.pool_names})
    assert got is not None
    kv = cache.tensor("kv")
    for i, page in enumerate(got["kv"].tolist()):
        kv[:, page] = float(i + 1)
    tokens = np.arange(pages * PS, dtype=np.int32)
    node = cache.insert(tokens, np.stack([got[n] for n in cache.layout.pool_names])).node
    host.after_insert(node)
    return tokens


def _other_pool_in_the_same_bytes(cache: PrefixCache, kv_pages: np.ndarray) -> np.ndarray:
    """c2 pages in frames the kv pages held (all frames are free by now)."""
    arena = cache.arena
    assert arena is not None and arena.free_frames == arena.frames
    got = cache.alloc({"c2": arena.frames * arena.plan.per_frame["c2"]})
    assert got is not None
    frames = cache.arena_frames_of("kv", kv_pages)
    c2 = got["c2"]
    assert frames is not None
    return c2[np.isin(cache.arena_frames_of("c2", c2), frames)]


def test_a_write_back_spill_still_reading_a_frame_holds_back_the_next_pool_there():
    cache, host, gate = _gated_cache("write_back")
    try:
        _cached_sequence(cache, host, 3)
        kv_pages = cache.tree.all_pages("kv").copy()
        host.evict_device("kv", 3)  # spilled: the copies to the host wait at the gate
        assert cache.tree.all_pages("kv").size == 0 and cache.tree.all_pages("kv", HOST).size
        reuse = _other_pool_in_the_same_bytes(cache, kv_pages)
        assert reuse.size
        ticket = host.ready_ticket({"c2": reuse})
        assert ticket > 0 and not host.mover.done(ticket), (
            "c2 pages over the bytes a spill still reads look ready")
        threading.Timer(0.2, gate.set).start()
        host.mover.wait(ticket)
        cache.tensor("c2")[:, reuse] = float("nan")  # the new owner writes its pages
        kv_host = cache.tensor("kv", HOST)
        for page in cache.tree.all_pages("kv", HOST).tolist():
            assert bool(torch.isfinite(kv_host[:, page]).all()), "the spill read the new bytes"
        assert sorted(float(kv_host[0, p, 0, 0]) for p in cache.tree.all_pages("kv", HOST)) == [
            1.0, 2.0, 3.0]
    finally:
        gate.set()
        host.mover.close()


def test_a_load_back_still_writing_a_frame_holds_back_the_next_pool_there():
    """A load-back copy writes device pages; if they go (and their frames with them) before
    it lands, whoever takes the frames must wait for it too."""
    cache, host, gate = _gated_cache("write_through")
    try:
        gate.set()
        tokens = _cached_sequence(cache, host, 3)
        host.mover.wait(host.mover.last)
        cache.evict("kv", 3)  # device copy gone; the host keeps it
        gate.clear()
        m = cache.match(np.concatenate([tokens, tokens[:1]]))
        need = host.load_need(m)
        got = cache.alloc(need)
        assert got is not None
        host.load(m, dict(got))  # the copy into `got` waits at the gate
        cache.evict("kv", 3)  # and those pages go again before it lands
        reuse = _other_pool_in_the_same_bytes(cache, got["kv"])
        assert reuse.size
        ticket = host.ready_ticket({"c2": reuse})
        assert ticket > 0 and not host.mover.done(ticket)
    finally:
        gate.set()
        host.mover.close()
