"""Attack on an arena's compaction (PrefixCache.compact, ArenaPool.sparse / move,
tree/relocate.py PageOwners, PrefixCache.copy_pages).

    faults      an exception injected at every call compaction makes (sparse, movable,
                move, copy_pages, relocate): afterwards every page has one owner, no page
                the tree holds is free, and every page still holds its tokens' data
    engine      the same fault in the engine's tensor copy; tight arenas with many
                requests at once, shared prefixes, preemption, speculative decoding,
                HiSparse and sampling, all exact over moved pages, nothing leaked
    heuristics  compaction frees a frame whenever one can go back without touching a lock
                (the emptiest frame holding a running request's page, a stale "nothing
                moves here" memo after an unlock) and moves nothing when moving cannot
                lower what is short
    simulator   metadata-only replays over an arena, the tree checked after every request,
                no worse than the same replay without compaction
    machine     a hypothesis state machine: insert / match / lock / unlock / evict /
                compact on a few frames, a content model moving with the pages
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
from helpers import assert_sound, fail_at, needed_pages, page_key
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_arena import ContentCache, tiny_layout
from test_arena_attack import Oracle, frame_bytes
from test_arena_compaction import (
    _write,
    admit_growing,
    next_turn,
    running_pages_hold,
    tree_content_holds,
)
from test_engine import check, rand_tokens
from test_engine_arena import engine as arena_engine_pages
from test_tree_machine import PS, steps
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.layout.presets import deepseek_v4_flash
from shadowradix.pool.arena import Arena, ArenaPool, plan_frames
from shadowradix.sim.replay import replay
from shadowradix.sim.simulate import make_cache, policy_choice
from shadowradix.sim.synth import ChatShape, Lengths, synth_trace
from shadowradix.tiers import PrefixCache, prefix_cache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.relocate import PageOwners
from shadowradix.tree.tier import DEVICE

EPS = 16  # the engine's page size


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model()


# ------------------------------------------------------------------ manager workload

def content_cache(frames: int, window: int = 5, every: int = 2) -> ContentCache:
    layout = tiny_layout(PS, window=window)
    arena = Arena(layout, frames * plan_frames(layout).frame_bytes)
    cache = ContentCache(layout, {}, CheckpointPolicy(every_pages=every), arena=arena)
    cache.content = [{} for _ in layout.pools]
    return cache


def conversations(manager: CacheManager, cache: ContentCache, seed: int, steps_: int = 120,
                  running: int = 0) -> int:
    """Conversations of random lengths through `manager`, pages written as a model would;
    up to `running` requests stay admitted (holding their locks) for a while, so compaction
    runs around them. An Injected fault aborts whatever was in progress (as the engine's
    failed step does) and the run goes on. The cache is checked after every request;
    returns the faults seen."""
    rng = np.random.default_rng(seed)
    chats: list[np.ndarray] = []
    held: list[tuple[object, np.ndarray]] = []
    faults = 0
    for _step in range(steps_):
        i, tokens = next_turn(rng, chats, 0.55)
        try:
            if held and (len(held) >= running or rng.random() < 0.3):
                lease, toks = held.pop(0)
                manager.finish(lease, toks, toks.size)
            lease = admit_growing(manager, tokens)
            if lease is not None:
                _write(cache, lease, tokens)
                if len(held) < running:
                    held.append((lease, tokens))
                else:
                    manager.finish(lease, tokens, tokens.size)
                chats[i] = tokens
        except Injected:
            faults += 1
            for lease in list(manager.leases):
                manager.abort(lease)
            held.clear()
        manager.check_integrity()
        tree_content_holds(cache)
        for lease, toks in held:  # a running request's pages never move nor change
            running_pages_hold(cache, lease, toks)
    for lease, toks in held:
        manager.finish(lease, toks, toks.size)
    manager.check_integrity()
    tree_content_holds(cache)
    return faults


def test_compaction_around_running_requests_keeps_every_page_and_every_count() -> None:
    """Regression: requests held across admissions while compaction moves the tree's pages
    around them; their pages never move, the books balance, every page frees in the end."""
    moved = 0
    for seed in range(5):
        cache = content_cache(26)
        manager = CacheManager(cache)
        conversations(manager, cache, seed, running=3)
        moved += sum(cache.moved.values())
        cache.flush()
        manager.check_integrity()
        for name, pool in cache.pools.items():
            assert pool.used_pages == 0, f"{name}: {pool.used_pages} pages leaked"
        assert cache.arena.free_frames == cache.arena.frames
    assert moved > 0, "compaction never ran: the test tests nothing"


# Every call compaction makes after it chose what to move.
COMPACT_POINTS = [(ArenaPool, "sparse"), (PageOwners, "movable"), (ArenaPool, "claim"),
                  (ContentCache, "copy_pages"), (PageOwners, "relocate")]


@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("owner, name", COMPACT_POINTS,
                         ids=[f"{o.__name__}.{n}" for o, n in COMPACT_POINTS])
def test_a_fault_at_any_point_of_a_compaction_leaves_the_cache_consistent(
        monkeypatch, owner, name, nth) -> None:
    """A fault inside compaction (an allocation failing in the device copy, say) must
    leave the cache as consistent as a fault anywhere else in an allocation does: every
    page the tree holds in use and holding its data, no page with two owners, none
    leaked. ArenaPool.move frees the old pages (and books the new) before copy_pages and
    relocate run, so a fault in either leaves the tree naming freed pages."""
    cache = content_cache(24)
    manager = CacheManager(cache)
    calls = fail_at(monkeypatch, owner, name, nth, Injected)
    faults = conversations(manager, cache, 0)
    monkeypatch.undo()
    assert calls[0] >= nth and faults >= 1, "the fault point was not reached"


# ------------------------------------------------------------------ heuristics

HPS = 8
HLAYOUT = KVLayout("compact", (PoolSpec("kv", 1, Retention.ALL, (2,), "float32", 1),
                               PoolSpec("c4", 4, Retention.ALL, (2,), "float32", 1)), HPS)


def frames_of(keep: list[int], spare_frames: int = 0,
              make: Callable[[Arena], PrefixCache] | None = None,
              ) -> tuple[PrefixCache, list[np.ndarray]]:
    """A cache whose pool c4 (4 pages a frame) holds `keep[f]` cached one-page sequences in
    its f-th frame (pool kv: a frame a page), and `spare_frames` free frames besides; a
    request holds the rest of the arena (`cache.held`). `make(arena)` builds the cache (a
    PrefixCache by default); one with `content` (test_arena.ContentCache) gets each cached
    page's key."""
    plan = plan_frames(HLAYOUT)
    k = plan.per_frame["c4"]
    assert (plan.per_frame["kv"], k) == (1, 4)
    n = len(keep) * k
    arena = Arena(HLAYOUT, (n + len(keep)) * plan.frame_bytes)
    cache = make(arena) if make else PrefixCache(HLAYOUT, {}, arena=arena)
    content = getattr(cache, "content", None)
    got = cache.alloc({"kv": n, "c4": n})
    assert got is not None
    seqs, drop = [], {"kv": [], "c4": []}
    for i in range(n):
        tokens = np.full(HPS, i + 1, np.int32)
        kv, c4 = int(got["kv"][i]), int(got["c4"][i])
        if i % k < keep[i // k]:
            if content is not None:
                content[0][kv] = page_key(tokens, 0, 0, HPS)
                content[1][c4] = page_key(tokens, 0, 1, HPS)
            cache.insert(tokens, np.array([[kv], [c4]], np.int32))
            seqs.append(tokens)
        else:
            drop["kv"].append(kv)
            drop["c4"].append(c4)
    cache.free({name: np.asarray(v, np.int32) for name, v in drop.items()})
    c4 = cache.pools["c4"]
    assert c4.frames_held == len(keep) and c4.used_pages == sum(keep)
    cache.held = cache.alloc({"kv": cache.arena.free_frames - spare_frames})  # type: ignore[attr-defined]
    assert cache.arena.free_frames == spare_frames
    return cache, seqs


def lock_seq(cache: PrefixCache, tokens: np.ndarray):
    m = cache.match(np.append(tokens, 0))
    assert m.prefix_len == HPS
    return cache.lock(m)


def test_compaction_frees_a_frame_when_only_the_emptiest_one_is_locked() -> None:
    """c4 frames hold 1 (a running request's prefix), 3 and 2 pages: the frame of 2 fits in
    the 4 free slots of the other two, so a frame can go back without touching the lock.
    `sparse` only offers the emptiest frame(s), the lock vetoes it, and compaction gives
    up with 6 free slots (more than a frame) in the pool."""
    cache, seqs = frames_of([1, 3, 2])
    lock_seq(cache, seqs[0])
    assert cache.compact(1) == 1
    cache.check_integrity()


def test_a_running_request_on_the_emptiest_frame_costs_no_cached_prefix() -> None:
    """The same cache with the arena full: a request's next page needs a frame. Moving two
    c4 pages would give one back; instead a cached prefix is evicted (a lost hit)."""
    cache, seqs = frames_of([1, 3, 2])
    lock_seq(cache, seqs[0])
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.evicted.values()) == 0, f"evicted {cache.evicted} moved {cache.moved}"
    for tokens in seqs:
        assert cache.match(np.append(tokens, 0), record=False).prefix_len == HPS


