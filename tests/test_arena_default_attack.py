"""Attacks on the arena as the engine's default (CacheConfig(device_tokens=T) alone is a
shorthand for `pool.arena.arena_bytes`): the bound a request is refused at, the bytes the
shorthand takes, exactness at the bound, preemption, faults and the server's limits.

The first tests failed on defects an attack found (fixed since); the rest guard what held
up."""

from __future__ import annotations

import contextlib
import random

import httpx
import pytest
from helpers import fail_at
from server_util import ServerThread
from test_engine import check, rand_tokens
from test_engine_arena import fixed_held_bytes
from tiny_model import CSA, HCA, SWA, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.layout import deepseek_v4_pro
from shadowradix.pool.arena import Arena, ArenaPool, arena_bytes
from shadowradix.tiers.manager import CacheManager
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.radix import ShadowRadix


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def run(eng: Engine, prompts, params, logits: bool = True) -> list:
    """Online, `check_integrity` after every step; the results in order."""
    ids = [eng.add_request(p, params, return_logits=logits) for p in prompts]
    res: dict = {}
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                res[o.request_id] = o.result
        eng.check_integrity()
    assert not eng.has_unfinished(), "no progress"
    return [res[i] for i in ids]


# ========================================================= defects found (now fixed)
def test_add_request_refuses_a_sequence_longer_than_max_sequence_len(model):
    """`max_sequence_len` caps at the model's positions (max_position_embeddings, 65536 for
    the tiny model); `add_request` checked only the pages (fits_ever), so a request one
    position longer than `max_sequence_len` (or twice as long) was queued. With fixed pools
    this needed device_tokens >= max_position_embeddings; over the default arena a device
    of a quarter of that (16384 tokens) already holds more than the positions."""
    eng = Engine.from_hf(model, CacheConfig(page_size=256, device_tokens=16384))
    longest = eng.max_sequence_len()
    assert longest == model.config.max_position_embeddings  # the positions bound it here
    assert eng.manager.fits_ever(longest)  # the pages would hold one more
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.add_request([1] * longest, SamplingParams(max_new_tokens=1))  # longest + 1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.add_request([1] * 2 * longest, SamplingParams(max_new_tokens=1))
    eng.check_integrity()
    assert not eng.has_unfinished()


@pytest.mark.parametrize("page_size,pages", [(16, 256), (16, 4096), (32, 256), (256, 4096)])
def test_device_tokens_shorthand_takes_a_few_frames_more_than_fixed_pools_at_most(
        model, page_size, pages):
    """README: device_tokens alone is "the memory fixed pools of T tokens each took". It
    packed every pool into frames of its own, so each pool paid its per-frame slack (a
    frame's bytes past its last page), which grows with T: 30 frames (8.6%) more at page 16
    and 256 pages, 457 frames (8.0%) at 4096 pages; 3.1% at page 256; about 0.75% (554 MiB
    at 1M tokens, bf16) for DeepSeek-V4-Pro. A GPU sized for the fixed pools of T tokens
    needed that much more."""
    T = pages * page_size
    arena = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=T))
    fixed = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=T,
                                              window_tokens=T))
    held = fixed_held_bytes(arena, fixed)
    fb = arena.arena_info()["frame_bytes"]
    slack = 3 * len(arena.layout.pools) * fb  # the commit's own allowance
    assert held <= arena.device_bytes <= held + slack, (
        f"{arena.device_bytes - held} bytes ({(arena.device_bytes - held) // fb} frames, "
        f"{arena.device_bytes / held - 1:.1%}) over the fixed pools' {held}")


