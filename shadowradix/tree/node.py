"""A node of the ShadowRadix tree: an edge of whole pages and one shadow per pool."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from shadowradix.tree.tier import DEVICE

_ids = itertools.count()
PAGE = np.int32  # physical page ids; -1 is a tombstone (or "not in this tier")


@dataclass(slots=True, eq=False)
class Node:
    """Tokens and bookkeeping only; never tensors.

    pages[row, i] is pool `row`'s device page for this node's i-th page, or
    -1 (a tombstone, or not on the device). host[row, i] is the same on the
    host tier (None when the tree has no host tier). keep[row, i] marks pages
    that belong to a kept checkpoint. window_lock[i] counts the locks whose
    window or checkpoint needs page i; full_lock counts the locks whose path
    runs through the node. hits counts the matches that reached the node.
    prompt_end is the page boundary where the prompt of the finished sequence
    ending in this leaf ended (-1: none); a split leaves it with the tail, the
    leaf.
    """

    tokens: np.ndarray
    pages: np.ndarray
    keep: np.ndarray
    window_lock: np.ndarray
    parent: Node | None
    start_page: int
    children: dict[bytes, Node] = field(default_factory=dict)
    full_lock: int = 0
    last_access: int = 0
    branch: bool = False
    host: np.ndarray | None = None
    hits: int = 0
    queued: int = 0  # bit per LRU heap holding this node
    prompt_end: int = -1
    alive: bool = True
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def n_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def end_page(self) -> int:
        return self.start_page + self.pages.shape[1]

    def slot(self, tier: int) -> np.ndarray:
        """The page ids of one tier: 0 the device, 1 the host."""
        if tier == DEVICE:
            return self.pages
        assert self.host is not None, "this tree has no host tier"
        return self.host

    def key(self, page_size: int) -> bytes:
        return self.tokens[:page_size].tobytes()

    def split(self, j: int, page_size: int) -> Node:
        """Cut after page j; a new node takes the head and this node keeps the tail.

        The tail keeps its identity so that lock handles (which name the node
        ending at their boundary) stay valid. Locks carry over: every lock that
        runs through the tail runs through the head.
        """
        assert 0 < j < self.n_pages and self.parent is not None
        head = Node(
            tokens=self.tokens[:j * page_size],
            pages=self.pages[:, :j].copy(),
            keep=self.keep[:, :j].copy(),
            window_lock=self.window_lock[:j].copy(),
            parent=self.parent,
            start_page=self.start_page,
            full_lock=self.full_lock,
            last_access=self.last_access,
            branch=False,
            host=None if self.host is None else self.host[:, :j].copy(),
            hits=self.hits,
        )
        # Everything the tail becomes is made first (a fault there, an array copy that
        # fails, leaves the tree as it was), then linked by the stores of one line: an
        # interrupt finds the tree as it was or split, never between (each store replaces
        # what a slot or an existing key holds, so none of them allocates).
        tokens = self.tokens[j * page_size:]
        up, key = self.parent.children, self.key(page_size)
        link = (head, tokens, self.pages[:, j:].copy(), self.keep[:, j:].copy(),
                None if self.host is None else self.host[:, j:].copy(),
                self.window_lock[j:].copy(), self.start_page + j, head)
        head.children[tokens[:page_size].tobytes()] = self  # head is nobody's child yet
        s = self
        up[key], s.tokens, s.pages, s.keep, s.host, s.window_lock, s.start_page, s.parent = link
        return head


def leading_equal_pages(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """How many whole leading pages of two equal-length token arrays agree."""
    if a.tobytes() == b.tobytes():  # the common case, and 10x cheaper than a != b
        return a.size // page_size
    return int((a != b).argmax()) // page_size
