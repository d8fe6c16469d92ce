"""Defects an adversarial review found in "a step is a transaction" (README) and the
sampling options, each a test named for the defect it showed (all fixed); small configs."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
from test_engine import rand_tokens
from test_step_transaction import Injected, Interrupt, fault
from tiny_model import reference_logits, tiny_model

import shadowradix.tiers.mover as mover_module
from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.sparse.access import AccessStream
from shadowradix.sparse.hot_buffer import HotBuffers
from shadowradix.tiers.manager import CacheManager
from shadowradix.tiers.storage_tier import StorageTier
from shadowradix.tree.radix import ShadowRadix

MODEL = tiny_model()
TOL = 1e-4
P = SamplingParams(max_new_tokens=6, ignore_eos=True)


def drain(eng: Engine, seen: dict, limit: int = 300) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        for o in eng.step():
            t = seen.setdefault(o.request_id, {"stream": [], "fin": 0, "res": None, "err": None})
            assert not t["fin"], f"{o.request_id} reported after it finished"
            t["stream"] += o.new_token_ids
            if o.finished:
                t["fin"] += 1
                t["res"], t["err"] = o.result, o.error
    raise AssertionError("the engine never drained: has_unfinished() stays True")


def exact(prompt: list[int], t: dict, n: int) -> None:
    assert t["fin"] == 1 and t["err"] is None, t
    r = t["res"]
    assert r.output_ids == t["stream"] and len(r.output_ids) == n
    ref = reference_logits(MODEL, prompt + r.output_ids)[len(prompt) - 1:len(prompt) - 1 + n]
    assert (ref - r.logits).abs().max().item() <= TOL
    assert r.output_ids == ref.argmax(-1).tolist()


def no_leaks(eng: Engine) -> None:
    eng.check_integrity()
    assert not eng.manager.leases
    assert not eng._requests


# ---------------------------------------------------------------- preempt
def test_fault_inside_preempt_leaves_request_running_on_a_released_lease():
    """A fault inside CacheManager.preempt (here: the tree insert it does) releases the
    lease in finish's `finally`, but Scheduler.preempt never drops the request: it stays
    in `running` holding a dead lease whose pages went back to the free list. The retry
    runs it on those freed pages (grow on a dead lease, cache_prefix/finish of a
    released lease)."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=64, debug_poison=True),
                 step_tokens=24)
    prompts = [rand_tokens(40, 100 + i) for i in range(3)]
    n = 24
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True),
                           return_logits=True)
           for p in prompts]
    inside = [False]
    fired = [0]
    orig_preempt, orig_insert = CacheManager.preempt, ShadowRadix.insert

    def preempt(self, *a, **k):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return orig_preempt(self, *a, **k)
        finally:
            inside[0] = False

    def insert(self, *a, **k):  # type: ignore[no-untyped-def]
        if inside[0] and not fired[0]:
            fired[0] += 1
            raise Injected("insert during preempt")
        return orig_insert(self, *a, **k)

    seen: dict = {}
    CacheManager.preempt, ShadowRadix.insert = preempt, insert
    try:
        for _ in range(200):
            if fired[0] or not eng.has_unfinished():
                break
            with contextlib.suppress(Injected):
                drain_once(eng, seen)
    finally:
        CacheManager.preempt, ShadowRadix.insert = orig_preempt, orig_insert
    assert fired[0], "no preemption happened: make the device smaller"
    for r in eng.scheduler.running:  # the promise: no running request on a released lease
        assert r.lease is not None and r.lease.live, f"{r.id} runs on a released lease"
    drain(eng, seen)
    no_leaks(eng)
    for rid, p in zip(ids, prompts, strict=True):
        exact(p, seen[rid], n)


def drain_once(eng: Engine, seen: dict) -> None:
    for o in eng.step():
        t = seen.setdefault(o.request_id, {"stream": [], "fin": 0, "res": None, "err": None})
        assert not t["fin"]
        t["stream"] += o.new_token_ids
        if o.finished:
            t["fin"] += 1
            t["res"], t["err"] = o.result, o.error


