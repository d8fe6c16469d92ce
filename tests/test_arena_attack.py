"""Attack on the device byte arena (CacheConfig(device_bytes=...), pool/arena.py): tiny
arenas at the edge of what fits, concurrency and preemption, speculative decoding,
HiSparse, the host and storage tiers, faults injected mid-allocation, odd layouts, bf16,
the --device-bytes flag and the simulator's arena."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import pytest
import torch
from helpers import fail_at
from test_engine import check, rand_tokens
from tiny_model import CSA, HCA, SWA, reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.flags import byte_size
from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers import PrefixCache

PS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def frame_bytes(model, ps: int = PS, **kw) -> int:
    eng = Engine.from_hf(model, CacheConfig(page_size=ps, device_tokens=ps, **kw))
    return plan_frames(eng.layout).frame_bytes


def arena_engine(model, frames: int, step_tokens: int = 512, ps: int = PS,
                 extra_bytes: int = 0, **kw) -> Engine:
    fb = frame_bytes(model, ps)
    return Engine.from_hf(model, CacheConfig(page_size=ps, device_bytes=frames * fb + extra_bytes,
                                             debug_poison=True, **kw), step_tokens=step_tokens)


# ------------------------------------------------------------- the edge of what fits

@pytest.mark.parametrize("frames", [1, 2, 3])
def test_an_arena_too_small_for_any_request_refuses_every_request_up_front(model, frames):
    """Fewer frames than one token's pages: construction may succeed, but then every
    request is refused by add_request (never a RuntimeError or a hang in step)."""
    eng = arena_engine(model, frames)
    assert eng.max_sequence_len() <= 1
    with pytest.raises(ValueError):
        eng.add_request([1], SamplingParams(max_new_tokens=1))
    assert not eng.has_unfinished()
    eng.check_integrity()


def test_one_byte_under_a_frame_is_a_clear_error(model):
    fb = frame_bytes(model)
    with pytest.raises(ValueError, match="frame"):
        Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=fb - 1))
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=fb))
    assert eng.arena_info()["frames"] == 1


def test_a_too_small_device_bytes_names_the_setting(model):
    """The error for an arena that holds no frame names what the user set
    (device_bytes / --device-bytes), not only the internal 'arena'."""
    with pytest.raises(ValueError, match="device.bytes"):
        Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=100))


@pytest.mark.parametrize("frames, step", [(4, 7), (5, 16), (6, 512)])
def test_a_request_of_max_sequence_len_completes_exact_one_more_is_refused(model, frames, step):
    eng = arena_engine(model, frames, step)
    longest = eng.max_sequence_len()
    assert longest >= 2
    plen = max(1, longest - 3)
    prompt = rand_tokens(plen, 3000 + frames)
    (r,) = eng.generate([prompt], SamplingParams(max_new_tokens=longest - plen,
                                                 ignore_eos=True), return_logits=True)
    check(model, prompt, r, greedy=True)
    eng.check_integrity()
    with pytest.raises(ValueError, match="pages at once"):
        eng.add_request(prompt, SamplingParams(max_new_tokens=longest - plen + 1))
    # The same sequence again hits the cache and still fits.
    (r2,) = eng.generate([prompt], SamplingParams(max_new_tokens=longest - plen,
                                                  ignore_eos=True), return_logits=True)
    check(model, prompt, r2, greedy=True)
    eng.check_integrity()


# ------------------------------------------------------------- concurrency, preemption

@pytest.mark.parametrize("frames, step", [(5, 1), (5, 64), (7, 7), (9, 33)])
def test_many_requests_each_fitting_alone_all_complete_in_a_tiny_arena(model, frames, step):
    eng = arena_engine(model, frames, step)
    longest = eng.max_sequence_len()
    n = min(longest, 24)
    prompts = [rand_tokens(max(1, n - 6 - i % 3), 3100 + i) for i in range(6)]
    params = [SamplingParams(max_new_tokens=n - len(p), ignore_eos=True) for p in prompts]
    results = eng.generate(prompts, params, return_logits=True)
    for p, r in zip(prompts, results, strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


def test_sampling_requests_preempted_in_a_tiny_arena_match_an_unbounded_engine(model):
    prompts = [rand_tokens(30 + i, 3200 + i) for i in range(5)]
    params = [SamplingParams(max_new_tokens=25, temperature=0.9, top_p=0.9, seed=7 + i,
                             ignore_eos=True) for i in range(5)]
    big = Engine.from_hf(model, CacheConfig(page_size=PS, device_tokens=4096))
    want = [r.output_ids for r in big.generate(prompts, params)]
    eng = arena_engine(model, 9, step_tokens=24)
    assert eng.max_sequence_len() >= 60
    got = eng.generate(prompts, params, return_logits=True)
    assert [r.output_ids for r in got] == want
    for p, r in zip(prompts, got, strict=True):
        check(model, p, r)
    eng.check_integrity()


def test_shared_prefix_requests_in_a_tiny_arena(model):
    """Requests sharing a prefix lock the same tree pages; with few frames the copies they
    hold must be shared (`_room`) rather than stalling."""
    eng = arena_engine(model, 8, step_tokens=16)
    system = rand_tokens(40, 3300)
    eng.generate([system], SamplingParams(max_new_tokens=2, ignore_eos=True))
    prompts = [system + rand_tokens(5 + i, 3301 + i) for i in range(5)]
    longest = eng.max_sequence_len()
    params = [SamplingParams(max_new_tokens=min(20, longest - len(p)), ignore_eos=True)
              for p in prompts]
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


# ------------------------------------------------------------- speculative decoding

class Oracle:
    """Proposes the model's own greedy continuation (every draft accepted) where known."""

    def __init__(self, model, prompts, n):
        self.truth = {}
        for p in prompts:
            seq = list(p)
            for _ in range(n):
                seq.append(int(reference_logits(model, seq)[-1].argmax()))
            self.truth[tuple(p)] = seq

    def __call__(self, tokens, k):
        tokens = list(tokens)
        for seq in self.truth.values():
            if seq[:len(tokens)] == tokens:
                return seq[len(tokens):len(tokens) + k]
        return []


