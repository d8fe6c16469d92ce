"""Example-based tests of ShadowRadix behaviour, one rule per test."""

import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_sound, page_key, serve, tiny_layout

from shadowradix.layout import full_attention, sliding_window
from shadowradix.tiers import PrefixCache
from shadowradix.tree import CheckpointPolicy, ShadowRadix

PS = 4


def seq(*parts: int, n: int = PS) -> list[int]:
    """Tokens: one page of `n` copies of each part id (distinct parts, distinct pages)."""
    return [p for p in parts for _ in range(n)]


def fresh(pages: int = 64, policy: CheckpointPolicy | None = None, **layout) -> tuple:
    cache = PrefixCache(tiny_layout(PS, **layout), pages, policy)
    return cache, [{} for _ in cache.layout.pools]


def test_match_on_empty_tree_is_zero():
    cache, _ = fresh()
    m = cache.match(seq(1, 2, 3))
    assert (m.prefix_len, m.logical_len) == (0, 0) and m.node is cache.tree.root


def test_full_hit_is_capped_one_token_short():
    cache, content = fresh()
    a = seq(1, 2, 3)
    serve(cache, a, content)
    m = cache.match(a)  # 12 tokens: resume at most at 11 -> page boundary 8
    assert m.prefix_len == 8
    assert_sound(cache, a, m, content)
    m = cache.match(a + [9])
    assert m.prefix_len == 12
    assert_sound(cache, a + [9], m, content)
    cache.check_integrity(held={})


def test_unbounded_memory_never_tombstones_and_resumes_anywhere():
    cache, content = fresh(pages=1000)
    serve(cache, seq(1, 2, 3, 4, 5), content)
    for cut in range(1, 5):
        probe = seq(*range(1, 1 + cut)) + [99]
        assert cache.match(probe).prefix_len == cut * PS
    assert cache.tree.stats().pools["swa"].tombstones == 0


def test_tombstoned_window_keeps_compressed_pages_and_end_checkpoint():
    cache, content = fresh()
    a = seq(1, 2, 3, 4)
    serve(cache, a, content)
    freed = cache.evict("swa", 3)
    assert freed == 3  # the window pages outside the kept end-of-sequence checkpoint go first
    st = cache.tree.stats().pools
    assert st["swa"].tombstones == 3 and st["kv"].pages == 4 and st["c2"].pages == 4
    # Mid-sequence resume points lost their window: resume falls back to 0 ...
    m = cache.match(seq(1, 2) + [99])
    assert m.prefix_len == 0 and m.logical_len == 8
    # ... but the end-of-sequence checkpoint (next turn of a conversation) still hits.
    m = cache.match(a + [99])
    assert m.prefix_len == 16
    assert_sound(cache, a + [99], m, content)
    cache.check_integrity(held={})


def test_insert_refills_tombstones_from_a_recomputing_request():
    cache, content = fresh()
    serve(cache, seq(1, 2, 3, 4), content)
    cache.evict("swa", 3)
    b = seq(1, 2) + [7]
    serve(cache, b, content)  # recomputes pages 0..1 and hands over fresh window pages
    m = cache.match(b)
    assert m.prefix_len == 8
    assert_sound(cache, b, m, content)
    cache.check_integrity(held={})


def test_branch_point_is_learned_second_request_marks_third_hits():
    cache, content = fresh(policy=CheckpointPolicy(eager_window_release=True))
    system = [1, 2, 3]
    serve(cache, seq(*system, 10), content)
    m2, _ = serve(cache, seq(*system, 20), content)
    assert m2.prefix_len == 0 and m2.logical_len == 12  # no window kept at the branch yet
    m3, _ = serve(cache, seq(*system, 30), content)
    assert m3.prefix_len == 12  # the second request left a checkpoint at the branch
    assert_sound(cache, seq(*system, 30), m3, content)
    cache.check_integrity(held={})


def test_without_branch_points_the_third_request_misses():
    policy = CheckpointPolicy(eager_window_release=True, branch_points=False)
    cache, content = fresh(policy=policy)
    for tail in (10, 20, 30):
        m, _ = serve(cache, seq(1, 2, 3, tail), content)
    assert m.prefix_len == 0


def test_eager_release_hands_back_out_of_window_pages_at_insert():
    cache, _ = fresh(policy=CheckpointPolicy(eager_window_release=True))
    serve(cache, seq(1, 2, 3, 4))
    st = cache.tree.stats().pools
    assert st["swa"].pages == 1 and st["state"].pages == 1 and st["kv"].pages == 4
    assert cache.pools["swa"].used_pages == 1


def test_periodic_checkpoints_survive_window_eviction():
    cache, content = fresh(policy=CheckpointPolicy(every_pages=2))
    serve(cache, seq(1, 2, 3, 4, 5), content)
    assert cache.evict("swa", 2) == 2  # pages 0 and 2: not part of a kept checkpoint
    for cut, want in ((1, 0), (2, 8), (3, 8), (4, 16), (5, 20)):
        assert cache.match(seq(*range(1, 1 + cut)) + [99]).prefix_len == want, cut