def test_an_unlock_lets_compaction_move_what_it_could_not_before() -> None:
    """A compaction that found every candidate locked remembers the pool's free slots and
    skips the pool until they grow. An unlock makes pages movable without changing the
    free slots, so the pool stays skipped: the frame of one page never goes back."""
    cache, seqs = frames_of([1, 3, 2])
    handles = [lock_seq(cache, t) for t in seqs]
    assert cache.compact(1) == 0  # everything locked: nothing may move
    for h in handles:
        cache.unlock(h)
    assert cache.compact(1) == 1, "the memo of a locked pool outlived its locks"
    cache.check_integrity()


def test_compaction_moves_nothing_when_moving_cannot_lower_the_shortage() -> None:
    """Only c4 wants pages, more than its free slots: a frame compaction gives back from
    c4 costs c4 a frame's worth of those slots, so what is short stays the same. The
    `continue` in `_make_frames` takes any returned frame as progress: pages are copied
    for nothing and the same eviction follows."""
    results = {}
    for on in (True, False):
        cache, _ = frames_of([1, 3, 2])
        if not on:
            cache.compact = lambda frames, need=None, busy=(), least=1: 0  # type: ignore[method-assign]
        short = cache.arena.frames_short(cache._arena_pools, {"c4": 7})
        assert short == 1
        assert cache.alloc({"c4": 7}) is not None
        results[on] = (dict(cache.evicted), dict(cache.moved))
    assert results[True][0] == results[False][0]  # the same eviction either way
    assert sum(results[True][1].values()) == 0, f"moved {results[True][1]} for nothing"