@pytest.mark.parametrize("k", [3, 7])
def test_speculative_decoding_at_max_sequence_len_in_a_tiny_arena(model, k):
    prompts = [rand_tokens(10, 3400), rand_tokens(12, 3401)]
    fb = frame_bytes(model)
    spec = SpecConfig(method="custom", num_draft_tokens=k, proposer=Oracle(model, prompts, 20))
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=5 * fb, debug_poison=True),
                         step_tokens=16, speculative=spec)
    longest = eng.max_sequence_len()
    assert longest >= 17
    params = [SamplingParams(max_new_tokens=longest - len(p), ignore_eos=True) for p in prompts]
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    assert eng.stats()["spec"]["accepted_tokens"] > 0
    eng.check_integrity()


def test_ngram_speculation_with_preemption_in_a_tiny_arena(model):
    base = rand_tokens(6, 3410)
    prompts = [base * 4 + rand_tokens(2, 3411 + i) for i in range(4)]
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=8 * frame_bytes(model),
                                            debug_poison=True),
                         step_tokens=24, speculative=SpecConfig(num_draft_tokens=5))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


# ------------------------------------------------------------- HiSparse

def test_hisparse_with_device_bytes_too_small_for_its_hot_buffers_is_a_clear_error(model):
    """The error names what took the bytes and what to change (it said only "besides the
    N set apart": frames, without the unit, and not what set them apart)."""
    with pytest.raises(ValueError, match=r"frames \(\d+ bytes\) set apart; HiSparse's hot "
                       r"buffers take \d+ bytes .*hisparse_requests=64\): lower those"):
        Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=4 * frame_bytes(model),
                                          hisparse_buffer=64, hisparse_requests=64))


