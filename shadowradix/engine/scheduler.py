"""Who runs each step, with how many tokens. The cache life of every request is the
CacheManager's (tiers/manager.py); this decides only order and budget.

Each step admits waiting requests first-come-first-served while their first chunk fits,
gives every decoding request its one token (and its draft tokens, with speculative
decoding, as far as the budget and its pools allow: pages for drafts never preempt
anyone), then fills the rest of the token budget with prefill chunks (of any size:
chunks need not align with pages or compression windows). A request whose pages cannot
grow preempts the most recently admitted running request (possibly itself), which goes
back to the head of the queue and later resumes from what the cache still holds. A
preempted request never waits behind a newer one.

A request whose pages are still being copied back from the host sits out until its copy
is done (unless nothing else can run): its load-back overlaps the others' compute.

A request whose storage read is in flight keeps its place in the queue and is passed over
(those behind it are admitted) until the read is done, and admission never waits on a
read: when nothing else can run the engine waits briefly (`wait_for_reads`) and steps
again. A read that takes longer than the storage tier's `read_wait_s` is given up on
(counted "read_late"), and its request computes what it would have read.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np

from shadowradix.engine.request import Request
from shadowradix.model.context import RequestKV
from shadowradix.sparse.hot_buffer import HotBuffers, HotSet
from shadowradix.tiers.manager import CacheManager, Lease
from shadowradix.tiers.storage_tier import Fetched

_PENDING = Fetched(-1, -1, [])  # a prefetch still in flight
_USED: Future[Fetched] = Future()  # a prefetch already used
_USED.set_result(Fetched(0, 0, []))


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first position fed this step
    end: int


class Scheduler:
    def __init__(self, manager: CacheManager, step_tokens: int,
                 hot: HotBuffers | None = None) -> None:
        if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens must be an int >= 1, got {step_tokens!r}")
        self.manager = manager
        self.step_tokens = step_tokens
        self.hot = hot  # HiSparse: a running request holds one set of hot buffers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.deferred = 0  # request-steps sat out while their copies ran
        self._preempted_last_step = False
        self._reading: dict[Request, float] = {}  # reads in flight: when each began
        self._passed_over = False  # the last `admit` passed over a request for its read

    @property
    def preempted(self) -> bool:
        """Whether the last `plan` preempted (a lone request that preempted itself is
        admitted again next step, from what it cached)."""
        return self._preempted_last_step

    def fits_ever(self, req: Request) -> bool:
        """Whether the request runs to completion alone in the device pools (its chunks cut
        to fit the window and state pools, down to one token a step)."""
        return self.manager.fits_ever(req.max_tokens)

    # -------------------------------------------------------------- admit
    def admit(self) -> None:
        """Admit waiting requests in arrival order while this step's token budget has room
        for them; stop at the first that does not fit. One whose storage read is still in
        flight keeps its place, and those behind it are considered (a slow read holds back
        no one but its own request, and that one at most `read_wait_s`); this never waits
        on a read. After a step that preempted, admit nothing new until a step runs without
        preempting."""
        self._passed_over = False
        if self._preempted_last_step and self.running:
            return
        manager = self.manager
        budget = self._budget_left()
        reading = 0  # requests at the head of the queue whose storage reads are in flight
        while len(self.waiting) > reading and (budget > 0 or not self.running):
            if self.hot is not None and not self.hot.free:
                return  # every set of hot buffers is taken: wait for a request to end
            req = self.waiting[reading]
            tokens = np.asarray(req.ids, dtype=np.int32)
            fetched = self._prefetched(req, tokens)
            if fetched is _PENDING:
                reading += 1  # it keeps its place; those behind it need not wait for its read
                self._passed_over = True
                continue
            if fetched is not None and manager.host is not None:
                landed = manager.land(tokens, fetched)
                if landed:  # L3 -> L2: the match sees it (else it goes to the device)
                    req.landed, req.prefetch, fetched = landed, _USED, None
            chunk = max(budget, 1) if self.running else self.step_tokens
            lease = manager.admit(tokens, chunk, fetched, req.landed, fit=True,
                                  prompt=req.prompt_len)
            if lease is None and not self.running and manager.cache.arena is not None:
                # Alone and still short: its own cached prefix pins frames it cannot use
                # (an arena frees a frame only when all of it is free). Start it afresh
                # over an empty device; `fits_ever` holds for that.
                manager.flush_device()
                lease = manager.admit(tokens, chunk, fetched, req.landed, fit=True,
                                      prompt=req.prompt_len)
            if lease is None:
                return  # waits for running requests to finish or cache pages
            try:
                self._start(req, lease)
            except BaseException:  # it stays queued, holding nothing
                if req in self.running:
                    self.running.remove(req)
                self._drop(req)
                manager.abort(lease)
                raise
            del self.waiting[reading]
            budget -= len(req.ids) - req.computed

    def _budget_left(self) -> int:
        """Tokens of this step's budget the running requests will not use: admitting more
        than the step can feed only holds pages that the running ones need to grow."""
        used = sum(len(r.ids) + len(r.draft) - r.computed for r in self.running)
        return self.step_tokens - used

    def _start(self, req: Request, lease: Lease) -> None:
        req.lease, req.kv, req.kv_version = lease, RequestKV({}), -1
        if self.hot is not None:
            req.kv.c4 = self.hot.acquire()
        req.computed = lease.cached
        req.prefetch = _USED
        if not req.admitted:
            req.admitted = True
            req.cached, req.from_host = lease.cached, lease.from_host
            req.from_storage = lease.from_storage
            req.admitted_at = time.monotonic()
        self.running.append(req)

    def _prefetched(self, req: Request, tokens: np.ndarray) -> Fetched | None:
        """The request's storage read: started on first sight (past what the device and
        host hold), _PENDING while in flight, then its result. Never waits: a read in
        flight past the tier's `read_wait_s` is given up on (a miss, counted once)."""
        storage = self.manager.storage
        if storage is None:
            return None
        if req.prefetch is None:
            req.prefetch = self.manager.prefetch(tokens)
            if req.prefetch is None:
                req.prefetch = _USED
            else:
                self._reading[req] = time.monotonic()
        read = req.prefetch
        if not read.done():
            now = time.monotonic()
            if now - self._reading.setdefault(req, now) < storage.read_wait_s:
                return _PENDING
            read.cancel()  # not started yet (queued behind others): never runs
            self._reading.pop(req, None)
            req.prefetch = _USED
            storage.faults["read_late"] += 1
            return None
        self._reading.pop(req, None)
        if read.cancelled():  # the tier closed before it ran
            req.prefetch = _USED
            return None
        # Whatever the read raised on the storage thread, BaseException included, is a
        # miss, once: the next admission reads anew, nothing re-raises it every step.
        if read.exception() is not None:
            req.prefetch = _USED
            storage.faults["read_failed"] += 1
            return None
        fetched = read.result()
        return fetched if fetched.pages else None

    def reads_pending(self) -> bool:
        """Whether a waiting request's storage read is in flight, or was when the last
        `admit` passed it over (it may have finished since: the next admission takes it,
        so a step that found nothing to run is not a deadlock)."""
        return self._passed_over or any(not r.done() for r in self._pending_reads())

    def wait_for_reads(self, timeout: float) -> None:
        """Wait until a waiting request's storage read is done, or `timeout` seconds (for
        a step that found nothing to run while reads were in flight: no busy loop, and a
        new request is picked up within `timeout`). Changes nothing."""
        pending = self._pending_reads()
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _pending_reads(self) -> list[Future[Fetched]]:
        return [r.prefetch for r in self.waiting
                if r.prefetch is not None and r.prefetch is not _USED and not r.prefetch.done()]

    # --------------------------------------------------------------- plan
    def ready(self, req: Request) -> bool:
        """Whether the request's host copies are done (so a step need not wait for them)."""
        host = self.manager.host
        return host is None or req.lease is None or host.mover.done(req.lease.ready)

    def plan(self) -> list[Chunk]:
        """This step's work: decode tokens first, then prefill chunks under the budget,
        growing each request's pages (and preempting where they do not fit), then the
        decoding requests' drafts. Drafts have their share of the budget kept from the
        prefill chunks, but their pages come last and never preempt: a request whose
        drafts do not fit decodes one token."""
        budget = self.step_tokens
        chunks: list[Chunk] = []
        self._preempted_last_step = False
        candidates = [r for r in self.running if self.ready(r)] or list(self.running)
        self.deferred += len(self.running) - len(candidates)
        for decode in (True, False):
            if not decode:  # the drafts' share of the budget, kept from the prefill chunks
                budget -= min(budget, sum(len(c.request.draft) for c in chunks))
            for req in candidates:
                if req.lease is None or req.decoding is not decode or budget <= 0:
                    continue
                end = min(len(req.ids), req.computed + budget)
                end = self.manager.chunk_end(req.lease, req.computed, end)  # fits its pools
                if not self._grow(req, end, chunks):
                    continue
                chunks.append(Chunk(req, req.computed, end))
                budget -= end - req.computed
        return self._with_drafts(chunks)

    def _with_drafts(self, chunks: list[Chunk]) -> list[Chunk]:
        """Extend the decode chunks by their requests' drafts while the step's budget and
        their pools allow (`grow` may evict cached pages, never preempt); what does not
        fit is dropped from the draft."""
        left = self.step_tokens - sum(c.end - c.start for c in chunks)
        for i, c in enumerate(chunks):
            req = c.request
            end = c.end
            if req.draft and left > 0 and req.lease is not None:
                end = min(c.end + len(req.draft), c.end + left)
                end = self.manager.chunk_end(req.lease, c.start, end)
                if end > c.end and not self.manager.grow(req.lease, end):
                    end = c.end
            del req.draft[end - c.end:]
            if end > c.end:
                chunks[i] = Chunk(req, c.start, end)
                left -= end - c.end
        return chunks

    def _grow(self, req: Request, end: int, chunks: list[Chunk]) -> bool:
        """Pages up to `end` for `req`, preempting the newest running requests until they
        fit; False when `req` itself was preempted."""
        assert req.lease is not None
        while not self.manager.grow(req.lease, end):
            victim = self.running[-1]
            self.preempt(victim)
            chunks[:] = [c for c in chunks if c.request is not victim]
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Release a running request's pages (its computed full pages stay cached) and put
        it back at the head of the queue, even when handing its pages over raises."""
        assert req.lease is not None
        try:
            self.requeue(req)
        finally:
            self.preemptions += 1
            self._preempted_last_step = True

    def requeue(self, req: Request) -> None:
        """Put a running request back at the head of the queue (preempted, or after a step
        was interrupted under it): its computed full pages join the tree when that still
        works, whatever else it holds is freed, and it resumes from what the cache holds.
        It leaves `running` whatever raises."""
        lease = req.lease
        try:
            if lease is not None and lease.live:
                self.manager.preempt(lease, req.ids, req.computed)
        finally:
            if lease is not None:
                self.manager.abort(lease)  # idempotent: whatever preempt left
            self._drop(req)
            if req in self.running:
                self.running.remove(req)
            if req not in self.waiting:
                self.waiting.appendleft(req)
            self._reading.pop(req, None)
            req.computed, req.prefetch, req.landed = 0, None, 0

    # ------------------------------------------------------------- finish
    def finish(self, req: Request) -> None:
        """Hand the request's computed pages to the cache and forget it."""
        assert req.lease is not None
        self.manager.finish(req.lease, req.ids, req.computed)
        self._drop(req)
        self.running.remove(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is: free its pages, release its lock, forget it."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self._reading.pop(req, None) is not None and req.prefetch is not None:
            req.prefetch.cancel()  # a read not started yet is not worth running
        if req.lease is not None:
            try:
                self.manager.abort(req.lease)
            finally:  # a lease left half-released is an orphan now: release_orphans frees it
                self._drop(req)

    def _drop(self, req: Request) -> None:
        """Forget the request's lease and page tables; its hot buffers go back."""
        if req.kv is not None and isinstance(req.kv.c4, HotSet):
            assert self.hot is not None
            self.hot.release(req.kv.c4)
        req.lease, req.kv = None, None
        req.draft = []

    def release_orphans(self) -> int:
        """Abort leases an exception left without a request (see CacheManager)."""
        attached = {r.lease for r in self.running if r.lease is not None}
        return self.manager.release_orphans(attached)