# ---------------------------------------------------------- hot buffers
def test_interrupt_in_hot_buffer_acquire_loses_the_request():
    """Scheduler.admit deletes the request from `waiting` before `_start` acquires its
    hot buffers; an interrupt there leaves it in neither queue: never finished, never
    pending, kept in engine._requests forever (its lease is released as an orphan)."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=512, hisparse_buffer=5))
    p = rand_tokens(30, 3)
    rid = eng.add_request(p, P, return_logits=True)
    with fault(HotBuffers, "acquire", 1, Interrupt), contextlib.suppress(Interrupt):
        eng.step()
    seen: dict = {}
    assert rid in eng._requests
    assert eng.has_unfinished(), "the request is neither finished nor pending"
    drain(eng, seen)
    exact(p, seen[rid], P.max_new_tokens)
    no_leaks(eng)


# ---------------------------------------------------------------- result
def test_interrupt_in_result_drops_topk_and_double_counts():
    """_result bumps the counters and _streams detaches req.topk before building the
    streams; an interrupt inside (AccessStream.from_steps) is completed by re-running
    _report -> _result: `requests`/`prompt_tokens` are counted twice and Result.topk is
    None although record_topk=True."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=512), record_topk=True)
    p = rand_tokens(30, 4)
    rid = eng.add_request(p, P)
    seen: dict = {}
    with fault(AccessStream, "from_steps", 1, Interrupt) as calls:
        while not calls[0]:
            with contextlib.suppress(Interrupt):
                drain_once(eng, seen)
    drain(eng, seen)
    t = seen[rid]
    assert t["fin"] == 1 and t["err"] is None
    assert t["res"].topk is not None, "record_topk=True, yet the result has no streams"
    assert eng.stats()["requests"] == 1
    assert eng.stats()["prompt_tokens"] == len(p)


# ------------------------------------------------------------- host copies
def test_one_failed_host_copy_wedges_the_engine_forever():
    """A page copy that raises once in the mover's worker thread (a transient fault in
    tiers/mover.py copy_pages) is stored in ThreadMover._error and never cleared: every
    later submit/wait raises, so every later request fails (or every step raises) for
    the engine's life, though the README promises a retry goes on exact. Also the tree
    already recorded the host copy (HostTier.backup fills HOST at submit time) although
    its bytes never arrived."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=512, host_tokens=1024,
                                    write_policy="write_through", debug_poison=True))
    original = mover_module.copy_pages
    calls = [0]

    def flaky(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise Injected("transient copy fault")
        return original(*a, **k)

    seen: dict = {}
    a = rand_tokens(40, 5)
    mover_module.copy_pages = flaky
    try:
        eng.add_request(a, P)
        for _ in range(50):
            if not eng.has_unfinished():
                break
            with contextlib.suppress(Exception):
                drain_once(eng, seen)
    finally:
        mover_module.copy_pages = original
    assert calls[0] >= 1
    b = rand_tokens(40, 6)  # a fresh request, well after the fault
    rid = eng.add_request(b, P, return_logits=True)
    errors = []
    for _ in range(50):
        if not eng.has_unfinished():
            break
        try:
            drain_once(eng, seen)
        except Exception as e:
            errors.append(e)
    assert not errors, f"every step raises after one copy fault: {errors[0]!r}"
    assert seen[rid]["err"] is None, f"a later request failed: {seen[rid]['err']!r}"
    exact(b, seen[rid], P.max_new_tokens)
    eng.close()


# ----------------------------------------------------------------- storage
@pytest.mark.parametrize("kind", [Injected, Interrupt])
def test_failed_storage_prefetch_future_is_reused_forever(kind):
    """Scheduler._prefetched keeps the request's storage-read Future; when that read raised
    once (StorageTier.fetch on the storage thread), `req.prefetch.result()` re-raises it at
    every admission: the request at the head of the queue never gets admitted and blocks
    every request behind it."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CacheConfig(page_size=16, device_tokens=512, storage=f"file://{tmp}",
                          debug_poison=True)
        eng = Engine(MODEL, cfg)
        a = rand_tokens(64, 7)
        eng.generate([a], P)
        eng.storage.drain()
        eng.cache.flush(tiers=("device",))
        prompt = a + rand_tokens(20, 8)
        seen: dict = {}
        with fault(StorageTier, "fetch", 1, kind) as calls:  # on the storage thread
            rid = eng.add_request(prompt, P, return_logits=True)
            with contextlib.suppress(Injected, Interrupt):
                drain_once(eng, seen)
        assert calls[0] == 1  # disarmed from here on
        try:
            drain(eng, seen, limit=20)
        except (Injected, Interrupt) as e:
            raise AssertionError(f"the read that failed once re-raises forever: {e!r}") from e
        exact(prompt, seen[rid], P.max_new_tokens)
        no_leaks(eng)
        eng.close()


