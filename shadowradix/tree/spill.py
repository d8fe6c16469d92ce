"""Write-back room: host pages set aside so device eviction can keep what it drops.

Under write-back, a device page is copied to the host when eviction drops it. The tree
moves no bytes and holds no hook: the caller (HostTier) makes host room, passes a room
over the host pools to this one `evict` call, and afterwards copies what the tree
recorded in `moves`. Make room, evict, settle: the order is in the caller's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from shadowradix.tree.node import PAGE, Node


class HostPages(Protocol):
    """What a room draws from: one tier's page allocator (pool.PagePool)."""

    def can_alloc(self, n: int) -> bool: ...

    def alloc(self, n: int) -> np.ndarray: ...


class SpillRoom:
    """Free host pages (per pool, in the layout's row order) that eviction may take as it
    drops device pages the host lacks. A node's spill is all or nothing; the room never
    evicts (the caller makes room before). The moves it records are the caller's to copy."""

    def __init__(self, names: Sequence[str], pools: Mapping[str, HostPages]) -> None:
        self.names = list(names)
        self._pools = [pools[n] for n in self.names]
        self.moves: list[tuple[int, np.ndarray, np.ndarray]] = []  # (row, device, host)
        self.cells: list[tuple[Node, np.ndarray]] = []  # (node, host cells filled)
        self.skipped = 0  # device pages dropped without a copy (no room left)

    def take(self, node: Node, want: np.ndarray) -> np.ndarray | None:
        """Host ids for the `want` cells of a node's device table, laid out like it (-1
        elsewhere), recording the moves; None (taking nothing) when some pool lacks room."""
        node_pages = node.pages
        counts = [int(k) for k in np.count_nonzero(want, axis=1)]
        if not all(pool.can_alloc(k) for pool, k in zip(self._pools, counts, strict=True)):
            self.skipped += sum(counts)
            return None
        ids = np.full(want.shape, -1, PAGE)
        for row, k in enumerate(counts):
            if k:
                host = np.asarray(self._pools[row].alloc(k), dtype=PAGE)
                ids[row, want[row]] = host
                self.moves.append((row, node_pages[row, want[row]].copy(), host))
        self.cells.append((node, want.copy()))
        return ids