def test_compaction_with_nothing_locked_frees_a_frame_and_keeps_every_prefix() -> None:
    """Regression: the plain case."""
    cache, seqs = frames_of([1, 3, 2])
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.evicted.values()) == 0 and sum(cache.moved.values()) == 1
    for tokens in seqs:
        assert cache.match(np.append(tokens, 0), record=False).prefix_len == HPS
    cache.check_integrity()


def test_compaction_waits_for_holes_to_gather_then_gives_back_them_all(monkeypatch) -> None:
    """With `least` frames to wait for (1/COMPACT_SHARE of the arena), one frame of holes
    is left alone (the allocation evicts instead), and once the holes make `least` frames
    one compaction gives back all of them."""
    monkeypatch.setattr(prefix_cache, "COMPACT_SHARE", 10)  # 20 frames: least 2
    cache, _ = frames_of([1, 3, 2, 4])  # 6 free slots: 1 frame of holes
    assert cache.arena.frames // cache.compact_share == 2
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.moved.values()) == 0 and sum(cache.evicted.values()) > 0
    cache.check_integrity()

    cache, seqs = frames_of([1, 1, 2, 4])  # 8 free slots: 2 frames of holes
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.evicted.values()) == 0
    assert cache.moved["c4"] == 2 and cache.arena.free_frames == 1  # 2 back, 1 taken
    for tokens in seqs:
        assert cache.match(np.append(tokens, 0), record=False).prefix_len == HPS
    cache.check_integrity()


def test_below_the_threshold_compaction_is_the_last_resort(monkeypatch) -> None:
    """Where eviction frees nothing (what the walks cannot reach), the holes it waited on
    are compacted before the allocation gives up."""
    monkeypatch.setattr(prefix_cache, "COMPACT_SHARE", 10)
    cache, seqs = frames_of([1, 3, 2, 4])

    def empty(*a, **k):
        return cache.tree.result_of([[[] for _ in cache.layout.pools]])

    monkeypatch.setattr(cache.tree, "evict_bytes", empty)
    monkeypatch.setattr(cache.tree, "evict", empty)
    assert cache.alloc({"kv": 1}) is not None
    assert sum(cache.evicted.values()) == 0 and cache.moved["c4"] >= 1
    for tokens in seqs:
        assert cache.match(np.append(tokens, 0), record=False).prefix_len == HPS
    cache.check_integrity()


