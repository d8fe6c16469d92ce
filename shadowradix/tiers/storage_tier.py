"""L3: write-through of computed pages, and prefetch of what the tiers above lack.

A page is stored as one object per pool, keyed by the chained hash of its tokens
(so a key names its whole prefix), in a namespace of the layout and the model's
fingerprint (config and weights), so engines of other models never read it. A request may resume
from storage at page boundary Q only under the same match rule as the tree, and
only if every pool's object for every page it loads arrived intact; anything else
(missing, corrupt, unreachable) is a miss and the pages are recomputed.

Reads and writes run on one storage thread: `prefetch` returns a Future, and
`save` copies the pages' bytes out before it returns (so the pages may be reused at
once) and leaves the store call to the thread. A slow store delays only the
request that waits for its read, never the running batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes


@dataclass(frozen=True)
class Fetched:
    """Stored pages [start, stop) of one prompt, every pool's object of each, intact.

    blobs[(i - start) * pools + j] is page i of pool j (the layout's order).
    """

    start: int
    stop: int
    blobs: list[bytes]

    @property
    def pages(self) -> int:
        return self.stop - self.start


class StorageTier:
    def __init__(self, backend: StorageBackend, cache: PrefixCache,
                 model_fingerprint: str) -> None:
        """`model_fingerprint` names the model's config and weights
        (shadowradix.model.fingerprint.model_fingerprint); ValueError if empty."""
        self.backend = backend
        self.names = cache.layout.pool_names
        self.page_size = cache.layout.page_size
        self.namespace = namespace(cache.layout, model_fingerprint)
        self.rule = cache.tree.rule
        # Bytes of one page of each pool: [layers, entries_per_page, *entry].
        self.page_bytes = cache.layout.page_bytes()
        self.bytes_read = 0
        self.bytes_written = 0
        self.faults: Counter[str] = Counter()  # faults seen here, not in the backend
        # The backend is only ever called from this one thread, in submission order.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shadowradix-storage")
        self._stream: Any = None  # CUDA pools: the copy stream of write-through (lazily)

    def _keys(self, hashes: list[bytes], lo: int, hi: int) -> list[str]:
        return [object_key(self.namespace, name, hashes[i])
                for i in range(lo, hi) for name in self.names]

    # -------------------------------------------------------------- reads
    def prefetch(self, tokens: np.ndarray, table: np.ndarray, limit: int) -> Future[Fetched]:
        """Start fetching what lies past `table` (the pages [0, table.shape[1]) the tiers
        above hold: >= 0 where present) up to page `limit`; see `fetch`."""
        return self._thread.submit(self.fetch, tokens.copy(), table.copy(), limit)

    def fetch(self, tokens: np.ndarray, table: np.ndarray, limit: int) -> Fetched:  # thread
        """The deepest boundary Q <= limit reachable with `table` plus stored pages
        [done, Q), and those pages' objects; empty (stop == start) on any miss."""
        done = table.shape[1]
        empty = Fetched(done, done, [])
        if limit <= done:
            return empty
        hashes = page_hashes(tokens[:limit * self.page_size], self.page_size)
        found = self.backend.batch_exists(self._keys(hashes, done, limit))
        whole = np.asarray(found, dtype=bool).reshape(limit - done, len(self.names)).all(axis=1)
        stop = done + (int(np.argmin(whole)) if not whole.all() else limit - done)
        q = self.rule.deepest_after(table, stop - done)
        if q <= done:
            return empty
        n = len(self.names)
        blobs = self.backend.batch_get(self._keys(hashes, done, q),
                                       [self.page_bytes[self.names[k % n]]
                                        for k in range((q - done) * n)])
        intact: list[bytes] = []
        for i, blob in enumerate(blobs):
            if blob is None:
                return empty  # missing, or refused by its checksum or key (counted inside)
            if len(blob) != self.page_bytes[self.names[i % len(self.names)]]:
                self.faults["wrong_size"] += 1  # intact, but not a page of this layout
                return empty
            intact.append(blob)
        self.bytes_read += sum(len(b) for b in intact)
        return Fetched(done, q, intact)

    def write(self, fetched: Fetched, pages: Mapping[str, np.ndarray],
              tensor: Callable[[str], Any]) -> None:
        """Copy fetched pages into pool pages: page start + i of pool p goes to
        `pages[p][i]` of the tensor `tensor(p)` ([layers, pages, ...], any device);
        -1 skips a page (one the resume does not read)."""
        import torch

        n = len(self.names)
        for k, blob in enumerate(fetched.blobs):
            name = self.names[k % n]
            data = tensor(name)
            page = int(pages[name][k // n])
            if page < 0:
                continue
            raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(data.dtype)
            data[:, page] = raw.view(data[:, page].shape).to(data.device)

    # ------------------------------------------------------------- writes
    def save(self, tokens: np.ndarray, lo: int, hi: int, pages: Mapping[str, np.ndarray],
             tensor: Callable[[str], Any]) -> None:
        """Write-through: store pages [lo, hi) of every pool (`pages[pool][0:hi-lo]`).

        The bytes leave the pages before anything later writes to them, so the caller may
        hand the pages on at once: CPU pools are copied now; CUDA pools go through a copy
        stream into pinned buffers, and the compute stream waits for that copy on the
        device (no host synchronisation on the scheduler's thread). The store call, and
        on CUDA the wait for the copy, run on the storage thread."""
        if hi <= lo:
            return
        hashes = page_hashes(tokens[:hi * self.page_size], self.page_size)
        keys = self._keys(hashes, lo, hi)
        n = len(self.names)
        sources = [tensor(self.names[k % n])[:, int(pages[self.names[k % n]][k // n])]
                   for k in range(len(keys))]
        if sources and sources[0].is_cuda:
            staged, copied = self._stage(sources)
            self._thread.submit(self._store_staged, keys, staged, copied)
        else:
            self._thread.submit(self._store, list(zip(keys, map(_payload, sources),
                                                      strict=True)))

    def _stage(self, sources: list[Any]) -> tuple[list[Any], Any]:
        """Device -> pinned host copies on this tier's own stream, after the KV written so
        far; returns the buffers and the event that marks them done."""
        import torch

        device = sources[0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        self._stream.wait_stream(compute)
        staged = []
        with torch.cuda.stream(self._stream):
            for src in sources:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                buf.copy_(src, non_blocking=True)
                staged.append(buf)
        copied = torch.cuda.Event()
        copied.record(self._stream)
        compute.wait_event(copied)  # a later write to these pages runs after the copy
        return staged, copied

    def _store_staged(self, keys: list[str], staged: list[Any], copied: Any) -> None:
        copied.synchronize()  # on the storage thread: the scheduler never waits for it
        self._store(list(zip(keys, map(_payload, staged), strict=True)))

    def _store(self, items: list[tuple[str, bytes]]) -> None:
        ok = self.backend.batch_set(items)
        self.bytes_written += sum(len(p) for (_, p), good in zip(items, ok, strict=True) if good)

    def drain(self) -> None:
        """Wait until every write and read submitted so far is done."""
        self._thread.submit(lambda: None).result()

    def clear(self) -> int:
        """Delete this namespace's objects from the store (after the writes in flight).
        Raises StorageUnavailable (a RuntimeError) if the store did not finish."""
        return self._thread.submit(self.backend.clear, self.namespace).result()

    @property
    def error_counts(self) -> Counter[str]:
        """Every storage fault so far, by kind (the backend's and this tier's)."""
        return self.backend.errors + self.faults

    @property
    def errors(self) -> int:
        return sum(self.backend.errors.values()) + sum(self.faults.values())

    def close(self) -> None:
        """Wait for the prefetches in flight, then close the backend."""
        self._thread.shutdown(wait=True)
        self.backend.close()


def _payload(page: Any) -> bytes:
    """A page's bytes (any dtype, bf16 too) from a CPU tensor [layers, entries, ...]."""
    import torch

    return page.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
