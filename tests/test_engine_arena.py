"""The engine over one device byte budget (CacheConfig(device_bytes=...), pool/arena.py):
exact against transformers' uncached forward however the pools' shares move, and the same
cached tokens as the simulator's metadata-only replay over the same arena."""

from __future__ import annotations

import httpx
import pytest
from server_util import ServerThread, metrics, wait_for
from test_engine import GREEDY, check, rand_tokens
from test_engine_vs_sim import Prompt, conversations
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.demo import tiny_deepseek_v4
from shadowradix.pool.arena import Arena
from shadowradix.sim.replay import replay
from shadowradix.tiers import PrefixCache

PS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def page_bytes(model) -> int:
    """Bytes of one logical page in every pool of the tiny model."""
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_tokens=PS))
    return sum(eng.layout.page_bytes().values())


def engine(model, pages: int, step_tokens: int = 512, **kw) -> Engine:
    """An engine whose arena holds about `pages` logical pages of every pool."""
    return Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=pages * page_bytes(model),
                                             **kw), step_tokens=step_tokens)


def fixed_held_bytes(arena: Engine, fixed: Engine) -> int:
    """The bytes `fixed`'s device pools hold, of the pools `arena`'s arena serves."""
    ps = arena.layout.page_size
    return sum(pool.num_pages * arena.layout.pool(name).page_bytes(ps)
               for name, pool in fixed._prefix.pools.items()
               if name in arena._prefix.arena.names)


def share(eng: Engine, pool: str = "swa") -> float:
    """The share of the bytes the pools hold in the arena that `pool` holds."""
    held = eng.status()["arena_bytes"]
    return held[pool] / sum(v for n, v in held.items() if n != "free")


def test_a_multi_turn_chat_hits_and_stays_exact(model):
    eng = engine(model, 40)
    prompt = rand_tokens(75, 3)
    last = 0
    for turn in range(3):
        r = eng.generate([prompt], GREEDY, return_logits=True)[0]
        check(model, prompt, r)
        assert r.cached_tokens == last // PS * PS
        last = len(prompt) + len(r.output_ids) - 1
        prompt = prompt + r.output_ids + rand_tokens(11, 10 + turn)
    eng.check_integrity()
    assert eng.stats()["arena"]["frames"] == eng.arena_info()["frames"]


@pytest.mark.parametrize("step_tokens", [1, 7, 29])
def test_small_arena_evicts_chunks_and_queues_and_stays_exact(model, step_tokens):
    eng = engine(model, 12, step_tokens)  # a few requests at a time; eviction constant
    prompts = [rand_tokens(60 + 9 * i, 40 + i) for i in range(4)]
    for p, r in zip(prompts, eng.generate(prompts, GREEDY, return_logits=True), strict=True):
        check(model, p, r)
    again = [prompts[0] + rand_tokens(20, 50)]
    check(model, again[0], eng.generate(again, GREEDY, return_logits=True)[0])
    eng.check_integrity()
    assert sum(p["evicted"] for p in eng.stats()["pools"].values()) > 0


