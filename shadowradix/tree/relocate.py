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

# Per movable page: its node, its column there, its index in the pages asked about.
Owners = tuple[list[Node], np.ndarray, np.ndarray]


class PageOwners:
    """Device page id -> the node that took it last and the page's position in the
    sequence (a node's column is the position less its start_page, which a split keeps:
    the tail keeps its identity, the head is noted anew), per pool row, for ids below
    `sizes[row]`. An id out of range is never noted (no pool of that size handed it out),
    so such a page reads as not movable."""

    def __init__(self, sizes: list[int]) -> None:
        self._sizes = sizes
        self._limits = np.asarray(sizes, dtype=np.int64)[:, None]  # ids below, per row
        # Grown as ids are noted (a pool of many small pages rarely uses its whole range).
        self._nodes = [np.full(min(n, 1024), None, dtype=object) for n in sizes]
        self._pos = [np.zeros(min(n, 1024), dtype=np.int32) for n in sizes]

    def note(self, node: Node, table: np.ndarray) -> None:
        """`node` now holds the device pages of `table` ([pools, n], -1: none). The table's
        cells are found in one pass; each row then costs two writes."""
        held = (table >= 0) & (table < self._limits)
        rows, cols = held.nonzero()  # row by row
        if not rows.size:
            return
        ids, pos = table[rows, cols], cols + node.start_page
        ends = np.cumsum(np.count_nonzero(held, axis=1)).tolist()
        lo = 0
        for row, hi in enumerate(ends):
            if hi > lo:
                self._set(row, ids[lo:hi], pos[lo:hi], node)
            lo = hi

    def _set(self, row: int, ids: np.ndarray, pos: np.ndarray, node: Node) -> None:
        top = int(ids.max())
        if top >= self._nodes[row].size:
            self._grow(row, top)
        self._nodes[row][ids] = node
        self._pos[row][ids] = pos

    def _grow(self, row: int, top: int) -> None:
        """Room in row `row` for id `top` (< its size)."""
        n = min(max(top + 1, 2 * self._nodes[row].size), self._sizes[row])
        nodes, pos = np.full(n, None, dtype=object), np.zeros(n, dtype=np.int32)
        nodes[:self._nodes[row].size] = self._nodes[row]
        pos[:self._pos[row].size] = self._pos[row]
        self._nodes[row], self._pos[row] = nodes, pos

    def holds(self, node: Node) -> bool:
        """Whether the map names `node` for every device page it holds (integrity)."""
        for row, owner in enumerate(self._nodes):
            ids = node.pages[row]
            cols = np.flatnonzero(ids >= 0)
            ids = ids[cols]
            if not ids.size:
                continue
            if int(ids.max()) >= owner.size or any(o is not node for o in owner[ids].tolist()):
                return False
            if not np.array_equal(self._pos[row][ids], cols + node.start_page):
                return False
        return True

    def movable(self, row: int, pages: np.ndarray) -> tuple[np.ndarray, Owners]:
        """Which of `pages` (device ids of pool row `row`) the tree holds in a node no lock
        holds, and where: the mask over `pages`, and for each such page its node, column,
        index into `pages` and position. One look per page, at the node's row of ids read
        once per node (a node no lock runs through has no window lock either)."""
        pages = np.asarray(pages, dtype=PAGE)
        ok = np.zeros(pages.size, dtype=bool)
        owner = self._nodes[row]
        inside = np.flatnonzero((pages >= 0) & (pages < owner.size))
        ids = pages[inside]
        nodes: list[Node] = []
        cols: list[int] = []
        at: list[int] = []
        # Per node, once: its row of ids (None: a lock runs through it, so no page moves;
        # with none, no window lock holds a page either) and its first page.
        held: dict[Node, tuple[list[int] | None, int]] = {}
        for i, node, page, pos in zip(inside.tolist(), owner[ids].tolist(), ids.tolist(),
                                      self._pos[row][ids].tolist(), strict=True):
            if node is None:
                continue
            seen = held.get(node)
            if seen is None:
                free = node.alive and not node.full_lock
                seen = held[node] = (node.pages[row].tolist() if free else None,
                                     node.start_page)
            table, start = seen
            col = pos - start
            if table is not None and 0 <= col < len(table) and table[col] == page:
                nodes.append(node)
                cols.append(col)
                at.append(i)
        where = np.asarray(at, dtype=np.int64)
        ok[where] = True
        return ok, (nodes, np.asarray(cols, dtype=np.int64), where)

    def relocate(self, row: int, owners: Owners, new: np.ndarray) -> None:
        """Give each owned page its new id, `new[i]` for `pages[i]` where `new[i] >= 0`
        (`owners` from `movable` on `pages`, the tree unchanged since; `new` = `pages`
        afterwards undoes it). The tree's counts do not change. Every id is checked first,
        so nothing after can fail halfway."""
        nodes, cols, at = owners
        to = new[at] if at.size else np.empty(0, PAGE)
        if to.size and int(to.max()) >= self._sizes[row]:
            raise ValueError(f"pool row {row}: page id {int(to.max())} out of range")
        if to.size and int(to.max()) >= self._nodes[row].size:
            self._grow(row, int(to.max()))
        held = np.empty(len(nodes), dtype=object)
        held[:] = nodes
        starts = np.fromiter((n.start_page for n in nodes), np.int64, len(nodes))
        move = to >= 0  # everything the writes below need is made first
        ids, who, pos = to[move], held[move], (cols[move] + starts[move]).astype(np.int32)
        moves = [(node, col, page) for node, col, page in
                 zip(nodes, cols.tolist(), to.tolist(), strict=True) if page >= 0]
        self._nodes[row][ids] = who
        self._pos[row][ids] = pos
        for node, col, page in moves:
            node.pages[row, col] = page
