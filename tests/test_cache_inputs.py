"""Hostile inputs to PrefixCache, its pools, the arena and the checkpoint policy: each is a
clear ValueError that changes nothing, never a crash later or silent corruption (found by an
attack; every test here failed before its fix)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_layout

from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers import PrefixCache

LAY = tiny_layout(4)


def _caches():
    fb = plan_frames(LAY).frame_bytes
    return {"fixed": PrefixCache(LAY, 8),
            "arena": PrefixCache(LAY, {}, arena=Arena(LAY, 20 * fb))}


@pytest.mark.parametrize("mode", ["fixed", "arena"])
def test_a_fractional_page_count_is_refused_and_leaves_the_pools_usable(mode):
    """alloc({'kv': 1.5}) raises TypeError after PagePool.alloc / Arena.take already did
    `_top -= n`: the free count becomes 5.5 (or the arena's 18.5) and every later
    allocation of that pool raises TypeError: the cache is bricked."""
    cache = _caches()[mode]
    with pytest.raises(ValueError):
        cache.alloc({"kv": 1.5})
    got = cache.alloc({"kv": 1})  # a valid allocation still works
    assert got is not None and got["kv"].size == 1


def test_a_negative_page_count_is_a_value_error_not_an_internal_assertion():
    """alloc({'kv': -3}): can_alloc says yes, then alloc trips its own 'eviction delivered
    less than evictable() promised' AssertionError (PagePool.alloc has a clear ValueError
    for n < 0 that is never reached)."""
    cache = _caches()["fixed"]
    with pytest.raises(ValueError):
        cache.alloc({"kv": -3})


@pytest.mark.parametrize("budget", [float("nan"), 1.5, True])
def test_a_budget_that_is_not_an_int_byte_count_is_refused(budget):
    """budget=nan passes `budget < 0` and then turns every `_short_bytes(...) > 0` test
    False: the budget is silently never enforced. (Arena(total_bytes=...) refuses non-ints.)"""
    with pytest.raises(ValueError):
        PrefixCache(LAY, 8, budget=budget)


@pytest.mark.parametrize("mode", ["fixed", "arena"])
def test_insert_with_a_page_id_twice_in_its_table_is_refused(mode):
    """The same page id in two cells of the table handed to insert is adopted twice: the
    tree then holds one page for two logical pages (check_integrity: 'shadowed twice' /
    'owners map names another node') and a later flush dies with numpy's 'could not
    broadcast' ValueError from deep inside eviction."""
    cache = _caches()[mode]
    pg = cache.alloc({n: 1 for n in LAY.pool_names})
    table = np.stack([np.repeat(pg[n], 2) for n in LAY.pool_names])
    with pytest.raises(ValueError, match="twice"):
        cache.insert(list(range(8)), table)
    cache.check_integrity(held=pg)  # nothing changed: the caller still holds its pages
    assert cache.tree.stats().nodes == 0


@pytest.mark.parametrize("mode", ["fixed", "arena"])
@pytest.mark.parametrize("shift", [1, 10**6])
def test_insert_of_page_ids_the_pool_never_handed_out_is_refused(mode, shift):
    """A page id that is free (shift 1) or past the pool (10**6) is adopted by the tree
    without a check; the tree then shadows a free page (or check_integrity / eviction dies
    with an IndexError)."""
    cache = _caches()[mode]
    pg = cache.alloc({n: 1 for n in LAY.pool_names})
    table = np.stack([pg[n] + shift for n in LAY.pool_names])
    with pytest.raises(ValueError, match="not in use"):
        cache.insert(list(range(4)), table)
    cache.check_integrity(held=pg)
    with pytest.raises(ValueError, match="integers"):
        cache.insert(list(range(4)), np.stack([pg[n] + 0.5 for n in LAY.pool_names]))


@pytest.mark.parametrize("every", [1.5, float("nan"), float("inf")])
def test_a_checkpoint_interval_that_is_not_an_integer_is_refused(every):
    """CheckpointPolicy(every_pages=1.5 / nan / inf) passes __post_init__ (it checks only
    `< 0`), and the first insert then raises TypeError ('float' object cannot be
    interpreted as an integer) from inside the tree."""
    from shadowradix.tree import CheckpointPolicy
    with pytest.raises(ValueError):
        CheckpointPolicy(every_pages=every)


@pytest.mark.parametrize("reserved", [10.5, float("nan"), float("inf")])
def test_arena_reserved_bytes_that_are_not_an_int_are_refused(reserved):
    """Arena checks total_bytes is an int >= 0 but not reserved_bytes: 10.5 / inf raise
    numpy's TypeError ('expected a sequence of integers'), and nan silently sets nothing
    apart (reserved_frames 0), unlike total_bytes' clear ValueError."""
    fb = plan_frames(LAY).frame_bytes
    with pytest.raises(ValueError):
        Arena(LAY, 100 * fb, reserved_bytes=reserved)


def test_numpy_integers_are_counts_like_ints():
    """The checks above take numpy's integers as ints (a review of them refused these)."""
    from shadowradix.sim.sizing import pages_for_shared_budget
    from shadowradix.tree import CheckpointPolicy

    budget = np.int64(8 * sum(LAY.page_bytes().values()))
    cache = PrefixCache(LAY, pages_for_shared_budget(LAY, int(budget)), budget=budget)
    assert cache.budget == budget
    assert cache.alloc({"kv": np.int32(2)})["kv"].size == 2
    assert CheckpointPolicy(every_pages=np.int64(4)).every_pages == 4
    fb = plan_frames(LAY).frame_bytes
    assert Arena(LAY, 100 * fb, reserved_bytes=np.int64(fb)).reserved_frames == 1
