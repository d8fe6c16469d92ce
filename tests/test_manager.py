"""Check, then act: refusals and look-ahead change nothing (issue: one owner of a
request's cache life). Each of these failed on the code before the CacheManager."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import serve, tiny_layout

from shadowradix.sim.replay import CountingMover
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager

PS = 4


def test_an_allocation_that_cannot_fit_evicts_nothing():
    """10 pages holding one cached sequence: alloc(11) is refused and the sequence still
    hits (it used to evict everything first, then fail)."""
    cache = PrefixCache(tiny_layout(PS), 10)
    tokens = list(range(33))  # 8 full pages + 1
    serve(cache, tokens)
    before = cache.match(tokens, record=False).prefix_len
    assert before == 32
    assert cache.alloc({p.name: 11 for p in cache.layout.pools}) is None
    assert cache.match(tokens).prefix_len == before
    assert sum(cache.evicted.values()) == 0


def test_a_refused_admission_keeps_the_cache():
    cache = PrefixCache(tiny_layout(PS), 10)
    manager = CacheManager(cache)
    tokens = np.arange(33, dtype=np.int32)
    lease = manager.admit(tokens, chunk=33)
    assert lease is not None
    manager.finish(lease, tokens, 33)
    held = cache.tree.stats().as_dict()
    assert manager.admit(np.arange(100, 160, dtype=np.int32), chunk=60) is None
    assert cache.tree.stats().as_dict() == held
    assert manager.admit(tokens, chunk=4).cached == 32  # type: ignore[union-attr]


def test_peek_changes_nothing_and_selective_backup_counts_only_real_matches():
    """Look-ahead (where a storage read should start, whether a request fits) must not
    count as a hit: write_through_selective backs a prefix up after 2 real matches."""
    layout = tiny_layout(PS)
    cache = PrefixCache(layout, 32, host_pages=32)
    host = HostTier(cache, CountingMover(),  # type: ignore[arg-type]
                    "write_through_selective", hit_threshold=2)
    manager = CacheManager(cache, host)
    tokens = np.arange(41, dtype=np.int32)
    lease = manager.admit(tokens, chunk=41)
    manager.finish(lease, tokens, 41)  # type: ignore[arg-type]
    hits = [n.hits for n in cache.tree.nodes()]
    for _ in range(5):
        cache.peek(tokens)
        manager.prefetch(tokens)
    assert [n.hits for n in cache.tree.nodes()] == hits
    assert host.counts["backed_up"] == 0
    for expect_backup in (False, True):
        lease = manager.admit(tokens, chunk=1)
        assert lease is not None and lease.cached == 40
        manager.abort(lease)
        assert (host.counts["backed_up"] > 0) is expect_backup


def test_grow_refusal_changes_nothing_and_preempt_keeps_the_prefix():
    cache = PrefixCache(tiny_layout(PS), 13)
    manager = CacheManager(cache)
    a, b = np.arange(30, dtype=np.int32), np.arange(100, 140, dtype=np.int32)
    la = manager.admit(a, chunk=16)  # 4 pages per pool
    lb = manager.admit(b, chunk=24)  # 6
    assert la is not None and lb is not None
    manager.cache_prefix(la, a, 16)
    free = {n: p.free_pages for n, p in cache.pools.items()}
    assert not manager.grow(la, 30)  # 4 more: b holds too many
    assert {n: p.free_pages for n, p in cache.pools.items()} == free
    manager.preempt(lb, b, 16)
    assert manager.grow(la, 30)
    manager.finish(la, a, 30)
    again = manager.admit(b, chunk=8)
    assert again is not None and again.cached == 16  # resumes where it was preempted
    manager.abort(again)
    manager.check_integrity()
    assert not manager.leases


@pytest.mark.parametrize("bad", [1.5, True, 0])
def test_step_tokens_must_be_a_positive_int(bad):
    from shadowradix.engine.scheduler import Scheduler

    with pytest.raises(ValueError, match="step_tokens"):
        Scheduler(CacheManager(PrefixCache(tiny_layout(PS), 4)), bad)


@pytest.mark.parametrize("bad", [-1, 3.0, False, "5"])
def test_a_prompt_length_that_is_not_a_token_count_is_refused_at_admission(bad):
    cache = PrefixCache(tiny_layout(PS), 10)
    manager = CacheManager(cache)
    with pytest.raises(ValueError, match="prompt must be an int"):
        manager.admit(np.arange(9, dtype=np.int32), chunk=9, prompt=bad)
    assert not manager.leases and cache.pools["swa"].used_pages == 0


def test_a_finished_request_marks_where_its_prompt_ended():
    """The manager tells the tree the prompt it admitted (not the tokens it finishes with):
    the leaf remembers the prompt's last page boundary, for the resume learning."""
    from shadowradix.tree import CheckpointPolicy

    cache = PrefixCache(tiny_layout(PS), 40, CheckpointPolicy(learn_resume=True))
    manager = CacheManager(cache)
    prompt = np.arange(10, dtype=np.int32)  # 2 full pages and a half
    lease = manager.admit(prompt, chunk=10)
    assert lease is not None
    seq = np.arange(23, dtype=np.int32)  # the reply takes it to 5 full pages
    assert manager.grow(lease, 23)
    manager.finish(lease, seq, 23)
    leaf = cache.match(seq, record=False).node
    assert (leaf.end_page, leaf.prompt_end) == (5, 2)