# ------------------------------------------------------------------ engine

def fault_engine(model, pages: int = 24, step: int = 64) -> Engine:
    return arena_engine_pages(model, pages, step_tokens=step, debug_poison=True)


def chat_turns(model, eng: Engine, turns: int, n: int = 10, seed: int = 400,
               group: int = 1, fault: type[BaseException] | None = None) -> int:
    """Conversations of uneven lengths, `group` at a time, each output checked against
    transformers; a `fault` raised by a generate skips that group. Returns cached tokens."""
    chats = [rand_tokens(17 + 13 * (i % 5), seed + i) for i in range(n)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    cached = 0
    for turn in range(turns):
        for j in range(0, n, group):
            ids = list(range(j, min(n, j + group)))
            try:
                res = eng.generate([chats[i] for i in ids], params, return_logits=True)
            except BaseException as e:
                if fault is None or not isinstance(e, fault):
                    raise
                continue
            for i, r in zip(ids, res, strict=True):
                check(model, chats[i], r, greedy=True)
                cached += r.cached_tokens
                chats[i] = chats[i] + r.output_ids + rand_tokens(
                    5 + 7 * ((i + turn) % 3), seed + 100 + 20 * turn + i)
        eng.check_integrity()
    return cached


def assert_all_free_after_flush(eng: Engine) -> None:
    eng.cache.flush()
    eng.check_integrity()
    for name, pool in eng._prefix.pools.items():
        assert pool.used_pages == 0, f"{name}: {pool.used_pages} pages leaked"
        assert pool.free_pages == pool.num_pages
    arena = eng._prefix.arena
    assert arena.free_frames == arena.frames


@pytest.mark.parametrize("nth", [1, 2])
def test_a_fault_in_the_engines_page_copy_leaves_the_engine_consistent(model, monkeypatch, nth):
    """PrefixCache.copy_pages (a device index copy: it allocates, it can fail) raising
    mid-compaction: the generate may fail with that error, but the engine must stay
    consistent and exact. Instead the pool already freed the old pages: the tree names
    free pages, the step's clean-up double-frees, later hits read other requests' bytes."""
    eng = fault_engine(model, 20)
    calls = fail_at(monkeypatch, PrefixCache, "copy_pages", nth, MemoryError)
    with contextlib.suppress(MemoryError):
        chat_turns(model, eng, 2, fault=MemoryError)
    monkeypatch.undo()
    assert calls[0] >= nth, "compaction never copied: the case tests nothing"
    eng.check_integrity()
    chat_turns(model, eng, 1, seed=400)
    assert_all_free_after_flush(eng)


@pytest.mark.parametrize("pages, step, group", [(20, 64, 2), (18, 64, 3), (24, 16, 4)])
def test_concurrent_conversations_over_moved_pages_stay_exact(model, pages, step, group):
    """Regression: several requests at once in a tight arena, compaction moving cached
    pages between their steps; every hit on a moved page is exact, nothing leaks."""
    eng = fault_engine(model, pages, step)
    cached = chat_turns(model, eng, 3, group=group)
    assert cached > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    assert_all_free_after_flush(eng)


def test_shared_prefix_with_preemption_over_moved_pages_stays_exact(model):
    """Regression: one system prompt, many requests at once, preemptions; compaction
    moves pages around the shared locked prefix."""
    eng = Engine.from_hf(model, CacheConfig(page_size=EPS, device_bytes=10 * frame_bytes(model),
                                            debug_poison=True), step_tokens=16)
    system = rand_tokens(37, 7000)
    chats = [system + rand_tokens(3 + 11 * (i % 4), 7001 + i) for i in range(8)]
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    for turn in range(3):
        res = eng.generate(chats, params, return_logits=True)
        for i, (p, r) in enumerate(zip(chats, res, strict=True)):
            check(model, p, r, greedy=True)
            chats[i] = p + r.output_ids + rand_tokens(4 + 5 * ((i + turn) % 3),
                                                      7100 + 10 * turn + i)
        eng.check_integrity()
        for j in range(0, 8, 2):  # and a couple at a time, where compaction fires more
            pair = chats[j:j + 2]
            for p, r in zip(pair, eng.generate(pair, params, return_logits=True), strict=True):
                check(model, p, r, greedy=True)
    assert eng.stats()["preemptions"] > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    assert_all_free_after_flush(eng)


def test_sampling_over_moved_pages_matches_an_unbounded_engine(model):
    prompts = [rand_tokens(17 + 13 * (i % 5), 8000 + i) for i in range(8)]
    params = [SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3 + i,
                             ignore_eos=True) for i in range(8)]
    big = Engine.from_hf(model, CacheConfig(page_size=EPS, device_tokens=8192))
    eng = fault_engine(model, 20, 64)
    for turn in range(3):
        want = big.generate(prompts, params)
        got = []
        for j in range(0, 8, 2):
            got += eng.generate(prompts[j:j + 2], params[j:j + 2], return_logits=True)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        for p, r in zip(prompts, got, strict=True):
            check(model, p, r)
        prompts = [p + r.output_ids + rand_tokens(5 + 3 * (i % 3), 8100 + 10 * turn + i)
                   for i, (p, r) in enumerate(zip(prompts, got, strict=True))]
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    assert_all_free_after_flush(eng)