def test_device_tokens_shorthand_at_deepseek_v4_pro_scale_costs_more_than_fixed_pools():
    """The same at real scale: for DeepSeek-V4-Pro bf16 at page 256 and 1M tokens, the
    shorthand's arena was 554 MiB (36 frames of 15.3 MiB) over the fixed pools; now it is
    their bytes in whole frames (a request holds 2 pages of the window and state pools)."""
    lay = deepseek_v4_pro(256, "bfloat16")
    T = 1 << 20
    pages = {p.name: T // 256 for p in lay.pools}
    fixed = sum(lay.pool(n).page_bytes(256) * k for n, k in pages.items())
    from shadowradix.pool.arena import plan_frames

    fb = plan_frames(lay).frame_bytes
    request = {**pages, "swa": 2, "state": 2}  # its window and resume state: 2 pages each
    assert fixed <= arena_bytes(lay, pages, request=request, spread=("swa", "state")) < fixed + fb


# ============================================================== held up (these pass)
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_arena_never_holds_a_shorter_request_than_fixed_pools(page_size):
    """Over models whose window is under, at and over a page, HCA-only, CSA-only and
    SWA-only: the shorthand's longest request is never shorter than the fixed pools'."""
    models = [([SWA, CSA, HCA, CSA], 8), ([SWA, CSA, HCA, CSA], 40), ([SWA, CSA, HCA, CSA], 128),
              ([SWA], 8), ([CSA], 8), ([HCA], 8), ([CSA, CSA], 33)]
    for layers, window in models:
        mdl = tiny_model(layers, window=window)
        for pages in (1, 2, 3, 5):
            for policy in ("shadowradix", "no-shadows", "eager-swa", "periodic-2"):
                for hs in (None, 17):
                    if hs is not None and CSA not in layers:
                        continue
                    cfg = dict(page_size=page_size, device_tokens=pages * page_size,
                               policy=policy, hisparse_buffer=hs)
                    a = Engine.from_hf(mdl, CacheConfig(**cfg))
                    f = Engine.from_hf(mdl, CacheConfig(**cfg, window_tokens=pages * page_size))
                    assert a.max_sequence_len() >= f.max_sequence_len(), (layers, window, cfg)


@pytest.mark.parametrize("page_size,pages,policy,step", [
    (16, 1, "shadowradix", 512), (16, 2, "shadowradix", 7), (16, 3, "no-shadows", 5),
    (32, 2, "eager-swa", 512), (16, 3, "periodic-2", 3), (64, 2, "shadowradix", 40),
    (16, 2, "shadowradix", 1)])
def test_a_request_of_exactly_max_sequence_len_runs_alone_exact_and_one_more_is_refused(
        model, page_size, pages, policy, step):
    eng = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=pages * page_size,
                                            policy=policy, debug_poison=True),
                         step_tokens=step)
    longest, n = eng.max_sequence_len(), 3
    p = rand_tokens(longest - n, longest)
    (r,) = run(eng, [p], SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert len(r.output_ids) == n
    check(model, p, r, greedy=True)
    with pytest.raises(ValueError, match=rf"device arena .* holds at most {longest} tokens"):
        eng.add_request(rand_tokens(longest - n + 1, 1),
                        SamplingParams(max_new_tokens=n, ignore_eos=True))
    eng.check_integrity()
    assert not eng.has_unfinished()


class Repeat:
    """A proposer that always drafts k tokens (mostly wrong: every draft rolls back)."""

    def __call__(self, tokens, k):
        return [7] * k


@pytest.mark.parametrize("kind", ["ngram", "custom"])
@pytest.mark.parametrize("page_size,pages,policy", [(16, 1, "shadowradix"), (16, 2, "shadowradix"),
                                                    (32, 3, "periodic-2"), (16, 3, "no-shadows")])
def test_drafts_at_exactly_max_sequence_len_stay_exact(model, kind, page_size, pages, policy):
    """A verify step writes KV for the drafts too: at the very bound they must be cut to
    fit the arena's frames, never refused or overrun."""
    spec = SpecConfig("ngram", 3) if kind == "ngram" else SpecConfig("custom", 4,
                                                                     proposer=Repeat())
    eng = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=pages * page_size,
                                            policy=policy, debug_poison=True),
                         step_tokens=512, speculative=spec)
    longest, n = eng.max_sequence_len(), 8
    base = rand_tokens(5, longest)
    p = (base * longest)[:longest - n]  # periodic: the n-gram drafter finds matches
    (r,) = run(eng, [p], SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert len(r.output_ids) == n
    check(model, p, r, greedy=True)
    if kind == "custom":  # (the n-gram drafter finds nothing once an output breaks the period)
        assert eng.stats()["spec"]["drafts"] > 0


@pytest.mark.parametrize("extra", [{}, {"host_tokens": 2048},
                                   {"host_tokens": 2048, "write_policy": "write_back"},
                                   {"storage": True}, {"hisparse_buffer": 17},
                                   {"host_tokens": 32, "write_policy": "write_through"}])
@pytest.mark.parametrize("flush", [None, ("device",)])
def test_next_turn_and_a_pair_at_the_bound_over_every_tier(model, tmp_path, extra, flush):
    """Turn two of a conversation grows to exactly max_sequence_len, served from the device,
    the host (even one smaller than the request) or storage; then two requests at the bound
    at once preempt each other. All exact."""
    extra = dict(extra)
    if extra.pop("storage", None):
        extra["storage"] = f"file://{tmp_path}"
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=32, debug_poison=True,
                                            **extra), step_tokens=9)
    longest, n = eng.max_sequence_len(), 3
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    p1 = rand_tokens(longest - 2 * n - 10, longest)
    (r1,) = run(eng, [p1], params)
    check(model, p1, r1)
    if flush and (eng.host is not None or eng.storage is not None):
        eng.cache.flush(tiers=flush)
    p2 = p1 + r1.output_ids + rand_tokens(longest - 2 * n - len(p1), 5)
    assert len(p2) + n == longest
    (r2,) = run(eng, [p2], params)
    check(model, p2, r2)
    p3 = rand_tokens(longest - n, 7)
    for p, r in zip([p2, p3], run(eng, [p2, p3], params), strict=True):
        check(model, p, r)
    eng.close()


