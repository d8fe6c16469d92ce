"""L3: write-through of computed pages, and prefetch of what the tiers above lack.

A page is stored as one object per pool, keyed by the chained hash of its tokens
(so a key names its whole prefix), in a namespace of the layout and the model's
fingerprint (config and weights), so engines of other models never read it. A request may resume
from storage at page boundary Q only under the same match rule as the tree, and
only if every pool's object for every page it loads arrived intact; anything else
(missing, corrupt, unreachable) is a miss and the pages are recomputed.

Reads and writes run on two threads of their own, so a read never queues behind a slow
write: `prefetch` returns a Future (run on the read thread), and `save` copies the pages'
bytes out before it returns (so the pages may be reused at once) and leaves the store call
to the write thread. A read (its probe and its fetch together) and a write each run under
the backend's call deadline where it has one (`deadline_s`, see storage/deadline.py), and
the scheduler waits for a request's read at most `read_wait_s`: a slow store delays only
the request that waits for its read, and that one boundedly, never the running batch nor
a request that needs no read. Backends built for concurrent calls (Redis, Redis Cluster:
redis-py's clients are thread-safe) serve both threads at once; any other (the file
backend's LRU and size account are not) gets one call at a time, under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage import deadline, pace
from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes
from shadowradix.tiers.storage.redis import RedisBackend
from shadowradix.tiers.storage.redis_cluster import RedisClusterBackend

log = logging.getLogger("shadowradix.storage")

T = TypeVar("T")
CONCURRENT = (RedisBackend, RedisClusterBackend)  # safe to call from both threads at once
READ_SLACK_S = 0.5  # scheduling slack past the backend's deadline before a read is given up
NO_DEADLINE_WAIT_S = 10.0  # how long a read may keep its request waiting without a deadline
# Write-through waiting for the store: at most this many calls' worth of bytes (see
# storage/pace.py) and at most BACKLOG_BYTES (but one call); past it a batch is dropped,
# counted "write_dropped".
BACKLOG_CALLS = 8
BACKLOG_BYTES = 1 << 30


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
                 model_fingerprint: str, read_wait_s: float | None = None) -> None:
        """`model_fingerprint` names the model's config and weights
        (shadowradix.model.fingerprint.model_fingerprint); ValueError if empty.
        `read_wait_s`: how long a request waits for its read before it computes instead
        (default: the backend's `deadline_s` plus READ_SLACK_S, or NO_DEADLINE_WAIT_S for
        a backend without one)."""
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
        self.deadline_s: float | None = getattr(backend, "deadline_s", None)
        if read_wait_s is not None:
            self.read_wait_s = deadline.check_deadline(read_wait_s, "read_wait_s")
        else:
            self.read_wait_s = (NO_DEADLINE_WAIT_S if self.deadline_s is None
                                else self.deadline_s + READ_SLACK_S)
        # Reads and writes each in submission order, on their own thread.
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="shadowradix-storage-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="shadowradix-storage-write")
        self._serial = None if isinstance(backend, CONCURRENT) else threading.Lock()
        self._stream: Any = None  # CUDA pools: the copy stream of write-through (lazily)
        # What one call may move, reads and writes apart (storage/pace.py).
        self.read_pace, self.write_pace = pace.Pace(), pace.Pace()
        self.backlog = pace.Backlog()  # write-through not yet stored

    @property
    def rate(self) -> float:
        """Bytes/s the store has shown on reads (see `call_bytes`)."""
        return self.read_pace.rate

    def call_bytes(self, write: bool = False) -> int | None:
        """The most bytes one read (or write) call moves; None for a backend without a
        deadline (no limit). A read past it resumes at the deepest point within it; a write
        is split into such calls."""
        if self.deadline_s is None:
            return None
        return (self.write_pace if write else self.read_pace).call_bytes(self.deadline_s)

    @property
    def backlog_bytes(self) -> int:
        """The most bytes of write-through that may wait for the store."""
        calls = self.call_bytes(write=True)  # at most BACKLOG_BYTES, or one call
        return BACKLOG_BYTES if calls is None else min(BACKLOG_CALLS * calls,
                                                       max(BACKLOG_BYTES, calls))

    def _timed(self, write: bool, asked: int, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)`, a store call moving `asked` bytes (at most `call_bytes(write)`),
        whose pace it learns from: what it moved, when it moved all
        it was asked, or that the store timed out on it. A call larger than one at the
        pace's floor, sized by a pace learnt above it, that timed out is no sign of a dead
        store: the breakers it opened are closed again (see storage/pace.py); the pace is
        back at the floor, so a second timeout is."""
        limit, chosen = self.call_bytes(write), self.write_pace if write else self.read_pace
        closed = [b for b in self.backend.breakers() if not b.is_open]
        before = self.backend.errors["unreachable"]
        t0 = time.monotonic()
        out = call(*args)
        seconds = time.monotonic() - t0
        if limit is None or self.deadline_s is None:
            return out
        if isinstance(out, list) and all(x is not None and x is not False for x in out):
            chosen.moved(asked, seconds, limit)
        elif self.backend.errors["unreachable"] > before:  # (a concurrent call's, maybe)
            learnt = chosen.rate > chosen.floor  # (once back at the floor, no second pardon)
            chosen.timed_out()
            if learnt and chosen.beyond_floor(asked, self.deadline_s):
                log.info("storage %s of %d bytes timed out: asking for less; the store "
                         "stays in use (not skipped, whatever the warning before says)",
                         "write" if write else "read", asked)
                for breaker in closed:
                    breaker.succeeded()
        return out

    def _keys(self, hashes: list[bytes], lo: int, hi: int) -> list[str]:
        return [object_key(self.namespace, name, hashes[i])
                for i in range(lo, hi) for name in self.names]

    # -------------------------------------------------------------- reads
    def prefetch(self, tokens: np.ndarray, table: np.ndarray, limit: int) -> Future[Fetched]:
        """Start fetching what lies past `table` (the pages [0, table.shape[1]) the tiers
        above hold: >= 0 where present) up to page `limit`; see `fetch`. It runs on the
        read thread, within one call deadline."""
        return self._reads.submit(self._call, self.fetch, tokens.copy(), table.copy(), limit)

    def _call(self, call: Callable[..., T], *args: Any, bounded: bool = True) -> T:
        """`call(*args)` on a storage thread: within the backend's deadline (`bounded`),
        one at a time for a backend not built for concurrent calls."""
        with deadline.within(self.deadline_s if bounded else None), \
                self._serial or nullcontext():
            return call(*args)

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
        q = self._within_call(table, stop - done)
        if q <= done:
            return empty
        sizes = [self.page_bytes[name] for _ in range(done, q) for name in self.names]
        blobs = self._timed(False, sum(sizes), self.backend.batch_get,
                            self._keys(hashes, done, q), sizes)
        intact: list[bytes] = []
        for blob, size in zip(blobs, sizes, strict=True):
            if blob is None:
                return empty  # missing, or refused by its digest, key or size (counted inside)
            if len(blob) != size:  # a backend that ignored `sizes`
                self.faults["wrong_size"] += 1  # intact, but not a page of this layout
                return empty
            intact.append(blob)
        self.bytes_read += sum(sizes)
        return Fetched(done, q, intact)

    def _within_call(self, table: np.ndarray, extra: int) -> int:
        """The deepest resume point past `table` with up to `extra` stored pages that one
        read call moves (`call_bytes`); where none is within it (a window wider than a
        call), the nearest beyond it."""
        cap = self.call_bytes()
        if cap is None:
            return self.rule.deepest_after(table, extra)
        done = table.shape[1]
        points = self.rule.points_after(table, extra)
        if not points.size:
            return done
        fit = max(1, cap // sum(self.page_bytes[n] for n in self.names))
        within = points[points <= done + fit]
        return int(within[-1] if within.size else points[0])

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
        on CUDA the wait for the copy, run on the write thread."""
        if hi <= lo:
            return
        nbytes = (hi - lo) * sum(self.page_bytes[n] for n in self.names)
        ticket = self.backlog.take(nbytes, self.backlog_bytes)
        if ticket is None:  # a store that cannot keep up: drop, never queue for ever
            self.faults["write_dropped"] += (hi - lo) * len(self.names)
            log.warning("storage write-through of %d pages dropped: %d bytes still wait "
                        "for the store", hi - lo, self.backlog.bytes)
            return
        try:
            hashes = page_hashes(tokens[:hi * self.page_size], self.page_size)
            keys = self._keys(hashes, lo, hi)
            n = len(self.names)
            sources = [tensor(self.names[k % n])[:, int(pages[self.names[k % n]][k // n])]
                       for k in range(len(keys))]
            if sources and sources[0].is_cuda:
                staged, copied = self._stage(sources)
                self._writes.submit(self._store_staged, keys, staged, copied, ticket)
            else:
                self._writes.submit(self._store, list(zip(keys, map(_payload, sources),
                                                          strict=True)), ticket)
        except BaseException:  # queued or not (see Ticket), it holds no room any more
            ticket.release()
            raise

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

    def _store_staged(self, keys: list[str], staged: list[Any], copied: Any,
                      ticket: pace.Ticket) -> None:
        try:
            copied.synchronize()  # on the write thread: the scheduler never waits for it
            items = list(zip(keys, map(_payload, staged), strict=True))
        except Exception:
            ticket.release()
            self._write_failed(len(keys))
            return
        self._store(items, ticket)

    def _store(self, items: list[tuple[str, bytes]], ticket: pace.Ticket | None = None) -> None:
        """Write-through on the write thread, whose Futures nobody reads: whatever the
        backend raises is counted and logged here, never lost. In calls of at most
        `call_bytes`, each within its own deadline; the backlog `ticket` is released after."""
        try:
            for batch in _batches(items, self.call_bytes(write=True)):
                self._store_batch(batch)
        finally:
            if ticket is not None:
                ticket.release()

    def _store_batch(self, items: list[tuple[str, bytes]]) -> None:
        try:
            ok = self._call(self._timed, True, sum(len(p) for _, p in items),
                            self.backend.batch_set, items)
            written = sum(len(p) for (_, p), good in zip(items, ok, strict=True) if good)
        except Exception:
            self._write_failed(len(items))
            return
        self.bytes_written += written

    def _write_failed(self, n: int) -> None:
        self.faults["write_failed"] += n
        log.warning("storage write of %d objects failed; they are not stored", n,
                    exc_info=True)

    def drain(self) -> None:
        """Wait until every write and read submitted so far is done."""
        writes, reads = self._writes.submit(_nothing), self._reads.submit(_nothing)
        writes.result()
        reads.result()

    def clear(self) -> int:
        """Delete this namespace's objects from the store (after the writes in flight;
        no deadline over the whole deletion, each store command has its own). Raises
        StorageUnavailable (a RuntimeError) if the store did not finish."""
        return self._writes.submit(self._call, self.backend.clear, self.namespace,
                                   bounded=False).result()

    @property
    def error_counts(self) -> Counter[str]:
        """Every storage fault so far, by kind (the backend's and this tier's)."""
        return self.backend.errors + self.faults

    @property
    def errors(self) -> int:
        return sum(self.backend.errors.values()) + sum(self.faults.values())

    def close(self) -> None:
        """Cancel the reads not started, wait for the read in flight (within its deadline)
        and for every write submitted, then close the backend."""
        self._reads.shutdown(wait=True, cancel_futures=True)
        self._writes.shutdown(wait=True)
        self.backend.close()


def _batches(items: list[tuple[str, bytes]],
             limit: int | None) -> list[list[tuple[str, bytes]]]:
    """`items` in runs of at most `limit` payload bytes (at least one item each; None: one
    run)."""
    if limit is None:
        return [items]
    out: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for item in items:
        if out[-1] and size + len(item[1]) > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += len(item[1])
    return out


def _nothing() -> None:
    """A marker submitted behind the calls in flight (drain)."""


def _payload(page: Any) -> bytes:
    """A page's bytes (any dtype, bf16 too) from a CPU tensor [layers, entries, ...]."""
    import torch

    return page.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
