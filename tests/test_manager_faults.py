"""A fault at any line of a request's life in the cache manager (admission, growth,
hand-overs to the tree, giving pages up, finishing; an interrupt between two statements,
as a signal arrives), then the documented recovery (the caller aborts the lease), leaves
no page leaked, none freed twice and none both the tree's and the request's. Before, an
interrupt between an allocation's return and the lease's record of it leaked the pages;
one after the tree adopted a hand-over's pages but before the lease let go of them had
the abort free pages the tree still named (the next request would write into them: KV
corruption); and one between freeing given-up pages and unmarking them had the abort free
them again; and one as a lock returned left it held by nobody, its prefix pinned for
good (found by an attack with line-level fault sweeps)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import interrupted_copies, tiny_layout

from shadowradix.pool.arena import Arena, plan_frames
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.radix import ShadowRadix

PS = 4
CODE = [*(getattr(CacheManager, name) for name in (
    "admit", "grow", "_alloc", "_file", "_drop_fresh", "cache_prefix", "_hand_over",
    "_reclaim", "_give_up", "_share_held", "finish") if hasattr(CacheManager, name)),
    PrefixCache.lock, ShadowRadix.lock]


def _request(manager: CacheManager, tokens: np.ndarray) -> None:
    """One request, a page at a time, its prefix handed over as it goes; aborted on any
    fault (the engine's recovery: its step aborts or orphans the lease)."""
    lease = manager.admit(tokens, PS)
    assert lease is not None
    try:
        done = lease.cached
        while done < tokens.size:
            done = min(tokens.size, done + PS)
            assert manager.grow(lease, done)
            if done < tokens.size:
                manager.cache_prefix(lease, tokens, done)
        manager.finish(lease, tokens, done)
    except BaseException:
        manager.abort(lease)
        raise


@pytest.mark.parametrize("arena", [False, True])
def test_a_fault_at_any_line_of_a_request_leaks_nothing_and_frees_nothing_twice(arena):
    layout = tiny_layout(PS, window=5)
    frames = Arena(layout, 40 * plan_frames(layout).frame_bytes) if arena else None
    cache = PrefixCache(layout, 40, CheckpointPolicy(every_pages=2), arena=frames)
    manager = CacheManager(cache)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 6 * PS + 1).astype(np.int32)
    _request(manager, tokens[:3 * PS + 1])  # a cached prefix to match and share
    for nth, trial in interrupted_copies(CODE, manager, lambda m: _request(m, tokens)):
        trial.release_orphans(set())
        trial.check_integrity()
        _request(trial, tokens)  # the request again: it goes through
        trial.cache.flush()
        trial.check_integrity()
        assert not {n: p.used_pages for n, p in trial.cache.pools.items() if p.used_pages}, nth
