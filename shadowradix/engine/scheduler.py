"""Admission and step planning: who runs this step, with how many tokens.

Each step first gives every decoding request its one token, then fills the
rest of the token budget with prefill chunks (of any size: chunks need not
align with pages or compression windows), then admits waiting requests in
arrival order while their pages fit.

A request whose pages are still being copied back from the host sits out
until its copy is done (unless nothing else can run): its load-back overlaps
the compute of the requests admitted before it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from shadowradix.engine.request import Request
from shadowradix.model.context import RequestKV
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage_tier import Fetched, StorageTier
from shadowradix.tree.tier import HOST

_PENDING = Fetched(-1, -1, [])  # a prefetch still in flight
_NOTHING: Future[Fetched] = Future()  # a prefetch already used
_NOTHING.set_result(Fetched(0, 0, []))


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first position fed this step
    end: int


class Scheduler:
    def __init__(self, cache: PrefixCache, step_tokens: int, device: torch.device,
                 storage: StorageTier | None = None, host: HostTier | None = None) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.cache = cache
        self.step_tokens = step_tokens
        self.device = device
        self.storage = storage
        self.host = host
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def page_size(self) -> int:
        return self.cache.layout.page_size

    def fits_ever(self, req: Request) -> bool:
        """Whether the request fits in empty pools at all."""
        need = req.pages_needed(self.page_size)
        return all(pool.num_pages >= need for pool in self.cache.pools.values())

    def admit(self) -> None:
        """Match, lock, allocate, load back, in arrival order; stop at the first that does
        not fit, or whose storage prefetch is still in flight while others can run."""
        ps = self.page_size
        while self.waiting:
            req = self.waiting[0]
            prompt = np.asarray(req.ids[:req.prompt_len], dtype=np.int32)
            fetched = self._prefetched(req, prompt)
            if fetched is _PENDING:
                return  # the running requests compute while storage answers
            if fetched is not None and self.host is not None and self._land(req, prompt, fetched):
                fetched = None  # L3 -> L2: the match sees it (else it goes to the device)
            m = self.cache.match(prompt)
            handle = self.cache.lock(m)
            done, total = m.prefix_len // ps, req.pages_needed(ps)
            load = self.host.load_need(m) if self.host is not None else {}
            need = {name: total - done + load.get(name, 0) for name in self.cache.pools}
            got = self.cache.alloc(need)
            if got is None:
                self.cache.unlock(handle)
                return  # waits for running requests to finish and free pages
            self.waiting.popleft()
            prefix = m.page_table
            if self.host is not None:  # L2 -> L1 copies start now; req.ready waits for them
                prefix = self.host.load(m, {n: got[n][:load.get(n, 0)] for n in got})
                got = {n: got[n][load.get(n, 0):] for n in got}
                self.host.after_match(m)
            resume = done
            if fetched is not None and fetched.pages and fetched.start == done:  # L3 -> L1
                assert self.storage is not None
                dst = {n: got[n][:fetched.pages] for n in got}
                if self.host is not None:  # a copy may still read these (reused) pages
                    self.host.mover.wait(self.host.ready_ticket(dst))
                self.storage.write(fetched, dst, self.cache.tensor)
                resume = fetched.stop
            tables = {}
            for row, name in enumerate(self.cache.layout.pool_names):
                table = np.empty(total, dtype=np.int64)
                table[:done] = prefix[row]
                table[done:] = got[name]
                tables[name] = torch.from_numpy(table).to(self.device)
            if self.host is not None:  # copies still reading or writing any of its pages
                req.ready = self.host.ready_ticket(
                    {n: np.concatenate((prefix[row], got[n]))
                     for row, n in enumerate(self.cache.layout.pool_names)})
            req.match, req.handle, req.own = m, handle, got
            req.kv = RequestKV(tables)
            req.cached = req.computed = resume * ps
            from_host = done * ps - m.device_prefix_len
            landed = min(req.landed * ps, from_host)  # host pages that came from storage
            req.from_host = from_host - landed
            req.from_storage = landed + (resume - done) * ps
            self.running.append(req)

    def _prefetched(self, req: Request, prompt: np.ndarray) -> Fetched | None:
        """The request's storage read: started on first sight (past what the device and
        host hold), _PENDING while in flight and others can run, then its result."""
        if self.storage is None:
            return None
        if req.prefetch is None:
            peek = self.cache.match(prompt)  # nothing locked: only where to start reading
            req.prefetch = self.storage.prefetch(prompt, peek.held_table,
                                                 (req.prompt_len - 1) // self.page_size)
        if not req.prefetch.done() and self.running:
            return _PENDING
        fetched = req.prefetch.result()
        return fetched if fetched.pages else None

    def _land(self, req: Request, prompt: np.ndarray, fetched: Fetched) -> bool:
        """Fetched pages onto the host tier (L3 -> L2), once: a retry of the admission
        finds them in the tree."""
        assert self.host is not None and self.storage is not None
        storage, host_tensor = self.storage, partial(self.cache.tensor, tier=HOST)
        if not self.host.land(prompt, fetched.start, fetched.stop,
                              lambda pages: storage.write(fetched, pages, host_tensor)):
            return False
        req.landed = fetched.pages
        req.prefetch = _NOTHING
        return True

    def ready(self, req: Request) -> bool:
        """Whether the request's host copies are done (so a step need not wait for them)."""
        return self.host is None or self.host.mover.done(req.ready)

    def plan(self) -> list[Chunk]:
        """This step's work: decode tokens first, then prefill chunks under the budget."""
        budget = self.step_tokens
        chunks = []
        running = [r for r in self.running if self.ready(r)] or self.running
        for req in running:
            if not req.prefilling and budget > 0:
                chunks.append(Chunk(req, req.computed, req.computed + 1))
                budget -= 1
        for req in running:
            if req.prefilling and budget > 0:
                end = min(req.prompt_len, req.computed + budget)
                chunks.append(Chunk(req, req.computed, end))
                budget -= end - req.computed
        return chunks

    def abort(self, requests: list[Request]) -> None:
        """Drop these requests: free their pages, release their locks, forget them."""
        for req in requests:
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.cache.free(req.own)
                self._release(req)

    def finish(self, req: Request) -> None:
        """Hand the request's computed full pages to the tree; free the rest; unlock."""
        ps = self.page_size
        assert req.match is not None
        done = req.match.prefix_len // ps  # borrowed from the device tree
        loaded = req.cached // ps  # [done, loaded) came from storage, [loaded, full) computed
        full = req.computed // ps
        if self.storage is not None:  # write-through of what this request computed
            self.storage.save(np.asarray(req.ids[:full * ps], dtype=np.int32), loaded, full,
                              {n: p[loaded - done:full - done] for n, p in req.own.items()},
                              self.cache.tensor)
        own = np.stack([req.own[name][:full - done] for name in self.cache.layout.pool_names])
        result = self.cache.insert(req.ids[:full * ps], own, done)
        if self.host is not None:
            self.host.after_insert(result.node)
        self.cache.free({name: pages[full - done:] for name, pages in req.own.items()})
        self._release(req)

    def _release(self, req: Request) -> None:
        """Unlock and forget a request whose pages are already back with their owners."""
        assert req.handle is not None
        self.cache.unlock(req.handle)
        req.own, req.kv, req.handle = {}, None, None
        self.running.remove(req)
