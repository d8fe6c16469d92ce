"""An exception at any step of a request's cache life leaves no trace (issue 9, item 5).

An exception is injected at the n-th call of each step of admission, growth, insertion,
backup, finish and preemption while a second turn runs through a device too small for
all of it at once, over a host tier. The generate raises; afterwards every page has
exactly one owner, a full flush gives every pool back, and the same turn run again is
exact against transformers (pages are poisoned when handed out, so a stale page shows)."""

from __future__ import annotations

import contextlib

import pytest
from helpers import fail_at
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.radix import ShadowRadix
from shadowradix.tree.tier import DEVICE

P = SamplingParams(max_new_tokens=5, ignore_eos=True)

# (owner, method): every step a request's cache life goes through.
STEPS = [
    (ShadowRadix, "match_prefix"), (ShadowRadix, "record"), (ShadowRadix, "lock"),
    (PrefixCache, "alloc"), (HostTier, "load"), (HostTier, "after_match"),
    (CacheManager, "grow"), (CacheManager, "cache_prefix"), (ShadowRadix, "insert"),
    (PrefixCache, "release_queued"), (HostTier, "backup"), (ShadowRadix, "unlock"),
    (CacheManager, "finish"), (CacheManager, "preempt"), (HostTier, "_submit"),
]


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def turn_two(model, policy: str, step: int):
    """An engine whose device lost turn one (the host holds it), and turn two's prompts."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=64, host_tokens=1024,
                                            write_policy=policy, debug_poison=True),
                         step_tokens=step)
    convs = [rand_tokens(40 + 6 * i, 900 + i) for i in range(3)]
    outs = eng.generate(convs, P)
    turn2 = [c + o.output_ids + rand_tokens(20, 950 + i)
             for i, (c, o) in enumerate(zip(convs, outs, strict=True))]
    eng.cache.flush(tiers=("device",))  # turn 2 loads back from the host
    return eng, turn2


def assert_clean_and_exact(model, eng, turn2) -> None:
    assert not eng.has_unfinished()
    eng.check_integrity()
    assert not eng.manager.leases
    results = eng.generate(turn2, P, return_logits=True)
    for t, r in zip(turn2, results, strict=True):
        check(model, t, r)
    eng.cache.flush(tiers=("device", "host"))
    eng.check_integrity()
    for tier in (eng._prefix.pools, eng._prefix.host_pools):
        for name, pool in tier.items():
            assert pool.free_pages == pool.num_pages, f"{name}: pages leaked"
    eng.close()


@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("owner,method", STEPS, ids=[f"{o.__name__}.{m}" for o, m in STEPS])
def test_an_exception_at_any_step_leaves_no_trace(model, monkeypatch, owner, method, nth):
    step = 8 if method == "preempt" else 24  # small chunks: decodes outgrow the device
    eng, turn2 = turn_two(model, "write_through", step)
    fail_at(monkeypatch, owner, method, nth, Injected)
    with pytest.raises(Injected) if nth == 1 else contextlib.nullcontext():
        try:
            eng.generate(turn2, P)
        except Injected:
            if nth == 1:
                raise
    monkeypatch.undo()
    assert_clean_and_exact(model, eng, turn2)


@pytest.mark.parametrize("nth", [1, 2])
def test_a_write_back_copy_that_never_starts_leaves_no_host_shadow(model, monkeypatch, nth):
    """Under write-back, eviction records host copies before they are submitted; when the
    submission fails, those host shadows go (they would serve pages never written)."""
    eng, turn2 = turn_two(model, "write_back", 24)
    submit, spills = HostTier._submit, [0]

    def failing(self, copies):
        if any(tier == DEVICE for _, tier, _, _ in copies):  # device -> host: a spill
            spills[0] += 1
            if spills[0] == nth:
                raise Injected(f"spill copy {nth}")
        return submit(self, copies)

    monkeypatch.setattr(HostTier, "_submit", failing)
    with contextlib.suppress(Injected):
        eng.generate(turn2, P)
    monkeypatch.undo()
    assert spills[0] >= nth, "the spill never failed"
    assert_clean_and_exact(model, eng, turn2)