@pytest.mark.parametrize("frames", [8, 40, 200])
def test_hisparse_on_by_default_keeps_a_device_bytes_budget_that_serves_off(model, frames):
    """Turning HiSparse on never grows device memory: by default its hot buffers take the
    bytes the C4 pool would have taken of `device_bytes`. They were sized from
    `device_tokens`' default (65,536 tokens) whatever the budget, so a budget that served
    with HiSparse off could not even be built with it on (hundreds of frames set apart)."""
    budget = frames * frame_bytes(model)
    off = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=budget))
    on = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=budget,
                                           hisparse_buffer=64, debug_poison=True))
    assert on.device_bytes == off.device_bytes == budget
    fb = frame_bytes(model)
    c4 = budget // sum(on.layout.page_bytes().values()) * on.layout.pool("c4").page_bytes(PS)
    one = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=budget,
                                            hisparse_buffer=64, hisparse_requests=1))
    # C4's share in whole frames, or one set where even that is more
    assert on.arena_info()["reserved_bytes"] <= max(-(-c4 // fb) * fb,
                                                   one.arena_info()["reserved_bytes"])
    assert on.max_sequence_len() >= min(off.max_sequence_len(), 100)
    prompt = rand_tokens(40, 3600)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    check(model, prompt, on.generate([prompt], params, return_logits=True)[0], greedy=True)
    on.check_integrity()


def test_serve_device_bytes_too_small_beside_hot_buffers_exits_2(capsys, no_uvicorn):
    """As for one frame without HiSparse: exit 2 naming the flags before anything loads,
    never a server whose model then fails to load (the check left the hot buffers out)."""
    rc, err = _serve_error(capsys, ["serve", "--model", "tiny", "--device-bytes", "40000",
                                    "--hisparse-buffer", "64", "--hisparse-requests", "1"])
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "--device-bytes" in line and "--hisparse-requests" in line


def test_hisparse_at_the_edge_of_its_arena_completes_exact(model):
    fb = frame_bytes(model)
    probe = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=100 * fb,
                                              hisparse_buffer=9, hisparse_requests=2))
    reserved = probe.arena_info()["reserved_bytes"]
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_bytes=reserved + 5 * fb,
                                            hisparse_buffer=9, hisparse_requests=2,
                                            debug_poison=True), step_tokens=16)
    assert eng.arena_info()["frames"] == 5
    longest = eng.max_sequence_len()
    assert longest > 17
    n = min(longest, 80)
    prompts = [rand_tokens(n - 10, 3500), rand_tokens(n - 12, 3501), rand_tokens(20, 3502)]
    params = [SamplingParams(max_new_tokens=min(10, n - len(p)), ignore_eos=True)
              for p in prompts]
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


# ------------------------------------------------------------- host and storage tiers

