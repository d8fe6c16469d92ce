"""Moving the tree's device pages to other ids of the same pool (an arena's compaction,
pool/arena.py): the tree's side.

A page may move only while nothing but the tree knows its id: held by a node no lock runs
through (a running request's table holds the ids of the prefix it locked), in the device
tier. `PageOwners` remembers, per pool, which node took each device page last (an entry
goes stale when the node lets the page go; a read checks it against the node), so finding
the holders of a frame's pages costs O(pages), not a walk over the tree.
"""

from __future__ import annotations

import numpy as np

from shadowradix.tree.node import PAGE, Node

Owners = list[tuple[Node, np.ndarray, np.ndarray]]  # node, its columns, their index in pages


class PageOwners:
    """Device page id -> the node that took it last, per pool row."""

    def __init__(self, n_pools: int) -> None:
        self._rows = [np.empty(0, dtype=object) for _ in range(n_pools)]

    def note(self, node: Node, table: np.ndarray) -> None:
        """`node` now holds the device pages of `table` ([pools, n], -1: none)."""
        for row in range(len(self._rows)):
            ids = table[row]
            self._set(row, ids[ids >= 0], node)

    def _set(self, row: int, ids: np.ndarray, node: Node) -> None:
        if ids.size:
            self._grow(row, int(ids.max()))
            self._rows[row][ids] = node

    def _grow(self, row: int, top: int) -> None:
        """Room in row `row` for page id `top`."""
        owner = self._rows[row]
        if top >= owner.size:
            grown = np.empty(max(top + 1, 2 * owner.size), dtype=object)
            grown[:owner.size] = owner
            self._rows[row] = grown

    def holds(self, node: Node) -> bool:
        """Whether the map names `node` for every device page it holds (integrity)."""
        for row, owner in enumerate(self._rows):
            ids = node.pages[row]
            ids = ids[ids >= 0]
            if ids.size and (int(ids.max()) >= owner.size
                             or any(o is not node for o in owner[ids].tolist())):
                return False
        return True

    def movable(self, row: int, pages: np.ndarray) -> tuple[np.ndarray, Owners]:
        """Which of `pages` (device ids of pool row `row`) the tree holds in a node no lock
        holds, and where: the mask over `pages`, and per such node its columns holding
        them and their index into `pages`."""
        pages = np.asarray(pages, dtype=PAGE)
        ok = np.zeros(pages.size, dtype=bool)
        owner = self._rows[row]
        inside = np.flatnonzero(pages < owner.size)
        groups: dict[int, tuple[Node, list[int]]] = {}
        for i, node in zip(inside.tolist(), owner[pages[inside]].tolist(), strict=True):
            if node is not None and node.alive and not node.full_lock:
                group = groups.get(node.id)
                if group is None:
                    groups[node.id] = (node, [i])
                else:
                    group[1].append(i)
        owners: Owners = []
        for node, where in groups.values():
            at = np.asarray(where)
            ids = node.pages[row]
            order = np.argsort(ids, kind="stable")
            cols = order[np.minimum(np.searchsorted(ids[order], pages[at]), ids.size - 1)]
            held = (ids[cols] == pages[at]) & (node.window_lock[cols] == 0)
            if np.count_nonzero(held):
                ok[at[held]] = True
                owners.append((node, cols[held], at[held]))
        return ok, owners

    def relocate(self, row: int, owners: Owners, new: np.ndarray) -> None:
        """Give each owned page its new id, `new[i]` for `pages[i]` where `new[i] >= 0`
        (`owners` from `movable` on `pages`, the tree unchanged since; `new` = `pages`
        afterwards undoes it). The tree's counts do not change. The map grows first, so
        nothing after can fail halfway."""
        if new.size:
            self._grow(row, int(new.max()))
        for node, cols, at in owners:
            to = new[at]
            move = to >= 0
            if np.count_nonzero(move):
                node.pages[row, cols[move]] = to[move]
                self._set(row, to[move], node)
