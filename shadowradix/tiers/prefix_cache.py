"""The device tier: one ShadowRadix tree over one allocator per pool.

This is the L1 composition every caller starts from (the engine, the
simulator, the benchmarks). It owns the pools and the tree and keeps their
books in step: pages the tree lets go are freed here, never by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shadowradix.layout.spec import KVLayout
from shadowradix.pool.allocator import PAGE_DTYPE, PagePool
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.radix import ShadowRadix
from shadowradix.tree.results import InsertResult, LockHandle, MatchResult
from shadowradix.tree.stats import TreeStats


class PrefixCache:
    """Tree plus pools. `pages` sizes every pool alike (int) or each by name."""

    def __init__(self, layout: KVLayout, pages: int | Mapping[str, int],
                 policy: CheckpointPolicy | None = None, device: Any = None) -> None:
        sizes = {p.name: pages for p in layout.pools} if isinstance(pages, int) else dict(pages)
        missing = set(layout.pool_names) - set(sizes)
        if missing:
            raise ValueError(f"no page count for pools {sorted(missing)}")
        self.layout = layout
        self.tree = ShadowRadix(layout, policy)
        self.pools: dict[str, PagePool] = {}
        for spec in layout.pools:
            storage = None
            if device is not None:
                from shadowradix.pool.storage import PoolStorage

                storage = PoolStorage(spec, layout.page_size, sizes[spec.name], device)
            self.pools[spec.name] = PagePool(spec, layout.page_size, sizes[spec.name], storage)
        self.evicted = {name: 0 for name in layout.pool_names}
        self.evict_seconds = 0.0  # time spent in eviction, for benchmarks

    # --------------------------------------------------------------- reuse
    def match(self, tokens: Sequence[int] | np.ndarray) -> MatchResult:
        return self.tree.match_prefix(tokens)

    def lock(self, target: MatchResult | InsertResult) -> LockHandle:
        """Lock the prefix a match returned, or the one an insert just stored."""
        return self.tree.lock(target.node)

    def unlock(self, handle: LockHandle) -> None:
        self.tree.unlock(handle)

    # ---------------------------------------------------------- allocation
    def alloc(self, need: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Pages for a request, evicting unlocked cache where a pool is short.

        Returns None when even after eviction some pool cannot supply its
        count; then nothing is allocated (cached data may have been evicted).
        """
        for name, n in need.items():  # evicting one pool never shrinks another's free list
            short = n - self.pools[name].free_pages
            if short > 0:
                self.evict(name, short)
        if any(not self.pools[name].can_alloc(n) for name, n in need.items()):
            return None
        return {name: self.pools[name].alloc(n) for name, n in need.items()}

    def free(self, pages: Mapping[str, np.ndarray]) -> None:
        """Return a request's private pages, per pool (real ids only, no -1)."""
        for name, ids in pages.items():
            if len(ids):
                self.pools[name].free(ids)

    def insert(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray,
               start: int = 0, *, finished: bool = True) -> InsertResult:
        """Hand a request's own pages for [start, ...) to the tree (see ShadowRadix.insert);
        the ones it does not adopt are freed here."""
        result = self.tree.insert(tokens, pages, start, finished=finished)
        self.free(result.to_free)
        return result

    def evict(self, pool: str, num_pages: int) -> int:
        """Evict at least `num_pages` of `pool` if possible; returns how many of `pool` went."""
        t0 = time.perf_counter()
        result = self.tree.evict(pool, num_pages)
        for name, pages in result.freed.items():
            self.pools[name].free(pages)
            self.evicted[name] += pages.size
        self.evict_seconds += time.perf_counter() - t0
        return result.count(pool)

    def flush(self) -> None:
        """Drop every unlocked page the tree holds."""
        for name in self.layout.pool_names:
            self.evict(name, self.pools[name].num_pages + 1)

    # ---------------------------------------------------------- inspection
    def check_integrity(self, held: Mapping[str, np.ndarray] | None = None) -> None:
        """Tree invariants, pool free lists, and that every used page has exactly one
        owner: the tree, or a request (`held`, per pool). Raises AssertionError."""
        self.tree.check_integrity()
        for name, pool in self.pools.items():
            pool.check_integrity()
            tree_pages = self.tree.all_pages(name)
            owned = [tree_pages]
            if held is not None and name in held:
                owned.append(np.asarray(held[name], dtype=PAGE_DTYPE))
            allp = np.concatenate(owned)
            if not pool.in_use(tree_pages).all():
                raise AssertionError(f"pool {name!r}: the tree shadows a free page")
            if np.unique(allp).size != allp.size:
                raise AssertionError(f"pool {name!r}: a page has two owners")
            if held is not None and allp.size != pool.used_pages:
                raise AssertionError(f"pool {name!r}: {pool.used_pages} pages in use but "
                                     f"{allp.size} owned (leak)")

    def stats(self) -> dict[str, Any]:
        tree: TreeStats = self.tree.stats()
        out = tree.as_dict()
        for name, pool in self.pools.items():
            entry = out["pools"][name]  # type: ignore[index]
            entry.update(capacity=pool.num_pages, free=pool.free_pages,
                         evicted=self.evicted[name])
        return out