def test_speculative_decoding_over_moved_pages_stays_exact(model):
    """Regression: drafts grow pages and rejected ones shrink back while compaction moves
    the tree's pages; the oracle's drafts are accepted, every output exact."""
    prompts = [rand_tokens(17 + 13 * (i % 5), 8200 + i) for i in range(6)]
    spec = SpecConfig(method="custom", num_draft_tokens=4, proposer=Oracle(model, prompts, 6))
    pb = sum(Engine.from_hf(model, CacheConfig(page_size=EPS, device_tokens=EPS))
             .layout.page_bytes().values())
    eng = Engine.from_hf(model, CacheConfig(page_size=EPS, device_bytes=20 * pb,
                                            debug_poison=True),
                         step_tokens=64, speculative=spec)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for _ in range(2):
        for j in range(0, 6, 2):
            pair = prompts[j:j + 2]
            for p, r in zip(pair, eng.generate(pair, params, return_logits=True), strict=True):
                check(model, p, r, greedy=True)
    fillers = [rand_tokens(20 + 9 * i, 8300 + i) for i in range(6)]
    for j in range(0, 6, 2):
        eng.generate(fillers[j:j + 2], params)
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    assert eng.stats()["spec"]["accepted_tokens"] > 0
    assert_all_free_after_flush(eng)


def test_hisparse_over_moved_pages_stays_exact(model):
    """Regression: HiSparse keeps C4 in host memory (out of the arena) and its hot buffers
    key entries by C4 address; compaction moves only the arena's pools."""
    fb = frame_bytes(model)
    probe = Engine.from_hf(model, CacheConfig(page_size=EPS, device_bytes=100 * fb,
                                              hisparse_buffer=9, hisparse_requests=2))
    reserved = probe.arena_info()["reserved_bytes"]
    eng = Engine.from_hf(model, CacheConfig(page_size=EPS, device_bytes=reserved + 20 * fb,
                                            hisparse_buffer=9, hisparse_requests=2,
                                            debug_poison=True), step_tokens=32)
    cached = chat_turns(model, eng, 3, n=8, seed=8400, group=2)
    assert cached > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    eng.check_integrity()


@pytest.mark.parametrize("policy", ["eager-swa", "end-only"])
def test_other_policies_over_moved_pages_stay_exact(model, policy):
    """Regression: an eager policy frees window pages at insert (tombstones the tree refills
    later), the old one keeps fewer checkpoints; compaction moves what they keep."""
    eng = arena_engine_pages(model, 20, step_tokens=32, debug_poison=True, policy=policy)
    assert chat_turns(model, eng, 3, group=2) > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    assert_all_free_after_flush(eng)