@pytest.mark.parametrize("page_size,T,step", [(16, 96, 48), (16, 64, 24), (32, 96, 40)])
def test_traffic_that_fixed_pools_of_T_finish_the_arena_of_T_finishes_the_same(
        model, page_size, T, step):
    """Eight requests whose decodes outgrow the device: every one the fixed pools of the
    same device_tokens finish, the arena finishes too, with the same greedy tokens, exact."""
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [rand_tokens(min(20 + 3 * i, 40), 400 + i) for i in range(8)]
    outs = {}
    for kind, kw in (("arena", {}), ("fixed", {"window_tokens": T})):
        eng = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=T,
                                                debug_poison=True, **kw), step_tokens=step)
        outs[kind] = run(eng, prompts, p)
        if kind == "arena":
            assert eng.stats()["preemptions"] > 0
    for q, ra, rf in zip(prompts, outs["arena"], outs["fixed"], strict=True):
        assert ra.output_ids == rf.output_ids
        check(model, q, ra, greedy=True)


@pytest.mark.parametrize("cfg", [
    dict(page_size=16, device_tokens=32),
    dict(page_size=16, device_tokens=64, policy="no-shadows"),
    dict(page_size=16, device_tokens=32, policy="periodic-2", prefix_reuse=False),
    dict(page_size=16, device_tokens=32, host_tokens=1024, write_policy="write_back"),
    dict(page_size=16, device_tokens=64, host_tokens=512, write_policy="write_through_selective",
         write_hit_threshold=1),
    dict(page_size=32, device_tokens=64, hisparse_buffer=17),
    dict(page_size=16, device_tokens=32, storage="file"),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "page_size"))
@pytest.mark.parametrize("seed", [1, 2])
def test_random_traffic_with_aborts_and_flushes_stays_exact(model, tmp_path, cfg, seed):
    """Shared prefixes, random lengths up to the bound, aborts and flushes between steps,
    `check_integrity` after every step, every finished request exact."""
    cfg = dict(cfg)
    if cfg.get("storage"):
        cfg["storage"] = f"file://{tmp_path}"
    rng = random.Random(seed)
    eng = Engine.from_hf(model, CacheConfig(debug_poison=True, **cfg),
                         step_tokens=rng.choice([7, 48]))
    longest = eng.max_sequence_len()
    shared = rand_tokens(min(longest, 200), seed)
    pending = []
    for i in range(10):
        n = rng.randint(1, 8)
        plen = rng.randint(1, max(1, min(longest - n, 200)))
        k = rng.randint(0, plen) if rng.random() < 0.5 else 0
        pending.append((shared[:k] + rand_tokens(plen - k, seed * 100 + i), n))
    live, res, aborted = {}, {}, set()
    for _ in range(5000):
        if not pending and not eng.has_unfinished():
            break
        if pending and rng.random() < 0.5:
            q, n = pending.pop()
            live[eng.add_request(q, SamplingParams(max_new_tokens=n, ignore_eos=True),
                                 return_logits=True)] = q
        if live and rng.random() < 0.08:
            rid = rng.choice(list(live))
            if rid not in res:
                eng.abort(rid)
                aborted.add(rid)
        if rng.random() < 0.03:
            eng.cache.flush(tiers=("device",))
        for o in eng.step():
            if o.finished and o.result is not None:
                res[o.request_id] = o.result
        eng.check_integrity()
    assert not eng.has_unfinished()
    for rid, q in live.items():
        if rid in aborted and rid not in res:
            continue
        check(model, q, res[rid], greedy=True)
    eng.close()


class Injected(Exception):
    pass


