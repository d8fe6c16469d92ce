"""Replay a trace through the engine's CacheManager: admit, grow, cache, finish.

With a HostTier (metadata-only, its copies counted by a CountingMover) the
replay also loads host pages back before a request runs and backs pages up
under the tier's write policy, as the engine does.

The same loop serves the tree benchmark, the demo and the simulator, so the
numbers they print come from one piece of code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shadowradix.sim.storage import SimStorage
from shadowradix.sim.trace import OUTPUT_TOKEN_BASE, TraceRequest
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager, Lease
from shadowradix.tiers.prefix_cache import PrefixCache


class CountingMover:
    """The simulator's mover: copies nothing; each submission is done at once (the bytes
    each direction would move are counted by the HostTier, `HostTier.bytes`)."""

    def __init__(self) -> None:
        self.last = 0

    def submit(self, copies: Sequence[tuple[str, int, np.ndarray, np.ndarray]]) -> int:
        self.last += 1
        return self.last

    def run(self, fn: Callable[[], None]) -> int:
        fn()
        return self.last

    def done(self, ticket: int) -> bool:
        return True

    def wait(self, ticket: int) -> None:
        pass

    def failures(self, ticket: int) -> list[tuple[int, BaseException | None]]:
        return []


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
           host: HostTier | None = None, storage: SimStorage | None = None,
           per_request: list[int] | None = None) -> ReplayStats:
    """Drive `cache` with `requests` in order, one at a time, through the engine's own
    CacheManager; returns counters and timings.

    with_output: insert prompt + output, not just the prompt, so a conversation's next
        turn can resume there: the sequence's own blocks when the request has a sequence
        chain (`sequence_hash_ids`; a later prompt that starts with it matches it), else
        `output_length` fresh tokens that nothing else contains.
    chunk_pages: prefill in chunks of this many pages; after each chunk the computed
        prefix joins the tree as the engine's does (`CacheManager.cache_prefix`), so the
        pages that left the window become evictable cache (or are freed at once, by an
        eager policy) while the request runs. None: one chunk per request.
    check_every: run the manager's `check_integrity` every N requests (0: never).
    host: the host tier over `cache` (its pools), or None for the device alone.
    storage: the L3 store; a request first reads what lies past the device and host
        (landing on the host when there is one), and writes through what it computed.
    per_request: if given, each request's cached prompt tokens are appended (0 when
        refused), for comparisons request by request.
    """
    if chunk_pages is not None and chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    manager = CacheManager(cache, host, storage)
    ps = cache.layout.page_size
    st = ReplayStats(peak_pages={n: 0 for n in cache.layout.pool_names})
    tokens = _Tokens(with_output)
    t_start = time.perf_counter()
    for i, req in enumerate(requests):
        prompt, seq = tokens(req)
        st.requests += 1
        st.prompt_tokens += prompt.size
        st.prompt_pages += -(-prompt.size // ps)
        t0 = time.perf_counter()
        fetched, landed = None, 0
        pending = manager.prefetch(prompt)
        if pending is not None:
            fetched = pending.result()
            landed = manager.land(prompt, fetched)
            if landed:
                st.storage_pages["host"] += landed
                fetched = None  # else (no host, or no room) the pages go straight to the device
        chunk = chunk_pages * ps if chunk_pages else seq.size
        lease = manager.admit(prompt, chunk, fetched, landed, length=seq.size)
        st.match_s += time.perf_counter() - t0
        if lease is not None and _run(manager, lease, seq, chunk, st):
            st.cached_tokens += lease.cached
            st.host_tokens += lease.from_host
            st.storage_tokens += lease.from_storage
            st.storage_pages["device"] += lease.cached // ps - lease.done
            st.logical_tokens += lease.logical_len
            if per_request is not None:
                per_request.append(lease.cached)
        else:
            st.refused += 1
            if per_request is not None:
                per_request.append(0)
        if check_every and (i + 1) % check_every == 0:
            manager.check_integrity()
        if on_request is not None:
            on_request(i)
    st.wall_s = time.perf_counter() - t_start
    return st


class _Tokens:
    """A request's tokens: the prompt it is admitted with and the sequence it finishes
    with. Expands into one reused buffer (the tree copies what it keeps)."""

    def __init__(self, with_output: bool) -> None:
        self.with_output = with_output
        self.next_output = OUTPUT_TOKEN_BASE
        self.buffer = np.empty(0, dtype=np.int32)

    def __call__(self, req: TraceRequest) -> tuple[np.ndarray, np.ndarray]:
        need = req.expanded_tokens
        if self.buffer.size < need:
            self.buffer = np.empty(2 * need, dtype=np.int32)
        if req.sequence_hash_ids is not None:
            seq = req.sequence_tokens(self.buffer)  # the prompt is its start
            prompt = seq[:req.input_length]
            return prompt, (seq if self.with_output else prompt)
        prompt = req.prompt_tokens(self.buffer)
        if not (self.with_output and req.output_length):
            return prompt, prompt
        if self.next_output + req.output_length > 1 << 31:  # past int32: number them anew
            self.next_output = OUTPUT_TOKEN_BASE  # (a later prompt never reads an output)
        start, self.next_output = self.next_output, self.next_output + req.output_length
        return prompt, np.concatenate([prompt, np.arange(start, self.next_output,
                                                         dtype=np.int32)])


def _run(manager: CacheManager, lease: Lease, seq: np.ndarray, chunk: int,
         st: ReplayStats) -> bool:
    """Compute `seq` past the lease's cached prefix in chunks, caching each chunk's full
    pages as a running engine does, then finish. False (nothing leaked) when the pools
    cannot hold it."""
    cache = manager.cache
    end = min(lease.cached + chunk, seq.size)
    while True:
        t0 = time.perf_counter()
        grown = manager.grow(lease, end)
        st.alloc_s += time.perf_counter() - t0
        if not grown:
            manager.abort(lease)
            return False
        if manager.host is not None:  # as the engine before a forward
            host = manager.host
            ticket = host.step_ticket(lease.ready)
            host.mover.wait(ticket)
            host.recover(ticket)
        for n, pool in cache.pools.items():
            st.peak_pages[n] = max(st.peak_pages[n], pool.used_pages)
        t0 = time.perf_counter()
        if end == seq.size:
            manager.finish(lease, seq, end)
            st.inserted_pages += end // cache.layout.page_size
            st.insert_s += time.perf_counter() - t0
            return True
        manager.cache_prefix(lease, seq, end)
        st.insert_s += time.perf_counter() - t0
        end = min(end + chunk, seq.size)
