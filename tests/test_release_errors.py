"""A page the cache's queue cannot free (a double free: only a caller's bug puts one there)
must not stop the cache: before, the release was queued again and raised at every later
allocation, eviction and flush, for good. Now the ids that are not in use are dropped with
an error logged (`release_errors`), the rest freed, and the cache serves on."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import serve, tiny_layout

from shadowradix.pool.arena import Arena
from shadowradix.tiers import PrefixCache
from shadowradix.tree.policy import CheckpointPolicy

PS = 4


def make(kind: str) -> PrefixCache:
    layout = tiny_layout(PS)
    if kind == "pools":
        return PrefixCache(layout, 64, CheckpointPolicy())
    arena = Arena(layout, 64 * sum(p.page_bytes(PS) for p in layout.pools))
    return PrefixCache(layout, {}, CheckpointPolicy(), arena=arena)


def held_pages(cache: PrefixCache, tokens: list[int], pool: str) -> np.ndarray:
    """The device pages of `pool` the tree holds for `tokens`."""
    row = cache.layout.index(pool)
    node, pages = cache.tree.root, []
    for child in _path(cache, tokens):
        node = child
        pages.append(node.pages[row][node.pages[row] >= 0])
    assert node is not cache.tree.root
    return np.concatenate(pages)


def _path(cache: PrefixCache, tokens: list[int]):
    m = cache.match(tokens + [0])
    node, out = m.node, []
    while node is not cache.tree.root:
        out.append(node)
        node = node.parent
    return out[::-1]


@pytest.mark.parametrize("kind", ["pools", "arena"])
@pytest.mark.parametrize("pool", ["kv", "swa"])
def test_a_double_free_is_dropped_not_retried_for_ever(kind, pool, caplog) -> None:
    cache = make(kind)
    tokens = list(range(1, 1 + 6 * PS))
    serve(cache, tokens)
    pages = held_pages(cache, tokens, pool)
    assert pages.size >= 2
    bad = pages[:1]
    cache.free({pool: bad})  # the caller's bug: a page the tree holds, freed behind its back
    with caplog.at_level(logging.ERROR, logger="shadowradix.tiers.prefix_cache"):
        cache.flush()  # the tree lets every page go: that one twice
    assert cache.release_errors == 1
    assert any("freed twice" in r.getMessage() for r in caplog.records)
    assert cache.tree.stats().pools[pool].pages == 0
    for name, p in cache.pools.items():  # the rest went back
        assert p.used_pages == 0, (name, p.used_pages)
    cache.check_integrity(held={})
    # and the cache serves on, every page of it
    serve(cache, tokens)
    assert cache.match(tokens + [0]).prefix_len == len(tokens)
    cache.flush()
    got = cache.alloc({name: 8 for name in cache.layout.pool_names})
    assert got is not None
    cache.free(got)
    cache.check_integrity(held={})
    assert cache.release_errors == 1


def test_a_refusal_for_another_reason_is_kept_and_raised(monkeypatch) -> None:
    """A ValueError with every id in use (not a double free: a fault) drops nothing: the
    release waits and the error reaches the caller, as any fault in a free."""
    cache = make("pools")
    tokens = list(range(1, 1 + 6 * PS))
    serve(cache, tokens)
    pool = cache.pools["kv"]
    real = type(pool).free
    calls = {"n": 0}

    def refuse_once(self, pages):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("injected")
        return real(self, pages)

    monkeypatch.setattr(type(pool), "free", refuse_once)
    with pytest.raises(ValueError, match="injected"):
        cache.flush()
    assert cache.release_errors == 0
    monkeypatch.setattr(type(pool), "free", real)
    cache.flush()  # the queued release goes now
    assert all(p.used_pages == 0 for p in cache.pools.values())
    cache.check_integrity(held={})