ARENA_STEPS = [
    (PrefixCache, "compact"), (PrefixCache, "copy_pages"), (PrefixCache, "_make_frames"),
    (PrefixCache, "evict"), (PrefixCache, "alloc"), (ArenaPool, "claim"), (ArenaPool, "alloc"),
    (ArenaPool, "free"), (Arena, "take"), (Arena, "give"), (ShadowRadix, "insert"),
    (CacheManager, "grow"), (CacheManager, "preempt"), (CacheManager, "finish"),
]


@pytest.mark.parametrize("nth,host", [(1, False), (3, True)])  # CI time: two of the four
@pytest.mark.parametrize("owner,method", ARENA_STEPS,
                         ids=[f"{o.__name__}.{m}" for o, m in ARENA_STEPS])
def test_a_fault_in_the_default_arena_leaves_no_trace(model, monkeypatch, owner, method, nth,
                                                       host):
    """As tests/test_engine_faults.py, over the shorthand's arena without a host tier (turn
    two preempts and compacts) and with a write-back host tier: after the fault, every page
    has one owner, the retry is exact, a full flush gives every frame back."""
    extra = dict(host_tokens=1024, write_policy="write_back") if host else {}
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=48, debug_poison=True,
                                            **extra), step_tokens=24 if host else 8)
    P = SamplingParams(max_new_tokens=5, ignore_eos=True)
    convs = [rand_tokens(40 + 6 * i, 900 + i) for i in range(3)]
    outs = eng.generate(convs, P)
    turn2 = [c + o.output_ids + rand_tokens(20, 950 + i)
             for i, (c, o) in enumerate(zip(convs, outs, strict=True))]
    if host:
        eng.cache.flush(tiers=("device",))
    fail_at(monkeypatch, owner, method, nth, Injected)
    with contextlib.suppress(Injected):
        eng.generate(turn2, P)
    monkeypatch.undo()
    assert not eng.has_unfinished()
    eng.check_integrity()
    assert not eng.manager.leases
    for t, r in zip(turn2, eng.generate(turn2, P, return_logits=True), strict=True):
        check(model, t, r)
    eng.cache.flush(tiers=("device", "host") if host else ("device",))
    eng.check_integrity()
    arena = eng._prefix.arena
    assert arena.free_frames == arena.frames, "frames leaked"
    for name, pool in eng._prefix.host_pools.items():
        assert pool.free_pages == pool.num_pages, f"host {name}: pages leaked"
    eng.close()


def test_hisparse_never_grows_the_shorthands_device_bytes(model):
    """README (HiSparse, Sizing): turning HiSparse on never grows device memory: over the
    shorthand's arena too (its hot buffers are rounded to frames, as the C4 pages were)."""
    for page_size in (16, 32, 64, 128, 256):
        for pages in (1, 2, 3, 8, 32, 256):
            T = pages * page_size
            off = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=T))
            on = Engine.from_hf(model, CacheConfig(page_size=page_size, device_tokens=T,
                                                   hisparse_buffer=17))
            assert on.device_bytes <= off.device_bytes, (page_size, pages)


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server():
    srv = ServerThread.from_args("--model", "tiny", "--device-tokens", "256",
                                 "--step-tokens", "64")
    yield srv
    srv.stop()


def test_server_reports_one_max_model_len_and_the_arenas_bytes(server):
    longest = server.on_engine(lambda e: e.max_sequence_len())
    budget = server.on_engine(lambda e: e.device_bytes)
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    info = httpx.get(f"{server.url}/server_info").json()
    assert models[0]["max_model_len"] == info["context_length"] == server.runtime.max_len \
        == longest
    assert info["device_bytes"] == budget and budget is not None
    assert info["arena"]["frames"] * info["arena"]["frame_bytes"] <= budget


def test_server_runs_the_longest_prompt_and_refuses_one_more_with_a_clear_400(server):
    longest = server.runtime.max_len
    url = f"{server.url}/v1/completions"
    ok = httpx.post(url, json={"model": "tiny", "prompt": [5] * (longest - 1), "max_tokens": 1},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    for body in ({"prompt": [5] * longest, "max_tokens": 1},
                 {"prompt": [5] * (longest - 1), "max_tokens": 2}):
        r = httpx.post(url, json={"model": "tiny", **body}, timeout=120)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and str(longest) in err["message"]
    native = httpx.post(f"{server.url}/generate", json={
        "input_ids": [5] * longest, "sampling_params": {"max_new_tokens": 1}}, timeout=120)
    assert native.status_code == 400 and str(longest) in native.text
    server.on_engine(lambda e: e.check_integrity())
