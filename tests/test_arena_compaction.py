"""An arena's compaction (PrefixCache.compact): the tree's unlocked device pages move out of
a pool's emptiest frames into the free slots of its others, so whole frames go back to the
arena instead of cached prefixes. Every moved page still holds its tokens' data (a model of
each page's content moves with it, as the engine's bytes do), nothing a running request
holds moves, and the books balance."""

from __future__ import annotations

import numpy as np
from helpers import page_key
from test_arena import PS, ContentCache, tiny_layout

from shadowradix.layout.spec import Retention
from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.policy import CheckpointPolicy


def tree_content_holds(cache: ContentCache) -> int:
    """Every device page the tree holds holds its tokens' data; how many it holds."""
    tree, n = cache.tree, 0
    for node in tree.nodes():
        tokens = np.concatenate([w.tokens for w in tree.path(node)])
        for row in range(tree.n_pools):
            for i, page in enumerate(node.pages[row].tolist()):
                if page >= 0:
                    at = node.start_page + i
                    assert cache.content[row].get(page) == page_key(tokens, at, row, PS), (
                        f"row {row}: page {at} (physical {page}) holds other data")
                    n += 1
    return n


def workload(frames: int, seed: int, running: int = 0) -> tuple[ContentCache, CacheManager, list]:
    """Conversations of random lengths through a CacheManager over `frames` frames, pages
    written as a model would; `running` requests admitted a third of the way in hold their
    pages (and locks) to the end, and are returned with their tokens."""
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, frames * plan_frames(layout).frame_bytes)
    cache = ContentCache(layout, {}, CheckpointPolicy(every_pages=2), arena=arena)
    cache.content = [{} for _ in layout.pools]
    manager = CacheManager(cache)
    rng = np.random.default_rng(seed)
    chats: list[np.ndarray] = []
    held = []
    for step in range(120):
        i, tokens = next_turn(rng, chats, 0.5)
        lease = admit_growing(manager, tokens)
        if lease is None:
            continue
        _write(cache, lease, tokens)
        if len(held) < running and step >= 40:
            held.append((lease, tokens))
            continue
        manager.finish(lease, tokens, tokens.size)
        chats[i] = tokens
        manager.check_integrity()
        tree_content_holds(cache)
    return cache, manager, held


def next_turn(rng: np.random.Generator, chats: list[np.ndarray],
              follow: float) -> tuple[int, np.ndarray]:
    """A request: with chance `follow` a conversation of `chats` extended, else a new one
    (appended); its index and tokens."""
    if chats and rng.random() < follow:
        i = int(rng.integers(len(chats)))
        tokens = np.concatenate([chats[i], rng.integers(0, 50, int(rng.integers(1, 3 * PS)))])
    else:
        tokens = rng.integers(0, 50, int(rng.integers(PS, 5 * PS)))
        i = len(chats)
        chats.append(tokens)
    return i, tokens.astype(np.int32)


def running_pages_hold(cache: ContentCache, lease, tokens: np.ndarray) -> None:
    """What a running request holds (its own pages, and its prefix's ALL pages) never
    moved nor changed."""
    for row, spec in enumerate(cache.layout.pools):
        every = spec.retention is Retention.ALL
        for i, page in enumerate(lease.table[row].tolist()):
            if page >= 0 and (every or lease.own[row, i]):
                assert cache.content[row].get(page) == page_key(tokens, i, row, PS), (
                    f"row {row}: page {i} of a running request moved or changed")


def admit_growing(manager: CacheManager, tokens: np.ndarray):
    """Admit `tokens` a page at a time, as the engine's chunks and decode steps grow a
    request (so an allocation often wants one pool's page while another's frames have
    holes); None, the request aborted, where a page does not fit."""
    lease = manager.admit(tokens, PS)
    if lease is None:
        return None
    for end in range(2 * PS, tokens.size + PS, PS):
        if not manager.grow(lease, min(end, tokens.size)):
            manager.abort(lease)
            return None
    return lease


def _write(cache: ContentCache, lease, tokens: np.ndarray) -> None:
    for row, spec in enumerate(cache.layout.pools):
        whole = spec.retention is Retention.CHECKPOINT
        stop = tokens.size // PS if whole else -(-tokens.size // PS)
        for i in range(stop):
            if lease.own[row, i]:
                cache.content[row][int(lease.table[row, i])] = page_key(tokens, i, row, PS)


def test_compaction_moves_pages_with_their_data() -> None:
    moved = 0
    for seed in range(6):
        cache, _, _ = workload(24, seed)
        moved += sum(cache.moved.values())
        assert tree_content_holds(cache) > 0
        cache.arena.check_integrity(cache._arena_pools)
    assert moved > 0


def test_compaction_never_moves_what_a_running_request_holds() -> None:
    moved = 0
    for seed in range(4):
        cache, manager, held = workload(30, seed, running=2)
        moved += sum(cache.moved.values())
        manager.check_integrity()
        for lease, tokens in held:
            running_pages_hold(cache, lease, tokens)
        tree_content_holds(cache)
        for lease, tokens in held:
            manager.finish(lease, tokens, tokens.size)
        manager.check_integrity()
    assert moved > 0