def test_concurrent_requests_preempt_each_other_in_a_tight_arena_and_stay_exact(model):
    eng = engine(model, 10, step_tokens=64)
    prompts = [rand_tokens(40, 60 + i) for i in range(6)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    results = eng.generate(prompts, params, return_logits=True)
    for p, r in zip(prompts, results, strict=True):
        check(model, p, r)
    assert eng.stats()["preemptions"] > 0
    eng.check_integrity()


def test_host_tier_over_the_arena_stays_exact(model):
    eng = engine(model, 12, host_tokens=60 * PS)
    a = rand_tokens(90, 70)
    eng.generate([a], GREEDY)
    for i in range(3):  # push a off the device; the host keeps it
        eng.generate([rand_tokens(90, 71 + i)], GREEDY)
    prompt = a + rand_tokens(20, 80)
    r = eng.generate([prompt], GREEDY, return_logits=True)[0]
    check(model, prompt, r)
    assert r.cached_by_tier["host"] > 0
    eng.check_integrity()


def test_hisparse_sets_its_buffers_apart_from_the_arena_and_stays_exact(model):
    plain = engine(model, 30)
    eng = engine(model, 30, hisparse_buffer=9, hisparse_requests=2)
    assert "c4" not in eng.status()["arena_bytes"]  # C4 lives in host memory with HiSparse
    info = eng.arena_info()
    assert info["reserved_bytes"] >= eng.hot.nbytes > 0
    assert info["frames"] < plain.arena_info()["frames"]
    prompts = [rand_tokens(70, 90), rand_tokens(50, 91)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r)
    eng.check_integrity()


def test_the_window_pool_grows_for_short_chats_and_shrinks_for_long_context(model):
    """One engine, one arena: many short conversations fill it with windows (resume points
    at every sequence end), then one long prompt needs its compressed KV for every token
    and the window pool gives its frames back. No fixed share serves both."""
    eng = engine(model, 40, step_tokens=64)
    chats = [rand_tokens(20, 100 + i) for i in range(24)]
    for turn in range(2):
        for i, prompt in enumerate(chats):
            r = eng.generate([prompt], GREEDY, return_logits=True)[0]
            check(model, prompt, r)
            chats[i] = prompt + r.output_ids + rand_tokens(9, 200 + 31 * turn + i)
    short = share(eng)
    long = rand_tokens(3000, 300)
    r = eng.generate([long], SamplingParams(max_new_tokens=2, ignore_eos=True),
                     return_logits=True)[0]
    check(model, long, r)
    after = share(eng)
    eng.check_integrity()
    assert short > 0.5 and after < 0.3, (short, after)


def test_too_long_a_request_is_refused_naming_the_arena(model):
    eng = engine(model, 4)
    with pytest.raises(ValueError, match="pages at once"):
        eng.add_request(rand_tokens(400, 5), SamplingParams(max_new_tokens=4))


def test_device_bytes_excludes_pools_of_their_own():
    with pytest.raises(ValueError, match="window_tokens"):
        CacheConfig(device_bytes=1 << 20, window_tokens=256)
    for bad in (0, -1, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match="device_bytes"):
            CacheConfig(device_bytes=bad)


@pytest.mark.parametrize("sizing, named", [
    (dict(device_bytes=2**50), "device_bytes=1125899906842624"),
    (dict(device_tokens=2**44), "device_tokens=17592186044416"),
    (dict(device_tokens=2**44, window_tokens=PS), "device_tokens=17592186044416: "),
    (dict(device_tokens=4 * PS, host_tokens=2**40), "host_tokens=1099511627776"),
    (dict(device_tokens=2**40, hisparse_buffer=8), "device_tokens=1099511627776"),
])
def test_a_cache_larger_than_memory_is_refused_before_anything_is_allocated(
        model, sizing, named):
    """A budget past the machine's memory is a ValueError naming the settings, not numpy's
    MemoryError or torch's allocator error from deep inside the pools."""
    with pytest.raises(ValueError, match=f"KV cache needs .* GiB .*{named}"):
        Engine.from_hf(model, CacheConfig(page_size=PS, **sizing))


@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("hisparse", [None, 5])
@pytest.mark.parametrize("policy", ["shadowradix", "no-shadows"])
def test_device_tokens_alone_is_an_arena_holding_what_fixed_pools_of_it_held(
        model, page_size, hisparse, policy):
    """CacheConfig(device_tokens=T) is the arena of the bytes T tokens take in every pool:
    the fixed pools' bytes (window_tokens set) in whole frames once T is a few pages under a
    policy that tombstones, a few frames more at most otherwise, and never a shorter
    longest request, however few pages T is."""
    for pages in (1, 2, 3, 4, 8, 32):
        cfg = dict(page_size=page_size, device_tokens=pages * page_size,
                   hisparse_buffer=hisparse, policy=policy)
        arena = Engine.from_hf(model, CacheConfig(**cfg))
        fixed = Engine.from_hf(model, CacheConfig(**cfg, window_tokens=pages * page_size))
        info = arena.arena_info()
        assert info is not None and fixed.arena_info() is None
        assert arena.status()["arena_bytes"] is not None
        held = fixed_held_bytes(arena, fixed)
        hot = arena.hot.nbytes if arena.hot is not None else 0  # set apart in whole frames
        assert (hisparse is not None) == (hot > 0) == (info["reserved_bytes"] >= hot > 0)
        fb = info["frame_bytes"]
        slack = fb if policy != "no-shadows" and pages >= 8 else 3 * len(arena.layout.pools) * fb
        assert held + hot <= arena.device_bytes < held + hot + slack + fb
        assert arena.max_sequence_len() >= fixed.max_sequence_len(), cfg


@pytest.mark.parametrize("host_tokens", [0, 640])
def test_engine_and_simulator_cache_the_same_tokens_over_one_arena(model, host_tokens):
    step = 48
    eng = engine(model, 40, step_tokens=step, host_tokens=host_tokens)
    prompts = conversations()
    engine_hits = []
    for prompt in prompts:
        (r,) = eng.generate([prompt], SamplingParams(max_new_tokens=1))
        engine_hits.append((r.cached_tokens, r.cached_by_tier["host"]))
    eng.check_integrity()
    host_pages = ({n: p.num_pages for n, p in eng._prefix.host_pools.items()}
                  if host_tokens else None)
    cache = PrefixCache(eng.layout, {}, host_pages=host_pages,
                        arena=Arena(eng.layout, eng.config.device_bytes))
    assert cache.arena.frames == eng.arena_info()["frames"]
    host = None
    if host_tokens:
        from shadowradix.sim.replay import CountingMover
        from shadowradix.tiers.host_tier import HostTier

        host = HostTier(cache, CountingMover())  # type: ignore[arg-type]
    sim_hits = []
    for p in prompts:
        st = replay(cache, [Prompt(tuple(p))], chunk_pages=step // PS, host=host)
        assert st.refused == 0
        sim_hits.append((st.cached_tokens, st.host_tokens))
    assert sum(c for c, _ in engine_hits) > 0
    assert sim_hits == engine_hits


def test_serve_device_bytes_reports_the_arena():
    with ServerThread.from_args("--model", "tiny", "--device-bytes", "2MiB") as srv:
        info = httpx.get(f"{srv.url}/server_info").json()
        assert info["device_bytes"] == 2 * 2**20
        assert info["arena"]["frames"] >= 1 and info["arena"]["frame_bytes"] > 0
        # The tokens the budget holds in every pool, not device_tokens' default (65,536):
        # within a page per pool of 2 MiB over the bytes a token takes in every pool.
        eng = Engine.from_hf(tiny_deepseek_v4(), CacheConfig(  # the model `tiny` serves
            page_size=info["page_size"], device_tokens=info["page_size"]))
        token_bytes = sum(eng.layout.page_bytes().values()) / info["page_size"]
        held = info["arena"]["frames"] * info["arena"]["frame_bytes"]
        assert held / token_bytes - info["page_size"] <= info["max_total_num_tokens"] <= (
            held / token_bytes)
        out = httpx.post(f"{srv.url}/v1/completions", json={
            "model": "tiny", "prompt": "hello arena " * 8, "max_tokens": 4}, timeout=60)
        assert out.status_code == 200, out.text

        def held() -> dict[str, float]:
            return {k.split("pool=")[1].rstrip("}"): v for k, v in metrics(srv.url).items()
                    if k.startswith("shadowradix:arena_bytes{")}

        wait_for(lambda: held().get("swa", 0) > 0, what="the window pool's frames in metrics")
        now = held()
        assert set(now) >= {"swa", "c4", "free"} and sum(now.values()) == (
            info["arena"]["frames"] * info["arena"]["frame_bytes"])
        found = metrics(srv.url)
        assert any(k.startswith("shadowradix:pages_used{") and "pool=swa" in k for k in found)


def test_compaction_moves_cached_pages_and_every_hit_on_them_stays_exact(model):
    """A tight arena and conversations of uneven lengths: eviction leaves holes in frames,
    compaction moves the tree's pages (their bytes too) to give whole frames back, and
    later turns that hit the moved pages are exact."""
    eng = engine(model, 20, step_tokens=64)
    chats = [rand_tokens(17 + 13 * (i % 5), 400 + i) for i in range(10)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for turn in range(3):
        for i, prompt in enumerate(chats):
            r = eng.generate([prompt], params, return_logits=True)[0]
            check(model, prompt, r)
            chats[i] = prompt + r.output_ids + rand_tokens(5 + 7 * ((i + turn) % 3), 500 + i)
        both = [chats[turn], chats[turn + 5]]  # two at a time: one runs while the other moves
        for p, r in zip(both, eng.generate(both, params, return_logits=True), strict=True):
            check(model, p, r)
    eng.check_integrity()
    assert sum(eng._prefix.moved.values()) > 0
