"""A fault at any line of a pool's alloc, free, claim, unclaim or move (an interrupt
between two statements, as a signal arrives) changes nothing: the pool's books, the
arena's frames and the order of the free slots are as before the call. Before, an interrupt
after a free marked its pages free but before it put them back (or after a frame went back
to the arena) broke the books for good: the retry was refused as a double free (found by
an attack with line-level fault sweeps)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers import LineFault, tiny_layout

from shadowradix.pool.allocator import PagePool
from shadowradix.pool.arena import Arena, ArenaPool, plan_frames

ARENA_CODE = [f for cls in (Arena, ArenaPool) for f in vars(cls).values()
              if hasattr(f, "__code__")]  # every method, nested calls among them included


def _arena_state(arena: Arena, pools: dict[str, ArenaPool]) -> tuple:
    return (arena.owner.tolist(), arena._free[:arena._top].tolist(),
            {n: (p._in_use.tolist(), p._slots[:p._top].tolist(), p.used_pages, p.frames_held)
             for n, p in pools.items()})


def _ops(rng: np.random.Generator, pools: dict[str, ArenaPool], held: dict[str, list[int]]):
    """A random next operation over `pools` (those holding pages in `held`)."""
    name = str(rng.choice(list(pools)))
    pool, mine = pools[name], held[name]
    pick = rng.random()
    if mine and pick < 0.45:
        k = int(rng.integers(1, len(mine) + 1))
        return name, "free", np.asarray(rng.choice(mine, k, replace=False), np.int32)
    if mine and pick < 0.6:
        k = int(rng.integers(1, min(len(mine), 4) + 1))
        return name, "move", np.asarray(rng.choice(mine, k, replace=False), np.int32)
    return name, "alloc", int(rng.integers(0, max(min(pool.free_pages, 7), 0) + 1))


def _apply(pool: ArenaPool, op: str, arg, held: list[int]) -> None:
    if op == "alloc":
        held.extend(pool.alloc(arg).tolist())
    elif op == "free":
        pool.free(arg)
        for page in arg.tolist():
            held.remove(page)
    else:
        try:
            new = pool.move(arg)
        except ValueError:  # no room elsewhere: nothing moved
            return
        for old, page in zip(arg.tolist(), new.tolist(), strict=True):
            held[held.index(old)] = page


@pytest.mark.parametrize("seed", range(3))
def test_a_fault_at_any_line_of_an_arena_pools_call_changes_nothing(seed):
    layout = tiny_layout(4, window=5)
    arena = Arena(layout, 10 * plan_frames(layout).frame_bytes)
    pools = arena.pools()
    held: dict[str, list[int]] = {n: [] for n in pools}
    rng = np.random.default_rng(seed)
    faults = 0
    for _ in range(40):
        name, op, arg = _ops(rng, pools, held)
        with LineFault(ARENA_CODE) as count:  # how many lines the call runs
            _apply(copy.deepcopy(pools)[name], op, arg, list(held[name]))
        for nth in range(1, count.lines + 1):
            trial = copy.deepcopy((arena, pools, held))  # one arena, its pools share it
            t_arena, t_pools, t_held = trial
            before = _arena_state(t_arena, t_pools)
            with pytest.raises(KeyboardInterrupt), LineFault(ARENA_CODE, nth):
                _apply(t_pools[name], op, arg, t_held[name])
            faults += 1
            assert _arena_state(t_arena, t_pools) == before, (op, nth)
            t_arena.check_integrity(t_pools)
        _apply(pools[name], op, arg, held[name])
        arena.check_integrity(pools)
    assert faults > 500


def test_a_claim_and_its_unclaim_cut_short_change_nothing():
    layout = tiny_layout(4, window=5)
    arena = Arena(layout, 10 * plan_frames(layout).frame_bytes)
    pools = arena.pools()
    c2 = pools["c2"]
    pages = c2.alloc(7)
    c2.free(pages[[1, 4]])
    old = pages[[5]]
    with LineFault(ARENA_CODE) as count:
        copy.deepcopy(c2).claim(old)
    for nth in range(1, count.lines + 1):
        t_arena, t_pools = copy.deepcopy((arena, pools))
        before = _arena_state(t_arena, t_pools)
        with pytest.raises(KeyboardInterrupt), LineFault(ARENA_CODE, nth):
            t_pools["c2"].claim(old)
        assert _arena_state(t_arena, t_pools) == before, nth
    new = c2.claim(old)
    before = _arena_state(arena, pools)
    with LineFault(ARENA_CODE) as count:
        t_arena, t_pools = copy.deepcopy((arena, pools))
        t_pools["c2"].unclaim(new)
    for nth in range(1, count.lines + 1):
        t_arena, t_pools = copy.deepcopy((arena, pools))
        with pytest.raises(KeyboardInterrupt), LineFault(ARENA_CODE, nth):
            t_pools["c2"].unclaim(new)
        assert _arena_state(t_arena, t_pools) == before, nth
        t_pools["c2"].unclaim(new)  # and it can still be undone
        t_arena.check_integrity(t_pools)


def test_a_fault_at_any_line_of_a_fixed_pools_call_changes_nothing():
    pool = PagePool(tiny_layout().pools[0], 4, 12)
    code = [f for f in vars(PagePool).values() if hasattr(f, "__code__")]
    held = pool.alloc(5)
    for op, arg in (("alloc", 4), ("free", held[[1, 3, 4]]), ("alloc", 0), ("free", held[:1])):
        with LineFault(code) as count:
            getattr(copy.deepcopy(pool), op)(arg)
        for nth in range(1, count.lines + 1):
            trial = copy.deepcopy(pool)
            before = (trial._in_use.tolist(), trial._free[:trial._top].tolist())
            with pytest.raises(KeyboardInterrupt), LineFault(code, nth):
                getattr(trial, op)(arg)
            assert (trial._in_use.tolist(), trial._free[:trial._top].tolist()) == before
            trial.check_integrity()
        getattr(pool, op)(arg)
