"""Replay a trace through a PrefixCache: match, lock, allocate, insert, unlock.

With a HostTier (metadata-only, its copies counted by a CountingMover) the
replay also loads host pages back before a request runs and backs pages up
under the tier's write policy, as the engine does.

The same loop serves the tree benchmark, the demo and the simulator, so the
numbers they print come from one piece of code.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shadowradix.sim.storage import SimStorage
from shadowradix.sim.trace import BLOCK_TOKENS, OUTPUT_TOKEN_BASE, TraceRequest
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.results import InsertResult, LockHandle
from shadowradix.tree.tier import HOST


class CountingMover:
    """The simulator's mover: copies nothing, counts the bytes each direction would move."""

    def __init__(self, page_bytes: dict[str, int]) -> None:
        self.page_bytes = page_bytes
        self.bytes = Counter[str]()  # "host->device" / "device->host" -> bytes
        self.last = 0

    def submit(self, copies: Sequence[tuple[str, int, np.ndarray, np.ndarray]]) -> int:
        for pool, tier, src, _ in copies:
            way = "host->device" if tier == HOST else "device->host"
            self.bytes[way] += len(src) * self.page_bytes[pool]
        self.last += 1
        return self.last

    def run(self, fn: Callable[[], None]) -> int:
        fn()
        return self.last

    def done(self, ticket: int) -> bool:
        return True