def test_kept_checkpoints_go_last():
    cache, _ = fresh(policy=CheckpointPolicy(every_pages=2))
    serve(cache, seq(1, 2, 3, 4))
    assert cache.evict("swa", 1) >= 1
    assert cache.match(seq(1, 2, 3, 4, 5)).prefix_len == 16  # end checkpoint untouched
    cache.evict("swa", 100)
    assert cache.tree.stats().nodes == 0  # no checkpoint left: the leaf was dead weight


def test_locked_prefix_survives_any_eviction():
    cache, content = fresh()
    a = seq(1, 2, 3)
    serve(cache, a, content)
    m = cache.match(a + [5])
    handle = cache.lock(m)
    cache.flush()
    for name in cache.layout.pool_names:
        cache.evict(name, 1000)
    again = cache.match(a + [5])
    assert again.prefix_len == 12
    # ALL pools keep the whole prefix; window and state only what the resume reads.
    assert np.array_equal(again.page_table[:, 2], m.page_table[:, 2])
    assert np.array_equal(again.page_table[:2], m.page_table[:2])
    assert (again.page_table[2:, :2] == -1).all()
    assert_sound(cache, a + [5], again, content)
    cache.unlock(handle)
    cache.flush()
    assert cache.match(a + [5]).prefix_len == 0
    assert all(p.used_pages == 0 for p in cache.pools.values())
    cache.check_integrity(held={})


def test_window_lock_covers_only_the_pages_before_the_resume_point():
    cache, _ = fresh()
    a = seq(1, 2, 3, 4)
    serve(cache, a, None)
    handle = cache.lock(cache.match(a + [5]))
    assert cache.evict("swa", 100) == 3  # pages 0..2 are out of the locked window
    assert cache.match(a + [5]).prefix_len == 16
    cache.unlock(handle)


def test_duplicate_pages_come_back_to_the_caller():
    cache, _ = fresh()
    a = seq(1, 2, 3)
    m1 = cache.match(a)
    m2 = cache.match(a)
    h1, h2 = cache.lock(m1), cache.lock(m2)
    tables = []
    for _ in range(2):
        got = cache.alloc({p.name: 3 for p in cache.layout.pools})
        tables.append(np.stack([got[name] for name in cache.layout.pool_names]))
    first = cache.tree.insert(a, tables[0])
    assert all(v.size == 0 for v in first.to_free.values())
    second = cache.tree.insert(a, tables[1])
    assert second.cached_pages == 3
    for row, name in enumerate(cache.layout.pool_names):
        assert sorted(second.to_free[name].tolist()) == sorted(tables[1][row].tolist())
        cache.pools[name].free(second.to_free[name])
    cache.unlock(h1)
    cache.unlock(h2)
    cache.check_integrity(held={})


def test_evict_zero_is_a_noop_and_reports_exactly_what_it_frees():
    cache, _ = fresh()
    serve(cache, seq(1, 2, 3))
    serve(cache, seq(4, 5))
    before = {n: p.used_pages for n, p in cache.pools.items()}
    assert all(v.size == 0 for v in cache.tree.evict("kv", 0).freed.values())
    result = cache.tree.evict("kv", 1)
    cache.release(result)  # a cache's tree: the cache frees what its walks let go
    for name, pages in result.freed.items():
        assert cache.pools[name].used_pages == before[name] - pages.size
    assert result.count("kv") >= 1
    cache.check_integrity(held={})


def test_no_shadows_policy_drops_whole_leaves_for_window_pressure():
    cache, _ = fresh(policy=CheckpointPolicy(tombstones=False))
    serve(cache, seq(1, 2, 3))
    serve(cache, seq(4, 5))
    cache.evict("swa", 1)
    st = cache.tree.stats()
    assert st.pools["swa"].tombstones == 0 and st.pools["kv"].pages < 5


def test_wide_window_needs_several_pages():
    cache, content = fresh(window=7)  # W - 1 = 6 tokens: two pages of 4 before the resume point
    a = seq(1, 2, 3, 4)
    serve(cache, a, content)
    assert cache.evict("swa", 2) == 2
    assert cache.tree.stats().pools["swa"].pages == 2
    m = cache.match(a + [9])
    assert m.prefix_len == 16
    assert_sound(cache, a + [9], m, content)


def test_full_attention_layout_resumes_anywhere():
    cache = PrefixCache(full_attention(layers=1, kv_heads=1, head_dim=2, page_size=PS), 64)
    serve(cache, seq(1, 2, 3))
    assert cache.match(seq(1, 2) + [0]).prefix_len == 8
    cache.flush()
    assert cache.pools["kv"].used_pages == 0


def test_sliding_window_only_layout_drops_dead_leaves():
    cache = PrefixCache(sliding_window(3, layers=1, kv_heads=1, head_dim=2, page_size=PS), 64)
    serve(cache, seq(1, 2, 3))
    assert cache.match(seq(1, 2) + [0]).prefix_len == 8
    cache.flush()
    assert cache.tree.stats().nodes == 0 and cache.pools["swa"].used_pages == 0