def test_storage_without_a_host_tier_over_moved_pages_stays_exact(model, tmp_path):
    """Regression: no host tier, so compaction runs, while finished pages are written
    through to storage; a fresh engine then reads them back (L3 -> L1) exact."""
    kw = {"storage": f"file://{tmp_path}/kv", "debug_poison": True}
    eng = arena_engine_pages(model, 20, step_tokens=32, **kw)
    assert chat_turns(model, eng, 3, group=2) > 0
    assert sum(eng._prefix.moved.values()) > 0, "compaction never ran"
    eng.check_integrity()
    eng.close()
    again = arena_engine_pages(model, 20, step_tokens=32, **kw)
    assert chat_turns(model, again, 1, group=2) > 0
    assert again._counters["storage_tokens"] > 0
    assert_all_free_after_flush(again)
    again.close()


# ------------------------------------------------------------------ simulator

SHAPE = dict(system_tokens=Lengths(1500, 0.5), prompt_tokens=Lengths(300, 1.0),
             reply_tokens=Lengths(300, 0.8))


@pytest.mark.parametrize("chunk_pages,least", [(1, 1), (4, 1), (4, 4)])
def test_simulated_replays_over_an_arena_keep_the_tree_sound_and_hit_no_less(chunk_pages,
                                                                              least):
    """Metadata-only replays of synthetic chats over a small arena, the manager's checks
    (the owner map included) after every request; compaction moved pages, and the hit
    rate is at least the same replay's with compaction off. `least`: the frames of holes
    a pool waits for before it compacts (`compact_share`)."""
    lay = deepseek_v4_flash()
    moved = 0
    for seed in range(2):
        trace = synth_trace(ChatShape(conversations=30, seed=seed, **SHAPE))
        rates = {}
        for on in (True, False):
            cache = make_cache(lay, policy_choice("shadowradix"), 0.5 * 2**30, arena=True)
            assert cache.arena is not None and cache.arena.frames >= 4 * least
            cache.compact_share = cache.arena.frames // least
            if not on:
                cache.compact = lambda frames, need=None, busy=(), least=1: 0  # type: ignore[method-assign]
            st_ = replay(cache, trace, with_output=True, chunk_pages=chunk_pages, check_every=1)
            assert st_.refused == 0
            rates[on] = st_.hit_rate
            if on:
                moved += sum(cache.moved.values())
                cache.flush()
                assert all(p.used_pages == 0 for p in cache.pools.values())
        assert rates[True] >= rates[False] - 1e-9, rates
    assert moved > 0


# ------------------------------------------------------------------ state machine