def test_live_leases_are_kept_in_admission_order():
    """What the manager does over its live leases (sharing held copies in `_room`,
    aborting orphans) goes in admission order, so a replay frees the same pages in the same
    order in every run; a set iterated them in the order of their objects' addresses."""
    cache = PrefixCache(tiny_layout(PS), 400)
    manager = CacheManager(cache)
    leases = [manager.admit(np.arange(i * 10, i * 10 + 5, dtype=np.int32), chunk=5)
              for i in range(40)]
    assert all(lease is not None for lease in leases)
    for lease in leases[::3]:
        manager.abort(lease)
    live = [lease for i, lease in enumerate(leases) if i % 3]
    assert list(manager.leases) == live
    assert manager.release_orphans(set(live[5:])) == 5
    assert list(manager.leases) == live[5:]


@pytest.mark.parametrize("ps, window", [(2, 1), (4, 3), (8, 7)])
@pytest.mark.parametrize("policy", ["shadowradix", "end-only", "no-shadows"])
def test_under_a_shared_budget_a_request_that_fits_ever_runs_alone(ps, window, policy):
    """`fits_ever` (and `chunk_end`) under a shared byte budget (the simulator's default)
    checked only each pool's ceiling, which is the whole budget: requests it said fit were
    refused or could not grow alone on an empty cache (3,795 such lengths over a grid of
    layouts and budgets). Now the pages a request takes alone are counted in bytes, each
    pool at its peak (those peaks need not coincide, so a few lengths past the first one
    refused may still run): what it admits runs."""
    from shadowradix.sim.sizing import pages_for_shared_budget
    from shadowradix.tree.policy import named_policy

    lay = tiny_layout(ps, window)
    for mult in (2, 3, 5):
        budget = mult * sum(lay.page_bytes().values())
        for n in range(1, 16 * ps):
            cache = PrefixCache(lay, pages_for_shared_budget(lay, budget),
                                named_policy(policy), budget=budget)
            manager = CacheManager(cache)
            seq = np.arange(n, dtype=np.int32)
            fits = manager.fits_ever(n)
            lease = manager.admit(seq, n, fit=True)
            ran = lease is not None
            done = 0
            while ran and done < n:
                end = manager.chunk_end(lease, done, n)
                ran = manager.grow(lease, end)
                if ran and end < n:
                    manager.cache_prefix(lease, seq, end)
                done = end
            if lease is not None:
                (manager.finish(lease, seq, n) if ran else manager.abort(lease))
                manager.check_integrity()
            assert ran or not fits, (mult, n)
            if not fits:
                assert n > 1  # the budget holds a page of every pool: one token fits
                break


@pytest.mark.parametrize("mode", ["fixed", "budget", "write_back", "write_through"])
@pytest.mark.parametrize("point", ["_remove_leaf", "_let_go", "_table_pages",
                                   "_drop_dead_leaf"])
def test_a_fault_inside_any_eviction_walk_strands_no_page(mode, point, monkeypatch):
    """Whatever the tiers, a tree walk that raises after letting pages go leaves them to
    the cache (`tree.stranded`), which frees them at its next release: before, they leaked
    (in use, owned by nobody). Faults at the 1st to 6th call of each point."""
    from helpers import fail_at

    from shadowradix.sim.sizing import pages_for_shared_budget
    from shadowradix.tree.eviction import Eviction

    layout = tiny_layout(4)
    for nth in range(1, 7):
        if mode == "budget":
            budget = 6 * sum(layout.page_bytes().values())
            cache = PrefixCache(layout, pages_for_shared_budget(layout, budget), budget=budget)
        else:
            cache = PrefixCache(layout, 8, host_pages=None if mode == "fixed" else 12)
        host = None if cache.host_pools == {} else HostTier(
            cache, CountingMover(), mode)  # type: ignore[arg-type]
        manager = CacheManager(cache, host)
        calls = fail_at(monkeypatch, Eviction, point, nth, MemoryError)
        raised = False
        for i in range(12):
            tokens = np.arange(i * 50, i * 50 + 13, dtype=np.int32)
            try:
                lease = manager.admit(tokens, 13)
                if lease is not None and manager.grow(lease, 13):
                    manager.finish(lease, tokens, 13)
                elif lease is not None:
                    manager.abort(lease)
            except MemoryError:
                raised = True
                manager.release_orphans(set())
        monkeypatch.undo()
        manager.check_integrity()
        if raised:
            cache.flush()
            if host is not None:
                cache.flush(1)
            manager.check_integrity()
            assert all(p.used_pages == 0 for p in cache.pools.values()), (nth, calls)
