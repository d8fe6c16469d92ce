"""One byte budget's eviction (ShadowRadix.evict_bytes): what its loose pass lets go."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_layout

from shadowradix.tree import ShadowRadix
from shadowradix.tree.policy import DEFAULT, CheckpointPolicy


def _tree(policy: CheckpointPolicy, pages: int, seqs: int = 2) -> tuple[ShadowRadix, list]:
    """A tree holding `seqs` finished sequences of `pages` pages each, every page of every
    pool (distinct ids per pool), as a request hands them over."""
    layout = tiny_layout(page_size=4, window=3)  # swa needs 1 page before a resume point
    tree = ShadowRadix(layout, policy)
    rng = np.random.default_rng(0)
    nxt = 0
    seqs_tokens = []
    for _ in range(seqs):
        tokens = rng.integers(0, 1000, pages * layout.page_size).tolist()
        table = np.arange(nxt, nxt + len(layout.pools) * pages, dtype=np.int32).reshape(
            len(layout.pools), pages)
        nxt += table.size
        tree.insert(tokens, table, finished=True)
        seqs_tokens.append(tokens)
    return tree, seqs_tokens


@pytest.mark.parametrize("policy", [CheckpointPolicy(), DEFAULT], ids=["end-only", "default"])
def test_a_nodes_loose_state_goes_with_its_loose_window(policy: CheckpointPolicy) -> None:
    """Asked for one window page's bytes, the loose pass lets go the oldest node's loose
    window pages and, with them, its loose state pages at the same resume points (useless
    without the window before them): no loose state outlives its window, no kept
    checkpoint goes, and the newer sequence keeps every resume point."""
    tree, (old, new) = _tree(policy, pages=6)
    layout = tree.layout
    pb = layout.page_bytes()
    row_bytes = [pb[p.name] for p in layout.pools]
    swa, state = layout.index("swa"), layout.index("state")
    assert row_bytes[swa] > row_bytes[state]
    before = tree.match_prefix(old + [1], record=False)
    kept_cols = int(before.page_table.shape[1])

    result = tree.evict_bytes(row_bytes[swa], row_bytes)

    went = {name: result.count(name) for name in layout.pool_names}
    assert went["swa"] >= 1 and went["state"] == went["swa"], went
    assert went["kv"] == went["c2"] == 0
    for seq in (old, new):
        m = tree.match_prefix(seq + [1], record=False)
        table = m.page_table
        assert m.prefix_len == kept_cols * layout.page_size  # the end checkpoint stays
        # wherever the window page went, the state at that resume point went too
        gone_swa = table[swa] < 0
        assert not (gone_swa & (table[state] >= 0)).any(), table
    tree.check_integrity()


def test_the_newest_resume_points_stay_when_the_oldest_node_covers_the_ask() -> None:
    """The pass stops at the node that covers the bytes asked: the newer sequence keeps
    every page's window and state (a resume point at every page end)."""
    tree, (old, new) = _tree(CheckpointPolicy(), pages=6)
    layout = tree.layout
    pb = layout.page_bytes()
    row_bytes = [pb[p.name] for p in layout.pools]
    tree.evict_bytes(row_bytes[layout.index("swa")], row_bytes)
    m = tree.match_prefix(new[:3 * layout.page_size] + [1], record=False)
    assert m.prefix_len == 3 * layout.page_size  # a loose resume point, still there
    m = tree.match_prefix(old[:3 * layout.page_size] + [1], record=False)
    assert m.prefix_len == 0  # the oldest node's loose points went, window and state


def test_nodes_visited_counts_what_the_walks_look_at() -> None:
    """`nodes_visited` (benchmarks/arena.py's work per allocation) grows by the nodes a
    walk took from its heaps: none for a walk with nothing to take, one per leaf let go."""
    tree, _ = _tree(CheckpointPolicy(), pages=2, seqs=3)
    assert tree.nodes_visited() == 0
    tree.evict("kv", 0)
    assert tree.nodes_visited() == 0
    tree.evict("kv", 1)  # the oldest leaf goes whole
    assert tree.nodes_visited() == 1
    tree.evict("kv", 4)  # the other two
    assert tree.nodes_visited() == 3
    tree.check_integrity()
