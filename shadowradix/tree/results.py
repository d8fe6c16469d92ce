"""Small named records the tree returns instead of sentinels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadowradix.tree.node import Node


@dataclass(frozen=True)
class MatchResult:
    """What a prompt can reuse.

    prefix_len: the deepest page boundary P (tokens) where a request may resume
        exactly (DESIGN.md §2, match rule); capped at len(tokens) - 1.
    logical_len: the deepest page boundary the tree holds tokens for, whether or
        not its shadows still allow a resume there (diagnostics; the tiers may
        hold the missing pieces).
    page_table: [pools, P / page_size] physical pages per pool; -1 where a
        WINDOW / CHECKPOINT pool let a page go that the resume does not need.
    node: the node ending at P; `lock` it before using the pages.
    """

    prefix_len: int
    logical_len: int
    page_table: np.ndarray
    node: Node


@dataclass(frozen=True)
class InsertResult:
    """What `insert` did with a request's pages.

    node: the node ending at the inserted length (lock it to keep using the pages).
    cached_pages: leading pages the tree already held.
    to_free: per pool, the request's pages the tree did not adopt (duplicates,
        or window pages an eager policy drops). The caller must free them.
    """

    node: Node
    cached_pages: int
    to_free: dict[str, np.ndarray]


@dataclass(frozen=True)
class EvictResult:
    """Per pool, the pages the tree let go. The caller frees exactly these."""

    freed: dict[str, np.ndarray]

    def count(self, pool: str) -> int:
        return int(self.freed[pool].size)


@dataclass
class LockHandle:
    """One lock on the path root..node, with the window and checkpoint just before it."""

    node: Node
    window_pages: int
    released: bool = field(default=False)
