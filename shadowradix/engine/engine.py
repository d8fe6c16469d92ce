"""The public Engine: DeepSeek-V4 generation through ShadowRadix (DESIGN.md §7).

Online core: `add_request` queues a request, `step` runs one scheduler step and returns
what each request produced, `abort` drops one, `generate` is a loop over these. The
engine is not thread-safe: call it from one thread (a server drives it from its own
loop thread). A call that overlaps another raises RuntimeError instead of corrupting
state.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from shadowradix.engine.cache_control import CacheControl
from shadowradix.engine.config import CacheConfig, SamplingParams, SpecConfig
from shadowradix.engine.request import Request, Result, StepOutput
from shadowradix.engine.sampling import sample
from shadowradix.engine.scheduler import Chunk, Scheduler
from shadowradix.engine.speculator import Speculator
from shadowradix.engine.transaction import Snapshot
from shadowradix.engine.validation import (
    Part,
    allocating,
    check_memory,
    checked_batch,
    model_layout,
)
from shadowradix.engine.verify import verify
from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.model import DeepseekV4Runner, PagedStorage
from shadowradix.model.attention import CSA
from shadowradix.model.compressor import rewind_states
from shadowradix.model.context import RequestKV
from shadowradix.model.fingerprint import model_fingerprint
from shadowradix.model.mtp import MTPBlock, load_mtp, mtp_config, part_dtype
from shadowradix.model.mtp_runner import MTPRunner
from shadowradix.pool.arena import Arena, arena_bytes
from shadowradix.sparse import AccessStream
from shadowradix.sparse.hot_buffer import HotBuffers, HotSet
from shadowradix.sparse.hot_sizing import hot_bytes, hot_sets
from shadowradix.tiers.bounds import RequestBounds
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager, Lease
from shadowradix.tiers.mover import mover_for
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage import open_storage
from shadowradix.tiers.storage_tier import StorageTier
from shadowradix.tree.policy import named_policy


def _sized_by(layout: KVLayout, config: CacheConfig) -> dict[str, str]:
    """The setting that sizes each pool's fixed page count: window_tokens (WINDOW pools)
    or state_tokens (CHECKPOINT pools) where set, device_tokens otherwise."""
    own = {Retention.WINDOW: "window_tokens", Retention.CHECKPOINT: "state_tokens"}
    return {p.name: knob if (knob := own.get(p.retention)) and getattr(config, knob)
            else "device_tokens" for p in layout.pools}


READ_POLL_S = 0.01  # a step with only storage reads to wait for waits this long at most


class Engine:
    """Runs a DeepSeek-V4 model with every KV form in ShadowRadix pools.

    generate() (a loop over add_request / step) returns Results whose logits equal
    transformers' uncached forward within float32 rounding, whatever the cache
    served. Bad input raises ValueError before any state changes. step_tokens: the
    tokens one step feeds (decode tokens first, then prefill chunks). record_topk: record
    each request's decode-time C4 selections per CSA layer into `Result.topk` (HiSparse's
    access streams, for offline replay); off, nothing is recorded and nothing is slower.
    """

    def __init__(self, hf_model: Any, config: CacheConfig, step_tokens: int = 512,
                 record_topk: bool = False, speculative: SpecConfig | None = None,
                 mtp: Any = None) -> None:
        if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens must be an int >= 1, got {step_tokens!r}")
        if not isinstance(record_topk, bool):
            raise ValueError(f"record_topk must be a bool, got {record_topk!r}")
        if speculative is not None and not isinstance(speculative, SpecConfig):
            raise ValueError(f"speculative must be a SpecConfig or None, got {speculative!r}")
        self.record_topk = record_topk
        mtp = _mtp_block(speculative, mtp, hf_model)
        extra = [MTPRunner.layer_type] if mtp is not None else []
        self.layout = model_layout(hf_model, config.page_size, extra)
        cfg = hf_model.config
        self.device = next(hf_model.parameters()).device
        self.config = config
        self.vocab_size = int(cfg.vocab_size)
        # the longest prompt + output the model's positions allow
        self.positions = int(getattr(cfg, "max_position_embeddings", 0) or 2**31)
        self.speculator = Speculator(speculative, self.vocab_size,
                                     MTPRunner(mtp, hf_model) if mtp is not None else None)
        eos = cfg.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        host_pages = config.host_tokens // config.page_size if config.host_tokens else None
        sized_by = _sized_by(self.layout, config)
        pages = {n: getattr(config, knob) // config.page_size for n, knob in sized_by.items()}
        self._csa_layers = [i for i, kind in enumerate(cfg.layer_types) if kind == CSA]
        self._index_topk = int(getattr(cfg, "index_topk", 1))
        self._c4_ratio = int(self.layout.pool("c4").ratio or 1) if self._csa_layers else 1
        self._check_hisparse(config)
        resident = ("c4",) if config.hisparse_buffer is not None else ()
        in_arena = [n for n in self.layout.pool_names if n not in resident]
        self._hot_sets = 0 if config.hisparse_buffer is None else hot_sets(
            self.layout, config.hisparse_buffer, config.hisparse_requests, pages["c4"],
            config.device_bytes)
        hot = 0 if config.hisparse_buffer is None else hot_bytes(
            self.layout, len(self._csa_layers), self._hot_sets, config.hisparse_buffer)
        self.device_bytes = config.device_bytes
        if self.device_bytes is None and config.window_tokens is config.state_tokens is None:
            # device_tokens as a shorthand: the bytes that many tokens take in every pool,
            # and at least what the longest request of fixed pools that size takes alone
            bounds = RequestBounds.of(self.layout, named_policy(config.policy))
            self.device_bytes = arena_bytes(self.layout, pages, in_arena, hot,
                                            bounds.peak_pages(config.device_tokens),
                                            bounds.spread)
        sizing = self._check_memory(config, pages, sized_by, host_pages, resident, in_arena,
                                    hot)
        arena = None
        with allocating(sizing):
            if self.device_bytes is not None:
                try:
                    arena = Arena(self.layout, self.device_bytes, self.device, names=in_arena,
                                  reserved_bytes=hot)
                except ValueError as e:
                    why = (f"; HiSparse's hot buffers take {hot} bytes of it ({self._hot_sets} "
                           f"sets of hisparse_buffer={config.hisparse_buffer} entries in "
                           f"{len(self._csa_layers)} layers, for hisparse_requests="
                           f"{config.hisparse_requests}): lower those or raise device_bytes"
                           ) if hot else ""
                    raise ValueError(f"device_bytes={self.device_bytes}: {e}{why}") from None
            self._prefix = PrefixCache(self.layout, pages, named_policy(config.policy),
                                       device=self.device, host_pages=host_pages,
                                       in_host_memory=resident, arena=arena)
        pools = {name: pool.storage for name, pool in self._prefix.pools.items()}
        self.store = PagedStorage.for_layer_types(self.layout, pools,  # type: ignore[arg-type]
                                                  [*cfg.layer_types, *extra])
        self.runner = DeepseekV4Runner(hf_model.eval())
        with allocating(sizing):
            self.hot = self._hot_buffers(config)
        self.storage = None
        if config.storage is not None:
            backend = open_storage(config.storage, config.storage_cap_bytes,
                                   secret=config.storage_secret)
            self.storage = StorageTier(backend, self._prefix,
                                       model_fingerprint(hf_model, *filter(None, [mtp])))
        self.host = None
        if host_pages is not None:
            self.host = HostTier(self._prefix, mover_for(self._prefix.tensor, self.device),
                                 config.write_policy, config.write_hit_threshold)
        self.manager = CacheManager(self._prefix, self.host, self.storage,
                                    poison=config.debug_poison, reuse=config.prefix_reuse)
        self.scheduler = Scheduler(self.manager, step_tokens, self.hot)
        self.cache = CacheControl(self._prefix, self.storage, self.host)
        self._counters: dict[str, float] = {
            "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0,
            "decode_tokens": 0, "steps": 0, "step_seconds": 0.0, "forward_seconds": 0.0,
            "host_tokens": 0, "storage_tokens": 0, "copy_stalls": 0, "copy_stall_seconds": 0.0,
            "aborted": 0, "failed": 0}
        self._requests: dict[str, Request] = {}  # queued or running (finished ones leave)
        self._outbox: list[StepOutput] = []  # produced but not yet returned by `step`
        self._ids = itertools.count()
        self._busy = threading.Lock()
        self._closed = False

    def _check_memory(self, config: CacheConfig, pages: dict[str, int],
                      sized_by: dict[str, str], host_pages: int | None,
                      resident: Sequence[str], in_arena: Sequence[str], hot_bytes: int) -> str:
        """ValueError when the cache's tensors would take more memory than the device or
        this machine has (validation.check_memory), naming the settings that size each
        part (`sized_by`: the setting behind each pool's `pages`); those settings, for
        later messages."""
        page = self.layout.page_bytes()
        on_device: list[Part] = []
        if self.device_bytes is not None:
            knob = "device_bytes" if config.device_bytes is not None else "device_tokens"
            on_device.append((f"{knob}={getattr(config, knob)}", self.device_bytes - hot_bytes,
                              (knob,)))
        else:  # fixed pools, each sized by its setting
            fixed: dict[str, int] = {}
            for name in in_arena:
                knob = sized_by[name]
                fixed[knob] = fixed.get(knob, 0) + pages[name] * page[name]
            on_device += [(f"{k}={getattr(config, k)}", b, (k,)) for k, b in fixed.items()]
        if hot_bytes:
            on_device.append((f"HiSparse's hot buffers (hisparse_requests={self._hot_sets}, "
                              f"hisparse_buffer={config.hisparse_buffer})", hot_bytes,
                              ("hisparse_requests", "hisparse_buffer")))
        in_host: list[Part] = [(f"device_tokens={config.device_tokens} (its {n} pool in host "
                                f"memory)",
                                pages[n] * page[n], ("device_tokens",)) for n in resident]
        if host_pages:
            in_host.append((f"host_tokens={config.host_tokens}",
                            host_pages * sum(page.values()), ("host_tokens",)))
        check_memory(self.device, on_device, in_host)
        return ", ".join(label for label, _, _ in (*on_device, *in_host))

    def _check_hisparse(self, config: CacheConfig) -> None:
        if config.hisparse_buffer is None:
            return
        if not self._csa_layers:
            raise ValueError("hisparse_buffer: this model has no compressed sparse attention "
                             "(CSA) layers, so there is no C4 KV to keep hot; use None")
        least = self._index_topk + 1
        if config.hisparse_buffer < least:
            raise ValueError(f"hisparse_buffer must be at least index_topk + 1 = {least} (the "
                             f"newest entry needs a slot besides the {self._index_topk} read),"
                             f" got {config.hisparse_buffer}")

    def _hot_buffers(self, config: CacheConfig) -> HotBuffers | None:
        """HiSparse's device buffers: `_hot_sets` buffer sets."""
        n = config.hisparse_buffer
        if n is None:
            return None
        spec = self.layout.pool("c4")
        per_page = spec.entries_per_page(self.layout.page_size)
        return HotBuffers(self._csa_layers, self._hot_sets, n, per_page,
                          spec.entry_shape, getattr(torch, spec.dtype), self.device)

    @classmethod
    def from_hf(cls, hf_model: Any, config: CacheConfig, **kwargs: Any) -> Engine:
        return cls(hf_model, config, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str, config: CacheConfig, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", **kwargs: Any) -> Engine:
        """Load an HF-format checkpoint directory (config.json + safetensors); with
        speculative=SpecConfig("mtp"), also its MTP block (the `mtp.0.*` tensors)."""
        from safetensors import SafetensorError
        from transformers import DeepseekV4ForCausalLM

        try:
            model: Any = DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, SafetensorError) as e:  # a missing, truncated or unreadable file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: cannot load the checkpoint: {_unreadable(path)}"
                             f"{first}") from e
        model = model.to(device)
        spec = kwargs.get("speculative")
        if isinstance(spec, SpecConfig) and spec.method == "mtp" and kwargs.get("mtp") is None:
            block = load_mtp(path, model.config, dtype)
            if block is None:
                raise ValueError(f"{path}: the checkpoint has no MTP block (no mtp.0.* "
                                 f"tensors), which speculative method 'mtp' needs")
            kwargs["mtp"] = block.to(device)
        return cls(model, config, **kwargs)

    # ------------------------------------------------------------ online core
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One caller at a time: a call that overlaps another raises instead of waiting
        (two threads stepping one engine is a bug in the caller, never a queue)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Engine is not thread-safe: another thread is inside it. "
                               "Drive it from one thread (or serialise calls yourself).")
        try:
            if self._closed:
                raise RuntimeError("engine is closed")
            yield
        finally:
            self._busy.release()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    return_logits: bool = False) -> str:
        """Queue a request; returns its id. It runs from the next `step` on. Raises
        ValueError (changing nothing) on bad input or a request that can never fit."""
        with self._exclusive():
            (ids,), (p,) = checked_batch([prompt_ids], params, self.vocab_size)
            _check_return_logits(return_logits)
            return self._add(ids, p, return_logits)

    def _add(self, ids: list[int], p: SamplingParams, return_logits: bool,
             label: str = "prompt") -> str:
        """Queue checked ids (a list this request now owns)."""
        gen = torch.Generator().manual_seed(p.seed) if p.sampling else None
        rid = f"req-{next(self._ids)}"
        req = Request(rid, ids, len(ids), p, gen, return_logits)
        if self.record_topk:
            req.topk = {}
        if req.prompt_len + p.max_new_tokens > self.positions:
            raise ValueError(f"{label}: {req.prompt_len} tokens + max_new_tokens "
                             f"{p.max_new_tokens} pass the model's {self.positions} "
                             f"positions (max_position_embeddings)")
        if not self.scheduler.fits_ever(req):
            need = self.manager.peak_pages(req.max_tokens)  # its chunks cut to fit
            arena = self._prefix.arena
            if arena is None:
                have = {n: pool.num_pages for n, pool in self._prefix.pools.items()}
                room = f"the device pools hold {have}"
            else:
                apart = [f"the {n} pool in host memory ({pool.num_pages} pages)"
                         for n, pool in self._prefix.pools.items() if n not in arena.names]
                room = (f"the device arena ({arena.frames} frames of {arena.plan.frame_bytes} "
                        f"bytes){''.join(' and ' + a for a in apart)} "
                        f"{'hold' if apart else 'holds'} at most {self.max_sequence_len()} "
                        f"tokens of one request")
            raise ValueError(f"{label}: {req.prompt_len} tokens + max_new_tokens "
                             f"{p.max_new_tokens} need up to {need} pages at once; {room}")
        self._requests[rid] = req
        self.scheduler.waiting.append(req)
        return rid

    def step(self) -> list[StepOutput]:
        """Run one scheduler step: admit, grow (preempting under pressure), one forward over
        every scheduled chunk, sample. Returns an output per request that produced a
        token or finished; may return nothing (e.g. while storage reads are in flight).

        A step is a transaction. A fault in one request's own booking (sampling, handing
        its pages to the cache, finishing) fails that request alone: its output has
        `error` set, its pages are freed, the others go on. Any other exception (the
        forward, admission, an interrupt) propagates with every request pending and exact
        on retry; what requests produced before it is returned by the next `step`."""
        with self._exclusive():
            try:
                self._step()
            except BaseException:
                self.scheduler.release_orphans()  # the requests stay; a retry may succeed
                raise
        # Taken once the lock is let go: a fault as it is (its exit runs code) leaves them
        # queued for the next `step`, as after a failed step.
        return self._take_outbox()

    def _take_outbox(self) -> list[StepOutput]:
        """The outbox's outputs, the outbox emptied, in one statement (the list is made,
        then the outbox cleared): an interrupt finds them all queued or all taken."""
        return [*self._outbox, *(self._outbox.clear() or ())]  # type: ignore[func-returns-value]

    def abort(self, request_id: str) -> None:
        """Drop a request at once: its pages and locks are released, copies in flight
        included. An unknown or finished id is ignored."""
        with self._exclusive():
            req = self._requests.pop(request_id, None)
            if req is not None and not req.done:
                self._counters["aborted"] += 1
                try:
                    self.scheduler.abort(req)
                except BaseException:  # what it still held is an orphan now
                    self.scheduler.release_orphans()
                    raise

    def has_unfinished(self) -> bool:
        """Requests queued or running, or outputs the next `step` still has to return."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._outbox)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_logits: bool = False) -> list[Result]:
        """Run prompts to completion; one Result per prompt, in order. Bad input raises
        ValueError before anything is queued; any exception aborts every request of the
        call (nothing leaks) and propagates, and so does the error of a request that
        failed alone."""
        with self._exclusive():
            id_lists, plist = checked_batch(prompts, params, self.vocab_size)
            _check_return_logits(return_logits)
            ids: list[str] = []
            try:
                for i, (prompt, p) in enumerate(zip(id_lists, plist, strict=True)):
                    ids.append(self._add(prompt, p, return_logits, f"prompt {i}"))
                reqs = [self._requests[rid] for rid in ids]
                while not all(r.done for r in reqs):
                    self._step()
                    errors = [r.error for r in reqs if r.error is not None]
                    if errors:  # one failed alone: the call fails with its error
                        raise errors[0]
            except BaseException:
                for rid in ids:
                    req = self._requests.pop(rid, None)
                    if req is not None and not req.done:
                        self.scheduler.abort(req)
                self.scheduler.release_orphans()
                raise
            finally:  # its outputs are its own; those of online requests stay for `step`
                mine = set(ids)
                self._outbox = [o for o in self._outbox if o.request_id not in mine]
            return [r.result for r in reqs]  # type: ignore[misc]

    def _step(self) -> None:
        """One step; what it produced goes to the outbox as it is produced."""
        t_step = time.perf_counter()
        sched = self.scheduler
        if self.speculator.on:
            self.speculator.draft(self.scheduler.running, self._fail)
        sched.admit()
        chunks = sched.plan()
        if chunks and self.host is not None:
            chunks = self._copies_landed(chunks)
            if not chunks:  # the requests a failed copy broke resume next step
                return
        if not chunks:
            if sched.waiting and not sched.running and not sched.preempted:
                if sched.reads_pending():  # storage reads in flight: nothing else can run
                    sched.wait_for_reads(READ_POLL_S)
                    return
                raise RuntimeError("no request can run: the pools are pinned by locks")
            return
        snaps = {c.request: Snapshot.take(c.request, c.end >= len(c.request.ids))
                 for c in chunks}
        spec = self.speculator
        at = -1  # the chunk being booked (-1: none yet): those after it go back on a fault
        try:  # one handler from the forward to the last booking: no line is left out
            t_forward = time.perf_counter()
            if spec.mtp is not None:  # its drafts 2..k, once the pages are there
                for c in chunks:
                    self._page_tables(c.request)
                spec.chain(chunks, self.store)
            segments = [self._segment(c) for c in chunks]
            if spec.mtp is not None:  # the block reads the trunk's last hidden
                logits, hidden = self.runner.forward_hidden(segments, self.store)
            else:
                logits, hidden = self.runner.forward_batch(segments, self.store), []
            self._counters["forward_seconds"] += time.perf_counter() - t_forward
            self._counters["steps"] += 1
            decided = self._decide_all(chunks, logits)
            drafts: dict[Request, Any] = {}
            if spec.mtp is not None:  # the block's KV at every kept position, before caching
                t_forward = time.perf_counter()
                drafts = spec.catch_up(chunks, hidden, decided, self.store)
                self._counters["forward_seconds"] += time.perf_counter() - t_forward
            for i, (c, rows) in enumerate(zip(chunks, logits, strict=True)):
                at = i  # (a fault before this line: the one before is done; it holds)
                if c.request.error is None:  # (else it failed alone as its tokens were chosen)
                    self._book(c, rows, decided.get(c.request), drafts.get(c.request))
        except BaseException:  # an interrupt, a failed forward, or failing one failed
            _put_back(snaps, [c.request for c in chunks[at + 1:]])  # drawn, not taken
            if at >= 0:  # what held of its booking holds; else it goes back to the queue
                self._interrupted(chunks[at].request, snaps[chunks[at].request])
            raise
        self._counters["step_seconds"] += time.perf_counter() - t_step

    def _book(self, c: Chunk, rows: torch.Tensor, decided: tuple[list[int], int] | None,
              draft_state: Any) -> None:
        """Book one chunk (`_advance`); a fault of its own fails it alone. (Apart from the
        step's loop, so that every line of that loop is inside the step's handler.)"""
        try:
            if draft_state is not None:
                c.request.draft_state = draft_state
            self._advance(c, rows, decided)
        except Exception as e:
            self._fail(c.request, e)

    def _interrupted(self, req: Request, snap: Snapshot) -> None:
        """A request whose booking was cut short: what held, holds (it finished, it failed,
        or its token was reported); otherwise it goes back to the queue as it was before
        the step."""
        if req.error is not None:
            return  # failed alone, reported; release_orphans frees what it held
        if req.done or (len(req.ids) > snap.ids and req.reported == len(req.outputs)):
            self._report(req)
        else:
            snap.restore_outputs(req)
            self.scheduler.requeue(req)

    def _segment(self, c: Chunk) -> tuple[torch.Tensor, int, RequestKV]:
        """What the forward feeds for one chunk: its tokens, start and page tables (its
        host copies landed; the compressor state restored at a cache hit)."""
        kv = self._page_tables(c.request)
        req = c.request
        drafts = max(c.end - len(req.ids), 0)
        if isinstance(kv.c4, HotSet):  # decode (and verify) steps go through the hot buffer
            kv.c4.decoding = drafts > 0 or (c.end - c.start == 1 and c.start >= req.prompt_len)
        kv.journal = {} if drafts else None  # its states go back to the accepted row
        if self.record_topk:  # a chunk that ends at an output token ends in a decode query
            ends = c.end >= len(req.ids) and c.end > req.prompt_len
            kv.topk = req.topk if ends else None
        lease = req.lease
        assert lease is not None
        if c.start == lease.cached and c.start:  # first chunk after a cache hit
            self.runner.resume(self.store, kv, c.start // self.config.page_size)
        ids = torch.tensor(req.ids[c.start:c.end] + req.draft[:drafts], device=self.device)
        return ids, c.start, kv

    def _page_tables(self, req: Request) -> RequestKV:
        """The request's page tables for the model, rebuilt when its lease changed."""
        lease, kv = req.lease, req.kv
        assert lease is not None and kv is not None
        if req.kv_version != lease.version:
            table = torch.from_numpy(lease.table.astype(np.int64)).to(self.device)
            kv.page_tables = {name: table[row] for row, name in enumerate(self.layout.pool_names)}
            if isinstance(kv.c4, HotSet):  # its buffers forget entries on pages that moved
                kv.c4.remap(lease.table[self.layout.index("c4")])
            req.kv_version = lease.version  # last: after a fault, the next step does it all
        return kv

    def _decide_all(self, chunks: list[Chunk],
                    logits: list[torch.Tensor]) -> dict[Request, tuple[list[int], int]]:
        """Choose the tokens of every chunk that reached its sequence end (sampling,
        verifying drafts) before anything is booked. A request whose choice raises fails
        alone; an interrupt puts every other request back as it was before the step (the
        caller's handler)."""
        decided = {}
        for c, rows in zip(chunks, logits, strict=True):
            if c.end < len(c.request.ids):
                continue
            try:
                decided[c.request] = self._decide(c, rows)
            except Exception as e:
                self._fail(c.request, e)
        return decided

    def _decide(self, c: Chunk, rows: torch.Tensor) -> tuple[list[int], int]:
        """The tokens a chunk at its sequence end emits (its kept drafts, then the model's
        own token, cut at the first that ends the answer) and how many drafts the model
        agreed with. Changes nothing but the request's generator."""
        req = c.request
        draft = req.draft[:c.end - len(req.ids)]
        last = len(req.ids) - 1 - c.start  # the row after the last token fed
        banned = [self._banned(req, i) for i in range(len(draft) + 1)]
        if draft:
            tokens = verify(rows[last:], draft, req.params, req.generator, banned)
        else:
            tokens = [sample(rows[last], req.params, req.generator, banned[0])]
        return tokens[:self._ending(req, tokens)], len(tokens) - 1

    def _advance(self, c: Chunk, rows: torch.Tensor,
                 decided: tuple[list[int], int] | None) -> None:
        """Book a chunk's forward: put the states back at the accepted row, cache its
        computed pages, take its tokens (`decided`: None for a prefill chunk short of the
        end), finish. The counters move last, once the booking held."""
        req = c.request
        assert req.lease is not None
        if decided is None:
            req.computed = c.end
            self.manager.cache_prefix(req.lease, req.ids, req.computed)
            self._counters["prefill_tokens"] += c.end - c.start
            return
        tokens, agreed = decided
        drafts = c.end - len(req.ids)
        computed = len(req.ids) + len(tokens) - 1  # the positions fed and kept
        if drafts:  # the rejected drafts' rows are forgotten
            rewind_states(req.kv, computed - c.start)  # type: ignore[arg-type]
            self._forget_topk(req, c.end - computed)
            if req.kv is not None and isinstance(req.kv.c4, HotSet):  # their C4 entries too
                req.kv.c4.forget(computed // self._c4_ratio, c.end // self._c4_ratio)
        req.computed = computed
        self.manager.cache_prefix(req.lease, req.ids + tokens, computed)
        if req.keep_logits:  # copies: a view would keep the whole step's logits alive
            last = len(req.ids) - 1 - c.start
            req.logits.extend(row.to("cpu", copy=True) for row in rows[last:last + len(tokens)])
        req.ids.extend(tokens)
        if self._finished(req):
            self.scheduler.finish(req)
            req.done = True
        elif drafts:  # pages grown for drafts the model rejected go back
            self.manager.shrink(req.lease, len(req.ids))
        decode = c.start >= req.prompt_len
        self._counters["decode_tokens" if decode else "prefill_tokens"] += computed - c.start
        if drafts:
            self.speculator.count(drafts, min(agreed, len(tokens)))
        self._report(req)

    def _ending(self, req: Request, tokens: list[int]) -> int:
        """How many of `tokens` the answer takes: up to the first that ends it."""
        have = len(req.outputs)
        for i, token in enumerate(tokens):
            if self._ends(req, token, have + i + 1):
                return i + 1
        return len(tokens)

    def _ends(self, req: Request, token: int, outputs: int) -> bool:
        """Whether `token`, the answer's `outputs`-th, ends it."""
        p = req.params
        stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos)
        return outputs >= p.max_new_tokens or (stop and outputs > p.min_tokens)

    def _finished(self, req: Request) -> bool:
        return self._ends(req, req.ids[-1], len(req.outputs))

    def _forget_topk(self, req: Request, rows: int) -> None:
        """Drop the selections a speculative step recorded for its rejected rows."""
        if rows and req.kv is not None and req.kv.topk is not None:
            for log in req.kv.topk.values():
                del log[len(log) - rows:]

    def _report(self, req: Request) -> None:
        """Put the request's new tokens in the outbox (its result too once it is done).
        Idempotent: an interrupt after a request finished completes its report."""
        if req.reported == len(req.outputs):
            return
        if req.done:
            req.result = req.result or self._result(req)
            self._requests.pop(req.id, None)
        first = req.reported == 0
        out = StepOutput(req.id, req.outputs[req.reported:], req.done, req.result,
                         req.cached_by_tier if first else None,
                         req.admitted_at if first else None)
        # Queued and counted in one statement (an append as a slice store): an interrupt
        # finds the tokens both queued and counted, or neither, never lost or sent twice.
        self._outbox[len(self._outbox):], req.reported = [out], len(req.outputs)

    def _banned(self, req: Request, ahead: int = 0) -> set[int]:
        """Tokens that may not end the answer yet (min_tokens), `ahead` outputs on."""
        if len(req.outputs) + ahead >= req.params.min_tokens:
            return set()
        ends = set(req.params.stop_token_ids)
        return ends if req.params.ignore_eos else ends | self.eos

    def _fail(self, req: Request, error: Exception) -> None:
        """End one request whose own booking raised: report the error and free what it
        holds, whatever state it was left in (the step's other requests are not touched)."""
        out = StepOutput(req.id, [], True, None, error=error)
        # Failed and its error queued in one statement (see `_report`).
        self._outbox[len(self._outbox):], req.done, req.error = [out], True, error
        self._requests.pop(req.id, None)
        self._counters["failed"] += 1
        try:
            self.scheduler.abort(req)
        except Exception:  # its lease is detached: free it as an orphan
            self.scheduler.release_orphans()

    def _copies_landed(self, chunks: list[Chunk]) -> list[Chunk]:
        """Wait for the chunks' host copies. Where copies failed, the pages they should
        have filled left the cache (HostTier.recover); every running request that reads
        one goes back to the queue and resumes from what is valid, the others run."""
        assert self.host is not None
        ticket = self.host.step_ticket(max(c.request.lease.ready for c in chunks
                                           if c.request.lease is not None))
        self._wait_for_copies(ticket)
        lost = self.host.recover(ticket)
        if not lost:
            return chunks
        broken = [r for r in self.scheduler.running
                  if r.lease is not None and _reads_any(r.lease, self.layout.pool_names, lost)]
        for req in broken:
            self.scheduler.requeue(req)
        return [c for c in chunks if c.request not in broken]

    def _wait_for_copies(self, ticket: int) -> None:
        """Its pages are back from the host before the forward reads them. A wait that
        finds the copy still running is a stall: counted, with the CPU seconds it cost
        (on CUDA the wait is on the stream, so the seconds stay near zero)."""
        assert self.host is not None
        mover = self.host.mover
        if mover.done(ticket):
            return
        t0 = time.perf_counter()
        mover.wait(ticket)
        self._counters["copy_stalls"] += 1
        self._counters["copy_stall_seconds"] += time.perf_counter() - t0

    def _result(self, req: Request) -> Result:
        """The finished request's Result; the counters move once it is built (an interrupt
        while building it leaves them, and the request's logs, as they were)."""
        logits = torch.stack(req.logits) if req.keep_logits else None
        result = Result(req.outputs, logits, req.cached, req.cached_by_tier, self._streams(req))
        req.topk = None  # released with the request
        for name, n in (("requests", 1), ("prompt_tokens", req.prompt_len),
                        ("cached_tokens", req.cached), ("host_tokens", req.from_host),
                        ("storage_tokens", req.from_storage)):
            self._counters[name] += n
        return result

    def _streams(self, req: Request) -> dict[int, AccessStream] | None:
        """The request's recorded selections as one AccessStream per CSA layer
        (record_topk)."""
        if req.topk is None:
            return None
        return {layer: AccessStream.from_steps(
            self._index_topk, [(ids.cpu().numpy(), n) for ids, n in req.topk.get(layer, [])])
            for layer in self._csa_layers}

    # ---------------------------------------------------------------- status
    def stats(self) -> dict[str, Any]:
        cache = self._prefix.stats()
        return {
            **self._counters,
            "hits": {"device": self._counters["cached_tokens"] - self._counters["host_tokens"]
                     - self._counters["storage_tokens"],
                     "host": self._counters["host_tokens"],
                     "storage": self._counters["storage_tokens"]},
            "host": {**self.host.counts, "bytes_moved": self.host.mover.bytes_moved}
            if self.host else {},
            "pools": cache["pools"],
            "arena": cache.get("arena"),
            "nodes": cache["nodes"],
            "storage_errors": self.storage.errors if self.storage else 0,
            "storage_bytes": {"read": self.storage.bytes_read if self.storage else 0,
                              "written": self.storage.bytes_written if self.storage else 0},
            "hisparse": self.hot.stats() if self.hot is not None else {
                "enabled": False, "hits": 0, "misses": 0, "bytes_moved": 0},
            "preemptions": self.scheduler.preemptions,
            "copy_deferrals": self.scheduler.deferred,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "spec": self.speculator.stats(),
        }

    def status(self) -> dict[str, Any]:
        """A cheap snapshot for a server's metrics, taken between steps on the engine's
        thread (unlike stats(), no tree walk): queue lengths, pages in use per tier and
        pool, preemptions, storage errors, bytes moved by direction, and HiSparse's
        lookups (None when it is off), speculative decoding's counters, and with
        `device_bytes` the arena's bytes held per pool and free (None without)."""
        pages = {"device": {n: p.used_pages for n, p in self._prefix.pools.items()}}
        if self._prefix.has_host:
            pages["host"] = {n: p.used_pages for n, p in self._prefix.host_pools.items()}
        host = self.host.bytes if self.host is not None else {}
        store = self.storage
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_used": pages,
            "preemptions": self.scheduler.preemptions,
            "storage_errors": store.errors if store is not None else 0,
            "loaded_bytes": {"host": host.get("host->device", 0),
                             "storage": store.bytes_read if store is not None else 0},
            "backup_bytes": {"host": host.get("device->host", 0),
                             "storage": store.bytes_written if store is not None else 0},
            "hisparse": self.hot.totals() if self.hot is not None else None,
            "spec": self.speculator.stats(),
            "arena_bytes": self._prefix.arena_bytes(),
        }

    def arena_info(self) -> dict[str, Any] | None:
        """The device arena's shape (None without `device_bytes`): frame bytes, frames,
        the bytes set apart for HiSparse's hot buffers, pages of each pool per frame."""
        arena = self._prefix.arena
        return arena.info() if arena is not None else None

    def kv_tokens(self) -> int:
        """The cache's capacity in tokens (SGLang's `max_total_num_tokens`): `device_tokens`,
        or for a `device_bytes` budget the tokens whose pages in every pool of the arena its
        frames hold (what `device_tokens` would be for those bytes)."""
        if self.config.device_bytes is None:
            return self.config.device_tokens
        arena = self._prefix.arena
        assert arena is not None  # device_bytes always sizes one
        page = self.layout.page_bytes()
        per_page = sum(page[n] for n in arena.names)
        return arena.frames * arena.plan.frame_bytes // per_page * self.layout.page_size

    def max_sequence_len(self) -> int:
        """The longest prompt + output one request can ever hold: the device pools with
        nothing else cached, and the model's positions."""
        lo, hi = 0, self.positions  # fits(lo) holds; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.manager.fits_ever(mid - 1):  # KV for mid - 1, as add_request checks
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check_integrity(self) -> None:
        """Every page has exactly one owner (the tree, a running request, a free list) in
        both tiers, and the tree's invariants hold. Raises AssertionError naming the count
        that disagrees."""
        with self._exclusive():
            self.manager.check_integrity()

    def close(self) -> None:
        """Stop accepting work, finish the host copies and the storage reads and writes
        in flight, and close the storage backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.host is not None:
            self.host.mover.close()
        if self.storage is not None:
            self.storage.close()


def _put_back(snaps: dict[Request, Snapshot], reqs: Sequence[Request]) -> None:
    """These requests as they were before the step (their states, and the tokens drawn
    for them), but those that failed alone: a retry recomputes and redraws the same."""
    for req in reqs:
        if req.error is None:
            snaps[req].restore_model(req)
            snaps[req].restore_outputs(req)


def _unreadable(path: str) -> str:
    """'NAME: ' of the first safetensors file in `path` whose header does not read, for an
    error message ('' when all read, or the path is not a folder)."""
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(path)
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception:
            return f"{file.name}: "
    return ""


def _mtp_block(spec: SpecConfig | None, mtp: Any, hf_model: Any) -> Any:
    """The MTP block speculative method "mtp" drafts with (None for any other method)."""
    if spec is None or spec.method != "mtp":
        if mtp is not None:
            raise ValueError("mtp: an MTP block is given, but speculative is not "
                             "SpecConfig(method='mtp')")
        return None
    if mtp is None:
        raise ValueError("speculative method 'mtp' needs the model's MTP block, and this "
                         "model has none (no mtp.0.* tensors); a checkpoint directory with "
                         "them loads it (Engine.from_pretrained), or pass mtp=MTPBlock")
    if not isinstance(mtp, MTPBlock) or mtp.layer_idx != hf_model.config.num_hidden_layers:
        raise ValueError(f"mtp must be an MTPBlock built for this model's config, got "
                         f"{type(mtp).__name__}")
    _check_block(mtp, hf_model)
    return mtp


# Settings of a DeepSeek-V4 config that change what an MTP block computes without changing
# its tensors' shapes.
_BLOCK_SETTINGS = ("sliding_window", "layer_types", "compress_rates", "rope_theta",
                   "compress_rope_theta", "rope_parameters", "partial_rotary_factor",
                   "rms_norm_eps", "hc_eps", "hc_sinkhorn_iters", "num_experts_per_tok",
                   "routed_scaling_factor", "scoring_func", "norm_topk_prob", "swiglu_limit",
                   "index_topk", "hidden_act")


def _check_block(mtp: MTPBlock, hf_model: Any) -> None:
    """ValueError unless the block's tensors have the shapes a block built for this
    model's config has (another hidden size, hc_mult or head_dim would fail deep inside
    the first step), its config the settings that model's block has (another window
    would read KV the window pool does not keep), and every parameter the dtype
    `cast_block` gives it in a model of the trunk's embedding's dtype, on its device."""
    with torch.device("meta"):  # shapes only: no memory, no random numbers drawn
        want = {k: tuple(v.shape) for k, v in MTPBlock(hf_model.config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in mtp.state_dict().items()}
    if got != want:
        name = next((k for k in want if got.get(k) != want[k]), None) or next(iter(got))
        raise ValueError(f"mtp: the MTP block was not built for this model's config: "
                         f"{name} is {got.get(name)}, this model's block has {want.get(name)}")
    ours = mtp_config(hf_model.config)
    for key in _BLOCK_SETTINGS:  # what the block computes with, beside its tensors' shapes
        a, b = getattr(mtp.config, key, None), getattr(ours, key, None)
        if a != b:
            raise ValueError(f"mtp: the MTP block was not built for this model's config: its "
                             f"{key} is {a!r}, this model's {b!r} (the drafter would read KV "
                             f"the pools do not keep, or compute other drafts)")
    embed = hf_model.get_input_embeddings().weight
    for name, param in mtp.named_parameters():
        # A part transformers keeps in float32 may be in the model's dtype too, as after
        # `model.to(dtype)`, which casts the trunk's own alike.
        dtype = part_dtype(name, embed.dtype)
        if param.dtype not in (dtype, embed.dtype) or param.device != embed.device:
            raise ValueError(f"mtp: the MTP block's {name} is {param.dtype} on {param.device}, "
                             f"this model's block has it {dtype} on {embed.device}: cast and "
                             f"move the block as the model (model.mtp.cast_block, .to(device))")


def _reads_any(lease: Lease, names: Sequence[str], pages: dict[str, np.ndarray]) -> bool:
    """Whether a lease reads any of these pages from the tree (not its own)."""
    return any(name in pages and np.isin(lease.table[row][~lease.own[row]], pages[name]).any()
               for row, name in enumerate(names))


def _check_return_logits(value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"return_logits must be a bool, got {value!r}")
