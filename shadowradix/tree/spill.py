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

    def free(self, pages: np.ndarray) -> None: ...


class SpillRoom:
    """Free host pages (per pool, in the layout's row order) that eviction may take as it
    drops device pages the host lacks. A node's spill is all or nothing; the room never
    evicts (the caller makes room before). What it took is the caller's to copy."""

    def __init__(self, names: Sequence[str], pools: Mapping[str, HostPages]) -> None:
        self.names = list(names)
        self._pools = [pools[n] for n in self.names]
        # (node, cells, device ids, host ids): each [pools, n], ids -1 outside `cells`.
        self.taken: list[tuple[Node, np.ndarray, np.ndarray, np.ndarray]] = []
        self.skipped = 0  # device pages dropped without a copy (no room left)

    def take(self, node: Node, want: np.ndarray) -> np.ndarray | None:
        """Host ids for the `want` cells of a node's device table, laid out like it (-1
        elsewhere), recorded with the device ids; None (taking nothing) when some pool
        lacks room."""
        counts = [int(k) for k in np.count_nonzero(want, axis=1)]
        if not all(pool.can_alloc(k) for pool, k in zip(self._pools, counts, strict=True)):
            self.skipped += sum(counts)
            return None
        ids = np.full(want.shape, -1, PAGE)
        got: list[np.ndarray | None] = [None] * len(counts)  # (a store here cannot fail)
        entry = (node, want.copy(), np.where(want, node.pages, -1), ids)
        try:
            for row, k in enumerate(counts):
                if k:
                    got[row] = pages = self._pools[row].alloc(k)
                    ids[row, want[row]] = pages
            self.taken.append(entry)
            return ids
        except BaseException:  # a fault before it was recorded: what it took goes back
            if not (self.taken and self.taken[-1] is entry):
                for row, held in enumerate(got):
                    if held is not None:
                        self._pools[row].free(held)
            raise

    def copies(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(pool, device ids, host ids) per pool: the copies that make the moves real."""
        out = []
        for row, name in enumerate(self.names):
            cells = [(dev[row][want[row]], host[row][want[row]])
                     for _, want, dev, host in self.taken if want[row].any()]
            if cells:
                out.append((name, np.concatenate([d for d, _ in cells]),
                            np.concatenate([h for _, h in cells])))
        return out
