"""A host copy that fails on the mover's thread is a fault of one step, never of the engine.

The n-th page copy raises inside ThreadMover's worker, under each write policy, either while
turn one backs up (or spills) what it computes, or while turn two loads it back from the host
after the device was flushed. Pages are poisoned when handed out (NaN), so a read of bytes
that never arrived shows in the logits. Every request finishes exact against transformers,
the copy error is counted, nothing raises, the engine keeps copying afterwards, and after a
full flush every page of both tiers is free."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fail_at
from test_engine import check, rand_tokens
from test_engine_faults import assert_clean_and_exact
from tiny_model import tiny_model

import shadowradix.tiers.mover as mover_module
from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.mover import ThreadMover

P = SamplingParams(max_new_tokens=5, ignore_eos=True)
POLICIES = ["write_through", "write_through_selective", "write_back"]


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def fail_copy(monkeypatch, nth: int) -> list[int]:
    """The n-th call of copy_pages on the mover's thread raises; returns the call count."""
    return fail_at(monkeypatch, mover_module, "copy_pages", nth, Injected)


def run_exact(model, eng: Engine, prompts: list[list[int]]) -> None:
    """Step until drained: no step raises, every request finishes once, exact."""
    ids = [eng.add_request(p, P, return_logits=True) for p in prompts]
    results = {}
    for _ in range(400):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                assert out.request_id not in results
                results[out.request_id] = out.result
    assert not eng.has_unfinished(), "the engine never drained"
    for rid, prompt in zip(ids, prompts, strict=True):
        check(model, prompt, results[rid])


def host_engine(model, policy: str) -> Engine:
    """Fixed pools (window_tokens set): the copies these tests count and fail are those of
    an 8-page device (tests/test_arena_default_attack.py faults the arena over a host)."""
    return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=128, window_tokens=128,
                                             host_tokens=1024, write_policy=policy,
                                             write_hit_threshold=1, debug_poison=True),
                          step_tokens=24)


def turn_two(model, policy: str) -> tuple[Engine, list[list[int]]]:
    """An engine whose device lost turn one (the host holds it), and turn two's prompts.
    Turn one runs twice, so that selective write-through sees its nodes hit."""
    eng = host_engine(model, policy)
    convs = [rand_tokens(40 + 6 * i, 900 + i) for i in range(3)]
    outs = eng.generate(convs, P)
    if policy == "write_through_selective":
        eng.generate(convs, P)
    turn2 = [c + o.output_ids + rand_tokens(20, 950 + i)
             for i, (c, o) in enumerate(zip(convs, outs, strict=True))]
    eng.cache.flush(tiers=("device",))  # turn 2 loads back from the host
    assert eng._prefix.tree.pages_held(eng.layout.pool_names[0], 1) > 0
    return eng, turn2


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_load_back_or_backup_in_turn_two_stays_exact(model, monkeypatch, policy, nth):
    eng, turn2 = turn_two(model, policy)
    calls = fail_copy(monkeypatch, nth)
    run_exact(model, eng, turn2)
    monkeypatch.undo()
    assert calls[0] >= nth, "the copy never failed"
    assert eng.stats()["host"]["copy_errors"] == 1
    assert_clean_and_exact(model, eng, turn2)


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_backup_that_never_landed_is_never_loaded_back(model, monkeypatch, policy, nth):
    """Turn one's n-th copy (a backup or spill) fails: its host shadow must go, or turn two,
    loading back from the host after the device is flushed, would read bytes never written."""
    eng = host_engine(model, policy)
    convs = [rand_tokens(40 + 6 * i, 900 + i) for i in range(4)]
    calls = fail_copy(monkeypatch, nth)
    for c in convs:  # each twice under selective write-through: the hit backs it up
        for _ in range(2 if policy == "write_through_selective" else 1):
            run_exact(model, eng, [c])
    eng.cache.flush(tiers=("device",))  # write-back spills here: may be the failing copy
    run_exact(model, eng, [rand_tokens(8, 990)])  # a step that collects the failure
    monkeypatch.undo()
    assert calls[0] >= nth, "the copy never failed"
    assert eng.stats()["host"]["copy_errors"] == 1
    eng.check_integrity()
    eng.cache.flush(tiers=("device",))
    turn2 = [c + rand_tokens(20, 950 + i) for i, c in enumerate(convs)]
    assert_clean_and_exact(model, eng, turn2)


def test_the_mover_reports_a_failure_once_and_copies_again():
    """The failed copy and the work queued behind it are void, reported once; the mover is
    not wedged: later copies run."""
    t = {("a", tier): __import__("torch").zeros(1, 8, 2) for tier in (0, 1)}
    t[("a", 1)][:, 0] = 5.0
    mover = ThreadMover(lambda name, tier: t[(name, tier)], workers=1)
    bad = mover.submit([("a", 1, np.array([99]), np.array([0]))])  # no page 99
    behind = mover.submit([("a", 1, np.array([0]), np.array([1]))])
    mover.wait(behind)  # never raises
    failed = mover.failures(behind)
    assert [ticket for ticket, _ in failed] == [bad, behind]
    assert failed[0][1] is not None and failed[1][1] is None
    assert mover.failures(behind) == []
    again = mover.submit([("a", 1, np.array([0]), np.array([2]))])
    assert mover.failures(again) == []
    assert float(t[("a", 0)][0, 2, 0]) == 5.0 and float(t[("a", 0)][0, 1, 0]) == 0.0
    mover.close()


def _drain(eng, prompts):
    ids = [eng.add_request(p, P, return_logits=True) for p in prompts]
    results, faults = {}, 0
    for _ in range(400):
        if not eng.has_unfinished():
            break
        try:
            outs = eng.step()
        except Injected:
            faults += 1
            continue
        for out in outs:
            assert out.error is None, out.error
            if out.finished:
                results[out.request_id] = out.result
    assert not eng.has_unfinished()
    return ids, results, faults


@pytest.mark.parametrize("nth", [1, 2])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_fault_in_forget_during_recover_keeps_requests_exact(model, monkeypatch, policy, nth):
    """A load-back fails, then forgetting its pages faults: the step raises, and on the
    next ones every request goes on exact. The failure had been collected before the
    fault, so the request reading the failed copy was never restarted and read pages whose
    bytes never arrived (NaN logits under debug poison). HostTier now keeps what failed and
    what left the tree until a `recover` gets through."""
    from shadowradix.tree.eviction import Eviction

    eng, turn2 = turn_two(model, policy)
    copies = fail_copy(monkeypatch, 1)           # the first load-back of turn two fails
    forgets = fail_at(monkeypatch, Eviction, "_forget_cells", nth, Injected)
    ids, results, faults = _drain(eng, turn2)
    monkeypatch.undo()
    assert copies[0] >= 1 and forgets[0] >= nth and faults == 1
    for rid, prompt in zip(ids, turn2, strict=True):
        check(model, prompt, results[rid])
    eng.check_integrity()
