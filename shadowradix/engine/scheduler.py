"""Admission and step planning: who runs this step, with how many tokens.

Each step first gives every decoding request its one token, then fills the
rest of the token budget with prefill chunks (of any size: chunks need not
align with pages or compression windows), then admits waiting requests in
arrival order while their pages fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from shadowradix.engine.request import Request
from shadowradix.model.context import RequestKV
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage_tier import StorageTier


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first position fed this step
    end: int


class Scheduler:
    def __init__(self, cache: PrefixCache, step_tokens: int, device: torch.device,
                 storage: StorageTier | None = None) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.cache = cache
        self.step_tokens = step_tokens
        self.device = device
        self.storage = storage
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
        """Match, lock, allocate, in arrival order; stop at the first that does not fit."""
        ps = self.page_size
        while self.waiting:
            req = self.waiting[0]
            m = self.cache.match(req.ids[:req.prompt_len])
            handle = self.cache.lock(m)
            done, total = m.prefix_len // ps, req.pages_needed(ps)
            got = self.cache.alloc({name: total - done for name in self.cache.pools})
            if got is None:
                self.cache.unlock(handle)
                return  # waits for running requests to finish and free pages
            self.waiting.popleft()
            prompt = np.asarray(req.ids[:req.prompt_len], dtype=np.int32)
            resume = done
            if self.storage is not None:
                q, hashes = self.storage.probe(prompt, m.page_table, (req.prompt_len - 1) // ps)
                if q > done and self.storage.load(
                        hashes, done, q, {n: got[n][:q - done] for n in got}):
                    resume = q
            tables = {}
            for row, name in enumerate(self.cache.layout.pool_names):
                table = np.empty(total, dtype=np.int64)
                table[:done] = m.page_table[row]
                table[done:] = got[name]
                tables[name] = torch.from_numpy(table).to(self.device)
            req.match, req.handle, req.own = m, handle, got
            req.kv = RequestKV(tables)
            req.cached = req.computed = resume * ps
            req.from_storage = (resume - done) * ps
            self.running.append(req)

    def plan(self) -> list[Chunk]:
        """This step's work: decode tokens first, then prefill chunks under the budget."""
        budget = self.step_tokens
        chunks = []
        for req in self.running:
            if not req.prefilling and budget > 0:
                chunks.append(Chunk(req, req.computed, req.computed + 1))
                budget -= 1
        for req in self.running:
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
                              {n: p[loaded - done:full - done] for n, p in req.own.items()})
        own = np.stack([req.own[name][:full - done] for name in self.cache.layout.pool_names])
        self.cache.insert(req.ids[:full * ps], own, done)
        self.cache.free({name: pages[full - done:] for name, pages in req.own.items()})
        self._release(req)

    def _release(self, req: Request) -> None:
        """Unlock and forget a request whose pages are already back with their owners."""
        assert req.handle is not None
        self.cache.unlock(req.handle)
        req.own, req.kv, req.handle = {}, None, None
        self.running.remove(req)
