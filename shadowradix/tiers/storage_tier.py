"""L3 under the device tier: write-through of computed pages, exact load-back on a miss.

A page is stored as one object per pool, keyed by the chained hash of its tokens
(so a key names its whole prefix), in the layout's namespace. A request may resume
from storage at page boundary Q only under the same match rule as the device tier,
and only if every pool's object for every page it loads arrived intact; anything
else (missing, corrupt, unreachable) is a miss and the pages are recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shadowradix.pool.allocator import PagePool
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes


class StorageTier:
    def __init__(self, backend: StorageBackend, cache: PrefixCache) -> None:
        self.backend = backend
        self.pools: dict[str, PagePool] = cache.pools
        self.page_size = cache.layout.page_size
        self.namespace = namespace(cache.layout)
        self.rule = cache.tree.rule
        self.bytes_read = 0
        self.bytes_written = 0

    def _keys(self, hashes: list[bytes], lo: int, hi: int) -> list[str]:
        return [object_key(self.namespace, name, hashes[i])
                for i in range(lo, hi) for name in self.pools]

    def probe(self, tokens: np.ndarray, device_table: np.ndarray,
              limit: int) -> tuple[int, list[bytes]]:
        """Deepest page boundary Q <= limit reachable with device pages [0, done) plus
        stored pages [done, Q) (every pool present for every page in that range), and the
        page hashes of `tokens` for `load` to reuse."""
        done = device_table.shape[1]
        if limit <= done:
            return done, []
        hashes = page_hashes(tokens[:limit * self.page_size], self.page_size)
        found = self.backend.batch_exists(self._keys(hashes, done, limit))
        whole = np.asarray(found, dtype=bool).reshape(limit - done, len(self.pools)).all(axis=1)
        stop = done + (int(np.argmin(whole)) if not whole.all() else limit - done)
        if stop == done:
            return done, hashes
        table = np.concatenate([device_table, np.zeros((len(self.pools), stop - done),
                                                       dtype=device_table.dtype)], axis=1)
        return max(self.rule.deepest(table), done), hashes

    def load(self, hashes: list[bytes], done: int, q: int,
             pages: Mapping[str, np.ndarray]) -> bool:
        """Copy stored pages [done, q) (keys from `probe`'s hashes) into the device pages
        `pages[pool][0:q-done]`. False (nothing usable) if any object is missing, corrupt
        or the wrong size."""
        blobs = self.backend.batch_get(self._keys(hashes, done, q))
        names = list(self.pools)
        for i, blob in enumerate(blobs):
            name = names[i % len(names)]
            data = self._tensor(name)
            if blob is None or len(blob) != data[:, 0].numel() * data.element_size():
                return False
        import torch

        for i, blob in enumerate(blobs):
            name = names[i % len(names)]
            data = self._tensor(name)
            assert blob is not None
            page = int(pages[name][i // len(names)])
            raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(data.dtype)
            data[:, page] = raw.view(data[:, page].shape).to(data.device)
            self.bytes_read += len(blob)
        return True

    def save(self, tokens: np.ndarray, lo: int, hi: int,
             pages: Mapping[str, np.ndarray]) -> None:
        """Write-through: store pages [lo, hi) of every pool (`pages[pool][0:hi-lo]`)."""
        if hi <= lo:
            return
        import torch

        hashes = page_hashes(tokens[:hi * self.page_size], self.page_size)
        keys = self._keys(hashes, lo, hi)
        names = list(self.pools)
        items = []
        for i, key in enumerate(keys):
            name = names[i % len(names)]
            page = int(pages[name][i // len(names)])
            page_data = self._tensor(name)[:, page].contiguous().reshape(-1)
            payload = page_data.view(torch.uint8).cpu().numpy().tobytes()  # any dtype, bf16 too
            items.append((key, payload))
        ok = self.backend.batch_set(items)
        self.bytes_written += sum(len(p) for (_, p), good in zip(items, ok, strict=True) if good)

    def _tensor(self, name: str) -> Any:
        storage = self.pools[name].storage
        assert storage is not None, "the storage tier needs pools with tensor storage"
        return storage.data

    @property
    def errors(self) -> int:
        return sum(self.backend.errors.values())