@dataclass
class ReplayStats:
    requests: int = 0
    refused: int = 0  # did not fit in the pools even after evicting everything unlocked
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_tokens: int = 0  # of cached_tokens, those loaded back from the host tier
    storage_tokens: int = 0  # of cached_tokens, those read from storage
    storage_pages: dict[str, int] = field(  # logical pages read from storage, by destination
        default_factory=lambda: {"host": 0, "device": 0})
    logical_tokens: int = 0  # deepest logical hits (an upper bound for the tiers)
    inserted_pages: int = 0
    prompt_pages: int = 0
    match_s: float = 0.0
    alloc_s: float = 0.0
    insert_s: float = 0.0
    wall_s: float = 0.0
    peak_pages: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens that had to be prefilled."""
        return self.prompt_tokens - self.cached_tokens


def replay(cache: PrefixCache, requests: Iterable[TraceRequest], *, with_output: bool = False,
           chunk_pages: int | None = None, check_every: int = 0,
           on_request: Callable[[int], None] | None = None,
           host: HostTier | None = None, storage: SimStorage | None = None) -> ReplayStats:
    """Drive `cache` with `requests` in order; returns counters and timings.

    with_output: insert prompt + `output_length` synthetic output tokens (a
        conversation's next turn could resume there), not just the prompt.
    chunk_pages: prefill in chunks of this many pages, inserting the prefix
        after each chunk as a running engine does, so the pages that left the
        window become evictable cache (or are freed at once, by an eager
        policy) while the request runs. None: one step per request.
    check_every: run `cache.check_integrity` every N requests (0: never).
    host: the host tier over `cache` (its pools), or None for the device alone.
    storage: the L3 store; a request first reads what lies past the device and host
        (landing on the host when there is one), and writes through what it computed.
    """
    if chunk_pages is not None and chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    st = ReplayStats(peak_pages={n: 0 for n in cache.layout.pool_names})
    next_output = OUTPUT_TOKEN_BASE
    t_start = time.perf_counter()
    buffer = np.empty(0, dtype=np.int32)
    for i, req in enumerate(requests):
        if buffer.size < len(req.hash_ids) * BLOCK_TOKENS:
            buffer = np.empty(2 * len(req.hash_ids) * BLOCK_TOKENS, dtype=np.int32)
        prompt = req.prompt_tokens(buffer)  # the tree copies what it keeps
        seq = prompt
        if with_output and req.output_length:
            out = np.arange(next_output, next_output + req.output_length, dtype=np.int32)
            next_output += req.output_length
            seq = np.concatenate([prompt, out])
        st.requests += 1
        st.prompt_tokens += prompt.size
        st.prompt_pages += -(-prompt.size // cache.layout.page_size)
        t0 = time.perf_counter()
        fetched, landed = (0, 0), 0
        if storage is not None:
            fetched = _fetch(cache, storage, prompt)
            if host is not None and fetched[1] > fetched[0] and host.land(prompt, *fetched):
                landed = fetched[1] - fetched[0]
                st.storage_pages["host"] += landed
                fetched = (0, 0)  # else (no host room) the pages go straight to the device
        m = cache.match(prompt)
        handle = cache.lock(m)
        st.match_s += time.perf_counter() - t0
        ps = cache.layout.page_size
        from_host = m.prefix_len - m.device_prefix_len
        direct = (fetched[1] - fetched[0]) * ps if fetched[0] * ps == m.prefix_len else 0
        if host is not None and not _load_back(cache, host, m):
            cache.unlock(handle)
            st.refused += 1
        elif _RunningRequest(cache, seq, m.prefix_len, handle, st, host).run(chunk_pages):
            cached = m.prefix_len + direct
            st.cached_tokens += cached
            st.host_tokens += from_host - min(landed * ps, from_host)
            st.storage_tokens += min(landed * ps, from_host) + direct
            st.storage_pages["device"] += direct // ps
            st.logical_tokens += m.logical_len
            if storage is not None:
                storage.save(seq, cached // ps, seq.size // ps)
        else:
            st.refused += 1
        if check_every and (i + 1) % check_every == 0:
            cache.check_integrity(held={})
        if on_request is not None:
            on_request(i)
    st.wall_s = time.perf_counter() - t_start
    return st


def _fetch(cache: PrefixCache, storage: SimStorage, prompt: np.ndarray) -> tuple[int, int]:
    """What storage adds past the device and host for this prompt (see SimStorage.fetch)."""
    held = cache.match(prompt).held_table
    return storage.fetch(prompt, held, (prompt.size - 1) // cache.layout.page_size)


def _load_back(cache: PrefixCache, host: HostTier, m: Any) -> bool:
    """Device pages for the host-only part of the match, filled into the tree."""
    need = host.load_need(m)
    if any(need.values()):
        got = cache.alloc(need)
        if got is None:
            return False
        host.load(m, got)
    host.after_match(m)
    return True


class _RunningRequest:
    """One request from its match to its finish, in the cache's terms.

    # [0, done)              borrowed from the tree by the match (locked)
    # [done, handed)         computed, handed to the tree by an insert
    # [handed - hold, ...)   window / state pages the request keeps for itself
    #                        until its next insert (it still reads them)
    # [full, total)          the partial last page: never cached, freed at finish
    """

    def __init__(self, cache: PrefixCache, seq: np.ndarray, prefix_len: int,
                 handle: LockHandle, st: ReplayStats, host: HostTier | None = None) -> None:
        self.cache, self.seq, self.st, self.handle, self.host = cache, seq, st, handle, host
        lay = cache.layout
        ps = lay.page_size
        self.done = prefix_len // ps
        self.full, self.total = seq.size // ps, -(-seq.size // ps)
        self.names = lay.pool_names
        self.short = cache.tree.short_lived_rows
        self.ckpt = cache.tree.rule.checkpoint_names
        self.hold = cache.tree.rule.lock_pages
        # Own pages per pool for [done, total), -1 once handed over (or not yet allocated).
        self.own = np.full((len(self.names), self.total - self.done), -1, dtype=np.int32)

    def run(self, chunk_pages: int | None) -> bool:
        """Serve the request; False (and nothing leaked) when the pools cannot hold it."""
        step = chunk_pages or max(self.total - self.done, 1)
        pos, handed = self.done, self.done
        while pos < self.total:
            end = min(pos + step, self.total)
            if not self._alloc(pos, end):
                self._abort()
                return False
            final = end == self.total
            handed = self._insert(handed, min(end, self.full), final)
            pos = end
        if self.total == self.done:  # nothing to compute (cannot happen for a cap of len-1)
            self.cache.unlock(self.handle)
        return True

    def _alloc(self, pos: int, end: int) -> bool:
        t0 = time.perf_counter()
        need = {n: (min(end, self.full) - min(pos, self.full) if n in self.ckpt else end - pos)
                for n in self.names}
        got = self.cache.alloc(need)
        self.st.alloc_s += time.perf_counter() - t0
        if got is None:
            return False
        for row, n in enumerate(self.names):
            self.own[row, pos - self.done:pos - self.done + got[n].size] = got[n]
            self.st.peak_pages[n] = max(self.st.peak_pages[n], self.cache.pools[n].used_pages)
        return True

    def _insert(self, handed: int, upto: int, final: bool) -> int:
        """Hand pages [handed - hold, upto) to the tree; keep the live window unless final."""
        t0 = time.perf_counter()
        cache, d = self.cache, self.done
        start = max(handed - self.hold, d)
        if final:  # everything goes to the tree but the partial last page
            self._backup(cache.insert(self.seq[:upto * cache.layout.page_size],
                                      self.own[:, start - d:upto - d], start))
            if self.total > self.full:
                last = self.own[:, -1]
                cache.free({n: last[row:row + 1] for row, n in enumerate(self.names)
                            if last[row] >= 0})
            self.own = self.own[:, :0]
            cache.unlock(self.handle)
            self.st.inserted_pages += upto
            self.st.insert_s += time.perf_counter() - t0
            return upto
        pages = self.own[:, start - d:upto - d].copy()
        if self.hold:
            pages[self.short, max(upto - self.hold, start) - start:] = -1
        result = cache.insert(self.seq[:upto * cache.layout.page_size], pages, start,
                              finished=False)
        self._backup(result)
        self.own[:, start - d:upto - d][pages >= 0] = -1
        handle = cache.lock(result)  # lock the new prefix before letting the old go
        cache.unlock(self.handle)
        self.handle = handle
        self.st.insert_s += time.perf_counter() - t0
        return upto

    def _backup(self, result: InsertResult) -> None:
        if self.host is not None:
            self.host.after_insert(result.node)

    def _private(self) -> dict[str, np.ndarray]:
        return {n: self.own[row][self.own[row] >= 0] for row, n in enumerate(self.names)}

    def _abort(self) -> None:
        self.cache.free(self._private())
        self.own = self.own[:, :0]
        self.cache.unlock(self.handle)