@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_host_tier_write_policies_over_a_tiny_arena(model, policy):
    eng = arena_engine(model, 8, step_tokens=16, host_tokens=40 * PS, write_policy=policy)
    a = rand_tokens(50, 3600)
    prompts = [a, rand_tokens(50, 3601), rand_tokens(50, 3602), a + rand_tokens(9, 3603),
               a + rand_tokens(3, 3604)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for p in prompts:
        (r,) = eng.generate([p], params, return_logits=True)
        check(model, p, r, greedy=True)
        eng.check_integrity()
    many = eng.generate(prompts, params, return_logits=True)
    for p, r in zip(prompts, many, strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


def test_storage_tier_over_a_tiny_arena(model, tmp_path):
    kw = {"storage": f"file://{tmp_path}/kv", "host_tokens": 20 * PS}
    eng = arena_engine(model, 8, step_tokens=16, **kw)
    a = rand_tokens(60, 3700)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    check(model, a, eng.generate([a], params, return_logits=True)[0], greedy=True)
    for i in range(3):
        eng.generate([rand_tokens(60, 3701 + i)], params)
    eng.close()
    again = arena_engine(model, 8, step_tokens=16, **kw)  # a fresh engine: storage only
    p = a + rand_tokens(7, 3710)
    r = again.generate([p], params, return_logits=True)[0]
    check(model, p, r, greedy=True)
    assert r.cached_tokens > 0
    again.check_integrity()
    again.close()


# ------------------------------------------------------------- faults mid-allocation

def _fault_engine(model):
    return arena_engine(model, 8, step_tokens=16, host_tokens=0)


# Arena-specific points (PrefixCache.alloc's own points, and Arena.take / Arena.give that
# ArenaPool.alloc / ArenaPool.free call after they began booking).
FAULT_POINTS = [(PrefixCache, "_make_frames"), (PrefixCache, "alloc"), (Arena, "take"),
                (Arena, "give")]


@pytest.mark.parametrize("owner, name", FAULT_POINTS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("at", [1, 2, 5])
def test_a_fault_at_any_point_of_an_allocation_leaves_the_engine_consistent(
        model, monkeypatch, owner, name, at):
    eng = _fault_engine(model)
    prompts = [rand_tokens(30 + 7 * i, 3800 + i) for i in range(4)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    calls = fail_at(monkeypatch, owner, name, at, MemoryError)
    with contextlib.suppress(MemoryError):
        eng.generate(prompts, params)
    monkeypatch.undo()
    assert calls[0] >= at, "the fault point was not reached: the case tests nothing"
    eng.check_integrity()
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


def test_an_arena_take_fault_inside_pool_alloc_changes_nothing(model):
    """ArenaPool.alloc books its partial frames' slots before asking the arena for new
    frames: a fault there must not leave the per-frame counts ahead of the pages."""
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_tokens=PS))
    arena = Arena(eng.layout, 6 * plan_frames(eng.layout).frame_bytes)
    pools = arena.pools()
    c4 = pools["c4"]
    c4.alloc(3)  # one partial frame
    arena.check_integrity(pools)

    def boom(*a, **k):
        raise MemoryError("injected")

    arena.take = boom  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        c4.alloc(c4.per_frame + 2)
    arena.check_integrity(pools)


def test_a_fault_in_the_second_pools_alloc_leaks_nothing(model):
    """PrefixCache.alloc allocates pool after pool: when one raises, the pages the
    earlier pools gave must go back. (Not arena-specific: fixed PagePools leak the same
    way; ArenaPool.alloc has more Python in it that can fail.)"""
    eng = Engine.from_hf(model, CacheConfig(page_size=PS, device_tokens=PS))
    cache = PrefixCache(eng.layout, {}, arena=Arena(eng.layout,
                                                    8 * plan_frames(eng.layout).frame_bytes))
    need = {n: 1 for n in eng.layout.pool_names}
    last = eng.layout.pool_names[-1]
    real = cache.pools[last].alloc

    def boom(n):
        raise MemoryError("injected")

    cache.pools[last].alloc = boom  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        cache.alloc(need)
    cache.pools[last].alloc = real  # type: ignore[method-assign]
    cache.check_integrity(held={n: np.empty(0, np.int32) for n in eng.layout.pool_names})


def test_evict_bytes_fault_then_the_engine_recovers(model, monkeypatch):
    from shadowradix.tree import ShadowRadix

    eng = _fault_engine(model)
    warm = [rand_tokens(40, 3900 + i) for i in range(4)]
    eng.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True))
    calls = fail_at(monkeypatch, ShadowRadix, "evict_bytes", 1, MemoryError)
    prompts = [rand_tokens(60, 3910 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with pytest.raises(MemoryError):
        eng.generate(prompts, params)
    monkeypatch.undo()
    assert calls[0] >= 1
    eng.check_integrity()
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


@pytest.mark.parametrize("point", ["_remove_leaf", "_drop_dead_leaf", "_let_go"])
@pytest.mark.parametrize("nth", [2, 4])
def test_a_fault_halfway_through_an_eviction_walk_leaks_nothing(model, monkeypatch, point,
                                                                nth):
    """A walk that raised after letting some pages go lost them: the tree had forgotten
    them and the result that named them never reached the cache (check_integrity: 'pages
    in use but fewer owned (leak)'). Now they wait in `tree.stranded` and are freed."""
    from shadowradix.tree.eviction import Eviction

    eng = _fault_engine(model)
    warm = [rand_tokens(40, 3900 + i) for i in range(4)]
    eng.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True))
    calls = fail_at(monkeypatch, Eviction, point, nth, MemoryError)
    prompts = [rand_tokens(60, 3910 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with pytest.raises(MemoryError):
        eng.generate(prompts, params)
    monkeypatch.undo()
    assert calls[0] >= nth
    eng.check_integrity()
    for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


# ------------------------------------------------------------- odd layouts, bf16

@pytest.mark.parametrize("layers, window, hca, ps", [
    ([SWA, SWA], 8, 16, 16),
    ([HCA, HCA], 8, 8, 8),
    ([CSA], 5, 16, 12),
    ([SWA, CSA, HCA], 3, 8, 8),
    ([CSA, HCA, SWA, CSA], 20, 32, 32),
])
def test_odd_layer_mixes_and_page_sizes_over_small_arenas(layers, window, hca, ps):
    m = tiny_model(layers, window=window, hca_ratio=hca, seed=1)
    fb = frame_bytes(m, ps)
    for frames in (6, 11):
        eng = Engine.from_hf(m, CacheConfig(page_size=ps, device_bytes=frames * fb,
                                            device_tokens=ps * 64, debug_poison=True),
                             step_tokens=ps + 3)
        longest = eng.max_sequence_len()
        if longest < 3:
            continue
        n = min(longest, 70)
        prompts = [rand_tokens(max(1, n - 8 - i), 4000 + i) for i in range(3)]
        params = [SamplingParams(max_new_tokens=n - len(p), ignore_eos=True) for p in prompts]
        for p, r in zip(prompts, eng.generate(prompts, params, return_logits=True),
                        strict=True):
            check(m, p, r, greedy=True)
        eng.check_integrity()


def test_bf16_model_over_an_arena_is_exact_against_its_own_uncached_forward():
    m = tiny_model().to(torch.bfloat16)
    fb = frame_bytes(m)
    eng = Engine.from_hf(m, CacheConfig(page_size=PS, device_bytes=9 * fb + 3,
                                        debug_poison=True), step_tokens=16)
    plain = Engine.from_hf(m, CacheConfig(page_size=PS, device_tokens=4096), step_tokens=16)
    prompts = [rand_tokens(40 + 5 * i, 4100 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = plain.generate(prompts, params, return_logits=True)
    got = eng.generate(prompts, params, return_logits=True)
    for w, g in zip(want, got, strict=True):
        assert g.output_ids == w.output_ids
        assert torch.equal(g.logits, w.logits)
    eng.check_integrity()


def test_every_arena_view_is_aligned_for_its_dtype():
    """A pool's strided view over the uint8 arena starts every page at a multiple of its
    entry's dtype size."""
    for dtype in (torch.float32, torch.bfloat16):
        m = tiny_model([SWA, CSA, HCA], window=5, hca_ratio=8).to(dtype)
        for ps in (8, 16, 24):
            eng = Engine.from_hf(m, CacheConfig(page_size=ps, device_tokens=ps * 64,
                                                device_bytes=7 * frame_bytes(m, ps)))
            for name, pool in eng._prefix.pools.items():
                t = pool.storage.data
                assert t.data_ptr() % t.element_size() == 0, (name, ps, dtype)
                assert all(s % 1 == 0 for s in t.stride())


# ------------------------------------------------------------- --device-bytes

@pytest.mark.parametrize("text, value", [("40GiB", 40 * 2**30), ("40 GiB", 40 * 2**30),
                                         ("40gib", 40 * 2**30), ("1.5GiB", 3 * 2**29),
                                         ("1e3", 1000), ("4096", 4096), ("2KB", 2000)])
def test_byte_size_accepts(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "9" * 40, "", "GiB",
                                  "1.5.GiB", "0.5", "1e400", "40 GiBs", "40 G iB", "1e3e3",
                                  "NaNGiB", "infGiB", "1 2", "1e1000000", "1e999999GiB",
                                  "1E1000001KB", "-1e1000000",
                                  "1.0000000000000000000000000000001GB", "9" * 40 + "e-30"])
def test_byte_size_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_byte_size_of_a_fractional_byte_count_is_refused_or_whole():
    """'1.5' bytes is not a byte count: refuse it, or at least never round a fraction of a
    byte silently when no unit scales it to whole bytes."""
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size("1.5")


def _serve_error(capsys, argv):
    from shadowradix.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


@pytest.fixture
def no_uvicorn(monkeypatch):
    import socket

    def refuse(*_a, **_k):
        raise AssertionError("the server started")

    monkeypatch.setattr(socket, "socket", refuse)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "9" * 40, "1e400", "1e1000000"])
def test_serve_device_bytes_bad_values_exit_2_naming_the_flag(capsys, no_uvicorn, value):
    rc, err = _serve_error(capsys, ["serve", "--model", "tiny", "--device-bytes", value])
    assert rc == 2 and "Traceback" not in err
    assert "--device-bytes" in err.strip().splitlines()[-1]


def test_serve_device_bytes_with_window_tokens_exits_2(capsys, no_uvicorn):
    rc, err = _serve_error(capsys, ["serve", "--model", "tiny", "--device-bytes", "40GiB",
                                    "--window-tokens", "256"])
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "window" in line and "device" in line


def test_serve_device_bytes_with_window_tokens_names_the_flags(capsys, no_uvicorn):
    _, err = _serve_error(capsys, ["serve", "--model", "tiny", "--device-bytes", "40GiB",
                                   "--window-tokens", "256"])
    line = err.strip().splitlines()[-1]
    assert "--window-tokens" in line and "--device-bytes" in line, line


def test_serve_device_bytes_too_small_for_one_frame_fails_before_serving(capsys, no_uvicorn):
    """A --device-bytes that holds no frame is known from the model's config: the command
    must refuse it (exit 2, naming the flag) rather than start a server whose model then
    fails to load."""
    rc, err = _serve_error(capsys, ["serve", "--model", "tiny", "--device-bytes", "100"])
    assert rc == 2, err
    assert "--device-bytes" in err.strip().splitlines()[-1]


# ------------------------------------------------------------- the simulator's arena

def test_simulate_over_an_arena_with_a_host_tier():
    from shadowradix.layout import deepseek_v4_flash
    from shadowradix.sim.simulate import policy_choice, simulate
    from shadowradix.sim.trace import TraceRequest

    layout = deepseek_v4_flash()
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(60):
        conv = i % 7
        blocks = [conv * 1000 + j for j in range(2 + i // 7)]
        reqs.append(TraceRequest(i, len(blocks) * 512, int(rng.integers(1, 300)), tuple(blocks)))
    choice = policy_choice("shadowradix")
    for device_gb, host_gb in [(0.05, 0.2), (0.2, 0.0), (0.02, 1.0)]:
        out = simulate(reqs, layout, choice, device_gb, host_gb=host_gb, arena=True)
        assert out["arena"] is not None and out["requests"] == 60
        assert 0 <= out["hit_rate"] <= out["bound_hit_rate"] + 1e-9
        for wp in ("write_back", "write_through_selective"):
            simulate(reqs, layout, choice, device_gb, host_gb=host_gb or 0.1, arena=True,
                     write_policy=wp)


def test_simulate_arena_too_small_is_a_clear_value_error():
    from shadowradix.layout import deepseek_v4_flash
    from shadowradix.sim.simulate import policy_choice, simulate
    from shadowradix.sim.trace import TraceRequest

    req = [TraceRequest(0, 512, 4, (1,))]
    with pytest.raises(ValueError):
        simulate(req, deepseek_v4_flash(), policy_choice("shadowradix"), 1e-9, arena=True)


@pytest.mark.parametrize("arena", [True, False])
@pytest.mark.parametrize("device_gb, says", [(1e300, "device_gb"), (1e9, "int32 page ids")])
def test_simulate_a_huge_device_is_a_clear_value_error(arena, device_gb, says):
    """A device too large to count: its bytes overflow a float (1e300 GB), or its pages
    int32 ids (1e9 GB). Over an arena this was an OverflowError, and numpy's MemoryError
    for an 88 GiB frame table the arena made before its pools checked their ids."""
    from shadowradix.layout import deepseek_v4_flash
    from shadowradix.sim.simulate import policy_choice, simulate
    from shadowradix.sim.trace import TraceRequest

    req = [TraceRequest(0, 600, 4, (1, 2))]
    with pytest.raises(ValueError, match=says):
        simulate(req, deepseek_v4_flash(), policy_choice("shadowradix"), device_gb,
                 arena=arena)


def test_simulate_cli_a_huge_arena_exits_2(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 10, '
                     '"hash_ids": [1, 2]}\n')
    from shadowradix.cli import main

    for gb in ("1e300", "1e9"):
        assert main(["simulate", str(trace), "--arena", "--policy", "shadowradix",
                     "--device-gb", gb]) == 2


# ------------------------------------------------------------- random online traffic

@pytest.mark.parametrize("seed", range(4))
def test_random_online_traffic_with_aborts_in_a_tiny_arena_never_stalls(model, seed):
    """Requests that each fit alone arrive while others run, share prefixes, and some are
    aborted; the engine finishes every other one exact within a bounded number of steps
    (no livelock), and nothing leaks."""
    rng = np.random.default_rng(seed)
    frames = int(rng.integers(5, 10))
    step = int(rng.choice([1, 5, 16, 40]))
    eng = arena_engine(model, frames, step, host_tokens=int(rng.choice([0, 20])) * PS)
    longest = min(eng.max_sequence_len(), 60)
    bases = [rand_tokens(int(rng.integers(4, 30)), 4200 + seed * 10 + i) for i in range(3)]
    want: dict[str, list[int]] = {}
    aborted: set[str] = set()
    results = {}
    steps = 0
    for i in range(10):
        base = bases[int(rng.integers(0, 3))][:max(1, longest - 12)]
        prompt = (base + rand_tokens(int(rng.integers(1, 6)), 4300 + seed * 20 + i))
        prompt = prompt[:longest - 1]
        p = SamplingParams(max_new_tokens=int(rng.integers(1, longest - len(prompt) + 1)),
                           ignore_eos=True)
        rid = eng.add_request(prompt, p, return_logits=True)
        want[rid] = prompt
        for _ in range(int(rng.integers(0, 4))):
            for out in eng.step():
                if out.finished:
                    results[out.request_id] = out
            steps += 1
        if rng.random() < 0.2:
            eng.abort(rid)
            aborted.add(rid)
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
        steps += 1
        assert steps < 3000, "livelock"
    eng.check_integrity()
    for rid, prompt in want.items():
        if rid in aborted and rid not in results:
            continue
        out = results[rid]
        assert out.error is None, out.error
        check(model, prompt, out.result, greedy=True)