def test_match_splits_so_a_node_ends_at_the_resume_point():
    cache, _ = fresh()
    serve(cache, seq(1, 2, 3, 4))
    m = cache.match(seq(1, 2) + [9])
    assert m.node.end_page == 2
    cache.check_integrity(held={})


def test_lock_and_unlock_misuse_raise():
    cache, _ = fresh()
    serve(cache, seq(1, 2))
    h = cache.lock(cache.match(seq(1, 2, 3)))
    cache.unlock(h)
    with pytest.raises(ValueError, match="already released"):
        cache.unlock(h)
    m = cache.match(seq(1, 2, 3))
    cache.flush()
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m)


def test_bad_tokens_and_tables_are_refused():
    tree = ShadowRadix(tiny_layout(PS))
    with pytest.raises(ValueError, match="1-D"):
        tree.match_prefix([[1, 2]])
    with pytest.raises(ValueError, match="integers"):
        tree.match_prefix([1.5, 2.0])
    with pytest.raises(ValueError, match="int32"):
        tree.match_prefix([2**40])
    with pytest.raises(ValueError, match="pages must be"):
        tree.insert(seq(1, 2), np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="pages must be"):
        tree.insert(seq(1, 2), np.zeros((4, 2), dtype=np.int32), start=1)


def test_check_integrity_names_what_disagrees():
    cache, _ = fresh()
    serve(cache, seq(1, 2, 3))
    cache.tree._held[0][0] += 1
    with pytest.raises(AssertionError, match="pool 'kv'.*counted"):
        cache.check_integrity()
    cache.tree._held[0][0] -= 1
    node = next(cache.tree.nodes())
    node.full_lock = -1
    with pytest.raises(AssertionError, match="negative lock"):
        cache.check_integrity()


def test_leak_is_reported():
    cache, _ = fresh()
    cache.alloc({"kv": 2})
    with pytest.raises(AssertionError, match="leak"):
        cache.check_integrity(held={})


def test_stats_count_pages_locks_tombstones_and_checkpoints():
    cache, _ = fresh()
    serve(cache, seq(1, 2, 3, 4))
    handle = cache.lock(cache.match(seq(1, 2, 3, 4, 5)))
    cache.evict("swa", 100)
    st = cache.stats()
    assert st["pools"]["kv"] | {"pages": 4, "locked": 4, "evictable": 0} == st["pools"]["kv"]
    assert st["pools"]["swa"]["tombstones"] == 3 and st["pools"]["swa"]["locked"] == 1
    assert st["resume_points"] == 1 and st["kept_checkpoints"] == 1
    cache.unlock(handle)


def test_tree_package_does_not_import_torch():
    code = ("import sys, shadowradix, shadowradix.tree, shadowradix.sim, shadowradix.tiers; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_split_during_insert_does_not_misroute_the_walk():
    # [A B C] has children D and E. Inserting [A B D] (no match first, as for a request
    # that was admitted before [A B C] existed) splits [A B | C] inside insert; the walk
    # must stop there and not look for D under C, where D sits one page deeper.
    cache, content = fresh()
    a, b, c, d, e = 1, 2, 3, 4, 5

    def insert_fresh(tokens: list[int]) -> None:
        n = len(tokens) // PS
        got = cache.alloc({p.name: n for p in cache.layout.pools})
        own = np.stack([got[name] for name in cache.layout.pool_names])
        for row in range(len(cache.layout.pools)):
            for i, page in enumerate(own[row].tolist()):
                content[row][page] = page_key(tokens, i, row, PS)
        cache.insert(tokens, own)

    for tokens in (seq(a, b, c, d), seq(a, b, c, e), seq(a, b, d)):
        insert_fresh(tokens)
        cache.check_integrity(held={})
    for probe in (seq(a, b, c, d, 9), seq(a, b, d, 9), seq(a, b, c, e, 9)):
        m = cache.match(probe)
        assert m.prefix_len == len(probe) - PS
        assert_sound(cache, probe, m, content)


def test_an_insert_splitting_a_leaf_drops_the_part_left_without_a_resume_point():
    """A leaf whose one resume point is its first page, and a sequence of exactly that page
    (its match stops a page short, so the match splits nothing): the insert splits the
    leaf there, and the part past the split holds no resume point. It goes at once, its
    pages freed, instead of an unlocked leaf nothing can resume from (check_integrity)."""
    cache, content = fresh(window=1)  # a one-token window: resuming needs only the state
    serve(cache, seq(1, 2, 3), content)
    leaf = next(n for n in cache.tree.nodes() if n is not cache.tree.root)
    row = cache.layout.index("state")
    bad = [[np.empty(0, np.int32) for _ in cache.layout.pools]]
    bad[0][row] = leaf.pages[row, 1:].copy()  # the state of pages 1 and 2 never arrived
    cache.release(cache.tree.forget(bad))
    cache.check_integrity(held={})
    kv_before = cache.pools["kv"].used_pages
    m, _ = serve(cache, seq(1), content)
    assert m.prefix_len == 0
    cache.check_integrity(held={})
    assert [n.n_pages for n in cache.tree.nodes() if n is not cache.tree.root] == [1]
    assert cache.pools["kv"].used_pages == kv_before - 2