class CompactionMachine(RuleBasedStateMachine):
    """Requests served whole (match, lock, alloc, write, insert, unlock), extra locks held
    as a running request's, evictions and explicit compactions over a few frames. A model
    of every page's content moves with it; locked prefixes never change page."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = content_cache(40, window=5, every=2)
        self.held: list[dict[str, np.ndarray]] = []  # pages a request holds, never the tree's
        self.seqs: list[np.ndarray] = []
        self.locks: list[tuple[object, np.ndarray, np.ndarray]] = []  # handle, tokens, table
        self.rng = np.random.default_rng(0)

    def _serve(self, tokens: np.ndarray) -> None:
        cache, ps = self.cache, PS
        m = cache.match(tokens)
        handle = cache.lock(m)
        done, full, total = m.prefix_len // ps, tokens.size // ps, -(-tokens.size // ps)
        need = {p.name: (full if p.ratio is None else total) - done for p in cache.layout.pools}
        got = cache.alloc(need)
        if got is None:
            cache.unlock(handle)
            return
        own = np.empty((len(cache.layout.pools), full - done), dtype=np.int32)
        partial = {}
        for row, spec in enumerate(cache.layout.pools):
            own[row] = got[spec.name][:full - done]
            partial[spec.name] = got[spec.name][full - done:]
            for i, page in enumerate(got[spec.name].tolist()):
                cache.content[row][page] = page_key(tokens, done + i, row, ps)
        cache.insert(tokens, own, done)
        cache.free(partial)
        cache.unlock(handle)
        self.seqs.append(tokens)

    @rule(length=st.integers(PS, 6 * PS), seed=st.integers(0, 2**16))
    def new_sequence(self, length: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._serve(rng.integers(0, 6, length).astype(np.int32))

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100), extra=st.integers(1, 3 * PS), seed=st.integers(0, 2**16))
    def extend(self, which: int, extra: int, seed: int) -> None:
        base = self.seqs[which % len(self.seqs)]
        rng = np.random.default_rng(seed)
        self._serve(np.concatenate([base, rng.integers(0, 6, extra)]).astype(np.int32))

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100), cut=st.integers(0, 4 * PS))
    def lock(self, which: int, cut: int) -> None:
        tokens = self.seqs[which % len(self.seqs)]
        tokens = tokens[:max(1, tokens.size - cut)]
        m = self.cache.match(tokens)
        if m.prefix_len == 0:
            return
        assert_sound(self.cache, list(tokens), m, self.cache.content)
        self.locks.append((self.cache.lock(m), tokens, m.page_table.copy()))

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 100))
    def unlock(self, which: int) -> None:
        handle, _, _ = self.locks.pop(which % len(self.locks))
        self.cache.unlock(handle)

    @rule(frames=st.integers(1, 4))
    def compact(self, frames: int) -> None:
        before = self.cache.arena.free_frames
        got = self.cache.compact(frames)
        assert got == self.cache.arena.free_frames - before >= 0

    @rule(pool=st.sampled_from(["kv", "c2", "swa", "state"]), n=st.integers(1, 6))
    def evict(self, pool: str, n: int) -> None:
        self.cache.evict(pool, n)

    @rule(pool=st.sampled_from(["kv", "c2", "swa", "state"]), n=st.integers(1, 12))
    def grab(self, pool: str, n: int) -> None:
        """A request takes pages (an allocation that may compact and evict)."""
        got = self.cache.alloc({pool: n})
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def give_back(self, which: int) -> None:
        self.cache.free(self.held.pop(which % len(self.held)))

    @invariant()
    def sound(self) -> None:
        cache = self.cache
        cache.check_integrity(held={n: np.concatenate(
            [np.empty(0, np.int32), *(h[n] for h in self.held if n in h)])
            for n in cache.layout.pool_names})
        tree_content_holds(cache)
        for handle, _tokens, table in self.locks:  # what a lock pins keeps its ids
            now = cache.tree.path_table(handle.node, DEVICE)[:, :table.shape[1]]
            for row, cols in needed_pages(cache.layout, table.shape[1]).items():
                assert (now[row, cols] == table[row, cols]).all(), "a locked page moved"
        for tokens in self.seqs[-6:]:
            m = cache.match(tokens, record=False)
            assert_sound(cache, list(tokens), m, cache.content)


TestCompactionMachine = CompactionMachine.TestCase
TestCompactionMachine.settings = settings(steps(150), derandomize=True, database=None)


# ------------------------------------------------------------------ sparse / move alone

def random_pool(ops, frames: int) -> tuple[Arena, dict[str, ArenaPool], ArenaPool]:
    """An arena of `frames` frames of HLAYOUT whose c4 pool went through `ops`: (grow, n,
    seed) allocates n pages, or frees n random pages of those in use."""
    arena = Arena(HLAYOUT, frames * plan_frames(HLAYOUT).frame_bytes)
    pools = arena.pools()
    c4 = pools["c4"]
    live: list[int] = []
    for grow, n, seed in ops:
        if grow and c4.can_alloc(n):
            live += c4.alloc(n).tolist()
        elif live:
            rng = np.random.default_rng(seed)
            drop = set(rng.choice(len(live), min(n, len(live)), replace=False).tolist())
            c4.free(np.asarray([p for i, p in enumerate(live) if i in drop], np.int32))
            live = [p for i, p in enumerate(live) if i not in drop]
    return arena, pools, c4


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 2**16)),
                    min_size=1, max_size=40), limit=st.integers(1, 6))
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_moving_what_sparse_names_gives_back_exactly_those_frames(ops, limit) -> None:
    """Regression: random allocations and frees on one pool of an arena; the pages `sparse`
    names always fit (`move` never raises), their frames and only those go back, the
    pages in use stay as many, and every new id was free."""
    arena, pools, c4 = random_pool(ops, 40)
    pages = c4.sparse(limit)
    frames = set((pages // c4.per_frame).tolist())
    assert len(frames) <= limit
    held, used, free_frames = c4.frames_held, c4.used_pages, arena.free_frames
    was_free = ~c4.in_use(np.arange(c4.num_pages))
    new = c4.move(pages)
    assert new.size == pages.size and was_free[new].all()
    assert (c4.frames_held, c4.used_pages) == (held - len(frames), used)
    assert arena.free_frames == free_frames + len(frames)
    assert not c4.in_use(pages).any() and c4.in_use(new).all()
    arena.check_integrity(pools)
