"""`check_integrity()`: every invariant the tree relies on, named when it breaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from shadowradix.tree.node import Node
    from shadowradix.tree.radix import ShadowRadix


def check_tree(tree: ShadowRadix) -> None:
    ps, n_pools, tiers = tree.page_size, tree.n_pools, tree.tiers
    held = np.zeros((tiers, n_pools), np.int64)
    pinned = np.zeros((tiers, n_pools), np.int64)
    per_pool: list[list[list[np.ndarray]]] = [[[] for _ in range(n_pools)] for _ in range(tiers)]
    n_nodes = 1
    all_rows = list(tree.rule.all_rows)
    stack = [tree.root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for key, child in node.children.items():
            n_nodes += 1
            _expect(child.alive, f"node {child.id} is in the tree but marked dead")
            _expect(child.parent is node, f"node {child.id}: parent link broken")
            _expect(child.n_pages > 0, f"node {child.id} has no pages")
            if tree.owners is not None:
                _expect(tree.owners.holds(child), f"node {child.id}: the page owners map "
                        f"names another node for one of its device pages")
            _expect(key == child.key(ps), f"node {child.id}: child key is not its first page")
            _expect(child.start_page == node.end_page,
                    f"node {child.id}: starts at page {child.start_page}, parent ends at "
                    f"{node.end_page}")
            _expect(child.tokens.size == child.n_pages * ps,
                    f"node {child.id}: {child.tokens.size} tokens for {child.n_pages} pages")
            _expect(child.keep.shape == child.pages.shape and
                    child.window_lock.shape == (child.n_pages,),
                    f"node {child.id}: shadow arrays disagree in shape")
            _expect(child.full_lock >= 0 and bool((child.window_lock >= 0).all()),
                    f"node {child.id}: negative lock count")
            _expect(not (child.window_lock > 0).any() or child.full_lock > 0,
                    f"node {child.id}: window-locked but not full-locked")
            if all_rows and tiers == 1:
                _expect(bool((child.pages[all_rows] >= 0).all()),
                        f"node {child.id}: tombstone in an ALL pool")
            if tiers > 1:
                _expect(child.host is not None and child.host.shape == child.pages.shape,
                        f"node {child.id}: host shadow missing or misshapen")
                for tier in range(tiers):
                    cells = child.slot(tier)[all_rows] >= 0
                    _expect(bool(cells.all()) or not cells.any(),
                            f"node {child.id}: ALL pages partly in tier {tier}")
                _expect(bool(child.children) or child.full_lock > 0 or not tree._dead(child),
                        f"node {child.id}: an unlocked leaf no tier can resume from")
            _add_counts(tree, child, held, pinned, per_pool)
            child_locks += child.full_lock
            stack.append(child)
        if node is not tree.root:
            _expect(node.full_lock >= child_locks,
                    f"node {node.id}: full_lock {node.full_lock} < children's {child_locks}")
    _expect(n_nodes == tree._n_nodes, f"{n_nodes} nodes reachable, {tree._n_nodes} counted")
    for tier in range(tiers):
        for row, spec in enumerate(tree.layout.pools):
            count = tree._held[tier][row]
            _expect(held[tier, row] == count, f"pool {spec.name!r} tier {tier}: "
                    f"{held[tier, row]} pages in shadows, {count} counted")
            _expect(pinned[tier, row] == tree._pinned[tier][row],
                    f"pool {spec.name!r} tier {tier}: {pinned[tier, row]} pages pinned by "
                    f"locks, {tree._pinned[tier][row]} counted")
            parts = per_pool[tier][row]
            pages = np.concatenate(parts) if parts else np.empty(0, np.int32)
            _expect(np.unique(pages).size == pages.size,
                    f"pool {spec.name!r} tier {tier}: a physical page is shadowed twice")


def recount(tree: ShadowRadix) -> tuple[int, np.ndarray, np.ndarray]:
    """The tree's counts from its nodes alone: nodes (the root too), and per tier and pool
    the pages its shadows hold and those locks pin. O(tree)."""
    held = np.zeros((tree.tiers, tree.n_pools), np.int64)
    pinned = np.zeros((tree.tiers, tree.n_pools), np.int64)
    n_nodes, stack = 1, list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        n_nodes += 1
        _add_counts(tree, node, held, pinned)
    return n_nodes, held, pinned


def _add_counts(tree: ShadowRadix, node: Node, held: np.ndarray, pinned: np.ndarray,
                per_pool: list[list[list[np.ndarray]]] | None = None) -> None:
    """Add a node's pages (per tier and pool) and those its locks pin; with `per_pool`,
    collect its page ids there too."""
    for tier in range(tree.tiers):
        slot = node.slot(tier)
        for row in range(tree.n_pools):
            present = slot[row][slot[row] >= 0]
            if per_pool is not None:
                per_pool[tier][row].append(present)
            held[tier, row] += present.size
        if node.full_lock:
            for row in tree.full_pin_rows:
                pinned[tier, row] += int(np.count_nonzero(slot[row] >= 0))
        for row in tree.window_pin_rows:
            pinned[tier, row] += int(np.count_nonzero((slot[row] >= 0)
                                                      & (node.window_lock > 0)))


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
