"""Least-recently-used order over nodes: a heap with lazy re-stamping.

A node is in a heap at most once (its `queued` bit says so). Touching a node
only bumps `last_access`; when an entry whose stamp is older than its node's
surfaces, it is pushed back with the current stamp. Stamps only grow, so the
first current entry popped is the true least recently used node. Touch is
O(1); eviction pays O(log n) per entry it looks at.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from shadowradix.tree.node import Node

Entry = tuple[int, int, int, Node]


class LRUHeap:
    def __init__(self, bit: int) -> None:
        self._heap: list[Entry] = []
        self._bit = 1 << bit
        self.yielded = 0  # nodes handed to walks, ever (benchmarks: work per eviction)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, node: Node) -> None:
        """Queue `node` unless it is queued already."""
        if not node.queued & self._bit:
            node.queued |= self._bit
            heapq.heappush(self._heap, (node.last_access, node.start_page, node.id, node))

    def oldest(self, wanted: Callable[[Node], bool]) -> Iterator[Node]:
        """Yield wanted nodes, least recently used first; each leaves the heap.

        A yielded node that should stay a candidate must be `add`ed back. Nodes
        that are dead or no longer wanted are dropped (and may be `add`ed again); an
        entry with an old stamp is pushed back before `wanted` is asked, which is then
        asked once, when the node is the oldest.
        """
        heap = self._heap
        while heap:
            stamp, _, _, node = heapq.heappop(heap)
            if node.alive and stamp != node.last_access:  # re-stamped: judged when it surfaces
                heapq.heappush(heap, (node.last_access, node.start_page, node.id, node))
                continue
            node.queued &= ~self._bit
            if not node.alive or not wanted(node):
                continue
            self.yielded += 1
            yield node
