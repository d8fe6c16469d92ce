"""HiSparse through the engine (DESIGN.md §6): exact against HiSparse off (bitwise on CPU)
and transformers, the live counters equal an offline LRU replay of the recorded stream, and
nothing leaks through preemption, aborts, flushes and every cache tier."""

import pytest
import torch
from test_engine import check, rand_tokens
from tiny_model import HCA, SWA, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.sparse import replay

TOPK = 4  # the tiny model's index_topk
P = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, buffer: int | None, record: bool = False, step_tokens: int = 512,
           **kw) -> Engine:
    """With HiSparse, 8 sets of hot buffers unless told: enough that admission (and so
    every step's batch, hence float rounding) is the same as with HiSparse off."""
    if buffer is not None:
        kw.setdefault("hisparse_requests", 8)
    cfg = {"page_size": 16, "device_tokens": 2048, "hisparse_buffer": buffer, **kw}
    return Engine.from_hf(model, CacheConfig(**cfg), step_tokens=step_tokens,
                          record_topk=record)


def same(off, on, bitwise: bool = True) -> None:
    """HiSparse changed nothing: the same tokens from bitwise the same logits (within 1e-6
    when the steps batch requests differently, which changes float rounding)."""
    for a, b in zip(off, on, strict=True):
        assert a.output_ids == b.output_ids
        assert a.cached_by_tier == b.cached_by_tier
        if bitwise:
            assert torch.equal(a.logits, b.logits), (a.logits - b.logits).abs().max()
        else:
            assert (a.logits - b.logits).abs().max() <= 1e-6


def drained(eng: Engine) -> None:
    """Nothing running, every hot buffer back, every page accounted for."""
    eng.check_integrity()
    assert eng.stats()["hisparse"].get("in_use", 0) == 0
    assert not eng.has_unfinished()


def test_a_buffer_below_top_k_plus_one_is_refused_naming_the_minimum(model):
    with pytest.raises(ValueError, match=r"at least index_topk \+ 1 = 5"):
        engine(model, TOPK)
    engine(model, TOPK + 1).close()
    no_csa = tiny_model([SWA, HCA])
    with pytest.raises(ValueError, match="no compressed sparse attention"):
        engine(no_csa, 64)


@pytest.mark.parametrize("buffer", [TOPK + 1, 9, 512])
def test_decode_is_bitwise_hisparse_off_and_matches_transformers(model, buffer):
    """Buffer exactly top-k + 1, a middling one, and one larger than every history (the
    fast path only); mixed lengths, prefill in odd chunks."""
    prompts = [rand_tokens(n, n) for n in (3, 40, 77, 130)]
    off = engine(model, None, step_tokens=29).generate(prompts, P, return_logits=True)
    eng = engine(model, buffer, step_tokens=29)
    on = eng.generate(prompts, P, return_logits=True)
    same(off, on)
    for p, r in zip(prompts, on, strict=True):
        check(model, p, r, greedy=True)
    hs = eng.stats()["hisparse"]
    drained(eng)
    if buffer == 512:  # every history fits: lookups skip the buffer's replacement
        assert hs["hits"] == hs["misses"] == 0 and hs["fast_path_lookups"] > 0
        assert hs["hit_rate"] is None
    else:
        assert hs["misses"] > 0 and hs["hits"] > 0
    moved = hs["misses"] + hs["filled"] + hs["staged"]
    assert hs["bytes_moved"] == moved * 32 * 4  # float32 entries of head_dim 32
    assert set(hs["per_layer"]) == {1, 3}


@pytest.mark.parametrize("buffer", [TOPK + 1, 8, 12])
def test_live_counters_equal_the_offline_lru_replay_of_the_recorded_stream(model, buffer):
    prompts = [rand_tokens(n, 100 + n) for n in (20, 45, 90)]
    eng = engine(model, buffer, record=True, step_tokens=64)
    results = eng.generate(prompts, P)
    hs = eng.stats()["hisparse"]
    for layer, counts in hs["per_layer"].items():
        total = sum((replay(r.topk[layer], buffer, "lru") for r in results[1:]),
                    replay(results[0].topk[layer], buffer, "lru"))
        assert (counts["hits"], counts["misses"]) == (total.hits, total.misses), layer
    # The newest entries are produced mid-decode, and decode steps select them.
    created_in_decode = [ids for r in results for s in r.topk.values()
                         for ids, count in s.steps() if (ids >= s.counts[0]).any()]
    assert created_in_decode
    drained(eng)


def test_a_second_turn_hits_the_first_turns_prefix_with_hisparse_on(model):
    prompt = rand_tokens(70, 7)
    runs = []
    for buffer in (None, TOPK + 1):
        eng = engine(model, buffer)
        r1 = eng.generate([prompt], P, return_logits=True)
        turn2 = prompt + r1[0].output_ids + rand_tokens(11, 8)
        r2 = eng.generate([turn2, turn2[:50] + rand_tokens(9, 9)], P, return_logits=True)
        assert r2[0].cached_tokens == 80 and r2[1].cached_tokens == 48
        runs.append(r1 + r2)
        if buffer is not None:
            check(model, turn2, r2[0], greedy=True)
            drained(eng)
    same(*runs)


