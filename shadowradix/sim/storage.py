"""The simulator's L3: which pages a shared store holds, by the engine's own keys.

Metadata-only: a page is its chained 128-bit hash (the engine's L3 key, every pool
stored together), an LRU over pages caps the store's bytes, and nothing is read or
written. `fetch` answers what the engine's prefetch would: the deepest boundary
past what the device and host hold that the stored pages make resumable.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage.keys import page_hashes
from shadowradix.tiers.storage_tier import Fetched


class SimStorage:
    def __init__(self, cache: PrefixCache, cap_bytes: float | None) -> None:
        if cap_bytes is not None and cap_bytes < 0:
            raise ValueError(f"storage cap must be >= 0 bytes, got {cap_bytes}")
        self.page_size = cache.layout.page_size
        self.rule = cache.tree.rule
        self.page_bytes = sum(cache.layout.page_bytes().values())  # one page, every pool
        self.cap_pages = None if cap_bytes is None else int(cap_bytes // self.page_bytes)
        self._pages: OrderedDict[bytes, None] = OrderedDict()
        self.bytes_written = 0

    def fetch(self, tokens: np.ndarray, held: np.ndarray, limit: int) -> tuple[int, int]:
        """(start, stop): stored pages [start, stop) extend `held` ([pools, start] page
        ids, >= 0 where the device or host has the page) to the deepest resumable
        boundary <= `limit`; stop == start when storage adds nothing."""
        start = held.shape[1]
        if limit <= start:
            return start, start
        hashes = page_hashes(tokens[:limit * self.page_size], self.page_size)
        stop = start
        while stop < limit and hashes[stop] in self._pages:
            stop += 1
        q = self.rule.deepest_after(held, stop - start)
        for h in hashes[start:q]:
            self._pages.move_to_end(h)
        return start, q

    def prefetch(self, tokens: np.ndarray, held: np.ndarray, limit: int) -> Future[Fetched]:
        """`fetch` as the engine's StorageTier.prefetch answers it (already done; no bytes),
        so the CacheManager drives both stores alike."""
        done: Future[Fetched] = Future()
        done.set_result(Fetched(*self.fetch(tokens, held, limit), []))
        return done

    def save(self, tokens: np.ndarray, lo: int, hi: int, pages: object = None,
             tensor: object = None) -> None:
        """Write-through of pages [lo, hi) of `tokens`, as the engine writes what a request
        computed (pages it got from a cache tier are not written again). `pages` and
        `tensor` (the engine's StorageTier signature) are ignored: nothing is stored."""
        if hi <= lo:
            return
        for h in page_hashes(tokens[:hi * self.page_size], self.page_size)[lo:]:
            if h in self._pages:
                self._pages.move_to_end(h)
                continue
            self._pages[h] = None
            self.bytes_written += self.page_bytes
            if self.cap_pages is not None and len(self._pages) > self.cap_pages:
                self._pages.popitem(last=False)