# ----------------------------------------------------------- double faults
def test_fault_while_failing_a_request_leaves_later_requests_with_advanced_state():
    """Request A's sampling raises (it fails alone); while `_fail` frees its pages, the
    free raises too (two faults in a row). The exception escapes `_fail` from inside the
    `except Exception` handler of `_step`'s booking loop, so the requests booked after A
    are neither booked nor `restore_model`-ed: their compressor states stay advanced by the
    forward while `computed` did not move, and the retry feeds the same chunk again."""
    import shadowradix.engine.engine as engine_module
    from shadowradix.tiers.prefix_cache import PrefixCache

    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=1024, debug_poison=True),
                 step_tokens=40)
    prompts = [rand_tokens(n, 300 + n) for n in (9, 13, 11)]
    ids = [eng.add_request(p, P, return_logits=True) for p in prompts]
    seen: dict = {}
    drain_once(eng, seen)  # everyone prefilled: decoding, all three in every step
    drain_once(eng, seen)
    original_fail, original_free = Engine._fail, PrefixCache.free
    inside = [False]

    def fail(self, req, error):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return original_fail(self, req, error)
        finally:
            inside[0] = False

    def free(self, *a, **k):  # type: ignore[no-untyped-def]
        if inside[0]:
            raise Injected("free while failing")
        return original_free(self, *a, **k)

    Engine._fail, PrefixCache.free = fail, free
    try:
        with fault(engine_module, "sample", 1, Injected), contextlib.suppress(Injected):
            drain_once(eng, seen)
    finally:
        Engine._fail, PrefixCache.free = original_fail, original_free
    drain(eng, seen)
    no_leaks(eng)
    for rid, p in zip(ids, prompts, strict=True):
        if seen[rid]["err"] is None:
            exact(p, seen[rid], P.max_new_tokens)


def test_debug_poison_fault_after_alloc_leaks_the_pages():
    """CacheManager._alloc allocates, then poisons (debug_poison=True), which waits for
    host copies (mover.wait raises once a copy failed). A fault there happens after the
    pages left the free list but before the lease records them: admit's `abort(lease)`
    cannot free them (lease.own is still all False), so they are owned by no one."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=512, debug_poison=True))
    p = rand_tokens(30, 9)
    rid = eng.add_request(p, P, return_logits=True)
    with fault(CacheManager, "_poison", 1, Injected), contextlib.suppress(Injected):
        eng.step()
    eng.check_integrity()  # every page has exactly one owner
    seen: dict = {}
    drain(eng, seen)
    exact(p, seen[rid], P.max_new_tokens)
    no_leaks(eng)


def test_fault_inside_abort_leaks_the_lease_for_good():
    """Engine.abort pops the request, then Scheduler.abort -> CacheManager.abort; when
    the free inside raises, nothing calls release_orphans (unlike step/generate): the
    half-released lease stays registered, holding its pages and lock, after every
    request has drained."""
    from shadowradix.tiers.prefix_cache import PrefixCache

    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=1024, debug_poison=True))
    a, b = rand_tokens(30, 10), rand_tokens(20, 11)
    ra, rb = eng.add_request(a, P), eng.add_request(b, P, return_logits=True)
    seen: dict = {}
    drain_once(eng, seen)
    with fault(PrefixCache, "free", 1, Injected), contextlib.suppress(Injected):
        eng.abort(ra)
    drain(eng, seen)
    exact(b, seen[rb], P.max_new_tokens)
    no_leaks(eng)


# ----------------------------------------------------------------- sampling
def test_min_tokens_ignored_when_stop_tokens_and_eos_cover_the_vocabulary():
    """README: with min_tokens the EOS and stop tokens "are never chosen before that many
    outputs". When stop_token_ids plus EOS cover the whole vocabulary, sample() lifts the
    ban (it would leave no token) and _advance then ends the answer on the first output:
    1 output although min_tokens == max_new_tokens == 6 (expected: 6 outputs, or a
    ValueError at add_request)."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=1024))
    eos = 1  # the tiny model's eos_token_id
    sp = SamplingParams(max_new_tokens=6, min_tokens=6,
                        stop_token_ids=tuple(t for t in range(256) if t != eos))
    try:
        out = eng.generate([rand_tokens(20, 1)], sp)[0].output_ids
    except ValueError:
        return  # refusing the request is an acceptable answer too
    assert len(out) >= sp.min_tokens, out