def test_device_flush_host_hits_and_storage_hits(model, tmp_path):
    """The C4 pool lives in host memory either way; L2 and L3 copy it like any pool."""
    prompt = rand_tokens(75, 50)
    runs = []
    for buffer in (None, TOPK + 1):
        url = f"file://{tmp_path / str(buffer)}"
        eng = engine(model, buffer, host_tokens=4096, storage=url)
        r1 = eng.generate([prompt], P, return_logits=True)
        turn2 = prompt + r1[0].output_ids + rand_tokens(9, 51)
        eng.cache.flush(tiers=("device",))
        r2 = eng.generate([turn2], P, return_logits=True)
        assert r2[0].cached_by_tier == {"device": 0, "host": 96, "storage": 0}
        drained(eng)
        eng.close()
        fresh = engine(model, buffer, storage=url)  # an empty device: L3 serves it
        r3 = fresh.generate([turn2], P, return_logits=True)
        assert r3[0].cached_by_tier["storage"] == 96
        if buffer is not None:
            check(model, turn2, r3[0], greedy=True)
            drained(fresh)
        fresh.close()
        runs.append(r1 + r2 + r3)
    same(*runs)


def test_preemption_mid_decode_is_exact_and_leaks_nothing(model):
    prompts = [rand_tokens(n, 60 + n) for n in (50, 61, 70, 83)]
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    runs, preempted = [], []
    for buffer in (None, TOPK + 1):
        eng = engine(model, buffer, device_tokens=256, window_tokens=128, step_tokens=32,
                     debug_poison=True)  # a read of a page not owned shows as NaN
        runs.append(eng.generate(prompts, long, return_logits=True))
        preempted.append(eng.stats()["preemptions"])
        if buffer is not None:
            drained(eng)
    assert preempted[0] == preempted[1] > 0
    assert all(torch.isfinite(r.logits).all() for r in runs[1])
    same(*runs)


def test_an_abort_mid_decode_returns_its_hot_buffers(model):
    eng = engine(model, TOPK + 1, hisparse_requests=2)
    a = eng.add_request(rand_tokens(60, 1), SamplingParams(max_new_tokens=100, ignore_eos=True))
    b = eng.add_request(rand_tokens(60, 2), SamplingParams(max_new_tokens=100, ignore_eos=True))
    for _ in range(10):
        eng.step()
    assert eng.stats()["hisparse"]["in_use"] == 2 and eng.stats()["hisparse"]["misses"] > 0
    eng.abort(a)
    assert eng.stats()["hisparse"]["in_use"] == 1
    eng.abort(b)
    drained(eng)
    c4 = eng.stats()["pools"]["c4"]
    assert c4["capacity"] - c4["free"] == c4["pages"]  # only the tree's pages are taken


def test_admission_waits_for_a_free_set_of_hot_buffers(model):
    prompts = [rand_tokens(30, 200 + i) for i in range(5)]
    off = engine(model, None).generate(prompts, P, return_logits=True)
    eng = engine(model, TOPK + 1, hisparse_requests=2)
    ids = [eng.add_request(p, P, return_logits=True) for p in prompts]
    results, peak = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.result
        peak = max(peak, eng.stats()["running"])
    assert peak == 2
    same(off, [results[i] for i in ids], bitwise=False)  # two at a time, not five
    drained(eng)


def test_the_c4_pool_lives_in_host_memory_and_the_device_holds_the_buffers(model):
    eng = engine(model, 8, hisparse_requests=3)
    assert eng.store.flat("c4", 1).device.type == "cpu"
    assert eng.hot is not None and tuple(eng.hot.data.shape) == (2, 3, 8, 32)
    default = engine(model, 8, hisparse_requests=None)  # what the C4 pool would take
    c4 = default.layout.pool("c4")
    assert default.hot.requests == 2048 // 4 // 8
    assert default.hot.nbytes == 2048 // 4 * c4.entry_bytes * c4.layers


def test_one_batched_copy_per_layer_per_step_for_every_decoding_request(model, monkeypatch):
    from shadowradix.sparse import hot_buffer

    eng = engine(model, TOPK + 1)
    for n in (60, 70, 80):
        eng.add_request(rand_tokens(n, n), P)
    while any(not r.decoding for r in eng.scheduler.running) or len(eng.scheduler.running) < 3:
        eng.step()
    copies = []
    real = hot_buffer._rows
    monkeypatch.setattr(hot_buffer, "_rows", lambda *a: copies.append(a[1].size) or real(*a))
    before = eng.stats()["hisparse"]["misses"]
    eng.step()  # three requests decode
    misses = eng.stats()["hisparse"]["misses"] - before
    assert len(copies) == 2 and sum(copies) == misses > 0  # one per CSA layer
