"""Small named records the tree returns instead of sentinels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadowradix.tree.lifetime import Ghost
from shadowradix.tree.node import PAGE, Node


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

    With a host tier, P counts pages on the device or the host:
    device_len: the deepest resume point on the device alone (<= P).
    host_table: [pools, P / page_size] host pages, -1 where the host has none.
    load: [pools, P / page_size] the pages the resume reads that are only on the
        host: copy them to device pages and `fill` the tree before using them.
    Without one, device_len == P and host_table / load are None.
    """

    prefix_len: int
    logical_len: int
    page_table: np.ndarray
    node: Node
    device_len: int | None = None
    host_table: np.ndarray | None = None
    load: np.ndarray | None = None
    deepest: Node | None = field(default=None, repr=False)  # the last node reached
    # The tail a split at P cut off the node that now ends at P: it may be left with no
    # resume point of its own (dead weight the caller prunes).
    tail: Node | None = field(default=None, repr=False)
    # An evicted leaf this match would have gone on into (adaptive_lifetime only).
    ghost: Ghost | None = field(default=None, repr=False)

    @property
    def device_prefix_len(self) -> int:
        return self.prefix_len if self.device_len is None else self.device_len

    @property
    def held_table(self) -> np.ndarray:
        """[pools, P / page_size]: >= 0 where the device or the host holds the page."""
        if self.host_table is None:
            return self.page_table
        return np.where(self.page_table >= 0, self.page_table, self.host_table)


@dataclass(frozen=True)
class Peek:
    """What a match would return, computed without changing the tree (`ShadowRadix.peek`).

    prefix_len, device_len, logical_len: as in MatchResult.
    held_table: [pools, prefix_len / page_size], >= 0 where the device or host holds
        the page (where a storage read would start).
    load: as MatchResult.load (None without a host tier).
    """

    prefix_len: int
    device_len: int
    logical_len: int
    held_table: np.ndarray
    load: np.ndarray | None


@dataclass(frozen=True)
class _Probe:
    """One descent's findings, shared by match_prefix and peek (tree-internal)."""

    path: list[tuple[Node, int]]
    depth: int
    table: np.ndarray
    resume: int
    on_device: int
    host: np.ndarray | None
    load: np.ndarray | None


@dataclass(frozen=True)
class InsertResult:
    """What `insert` did with a request's pages.

    node: the node ending at the inserted length (lock it to keep using the pages).
    cached_pages: leading pages the tree already held.
    to_free: per pool, the request's pages the tree did not adopt (duplicates,
        or window pages an eager policy drops). The caller must free them.
    tail: the node the insert split, where its pages branched off inside one: it keeps
        the pages past the branch, and may hold no resume point now (its last was before
        the branch). The caller prunes it (PrefixCache.prune), which drops it only then.
    """

    node: Node
    cached_pages: int
    to_free: dict[str, np.ndarray]
    tail: Node | None = None


class EvictResult:
    """Per pool, the pages the tree let go. The caller frees exactly these.

    freed: device pages. freed_host: host pages (removing a node frees both
    tiers, whichever one was evicted); empty without a host tier. queued: the
    walk put them in the tree's `stranded` as it began (`sink_walks`): the
    owner frees them from there, not from here.

    A walk's result (`of_walk`) joins its rows into these dicts only when one is read:
    an owner that frees from `stranded` never reads them.
    """

    __slots__ = ("_freed", "_freed_host", "_walk", "queued")

    def __init__(self, freed: dict[str, np.ndarray],
                 freed_host: dict[str, np.ndarray] | None = None, queued: bool = False) -> None:
        self._freed: dict[str, np.ndarray] | None = freed
        self._freed_host: dict[str, np.ndarray] = {} if freed_host is None else freed_host
        self._walk: tuple[list[list[list[np.ndarray]]], tuple[str, ...]] | None = None
        self.queued = queued

    @classmethod
    def of_walk(cls, rows: list[list[list[np.ndarray]]], names: tuple[str, ...],
                queued: bool) -> EvictResult:
        """The result of a walk that let go `rows` ([tier][pool row] -> arrays of ids;
        the pool rows named `names`), joined when first read."""
        result = cls({}, None, queued)
        result._freed, result._walk = None, (rows, names)
        return result

    @property
    def freed(self) -> dict[str, np.ndarray]:
        if self._freed is None:
            self._join()
        assert self._freed is not None
        return self._freed

    @property
    def freed_host(self) -> dict[str, np.ndarray]:
        if self._freed is None:
            self._join()
        return self._freed_host

    def _join(self) -> None:
        assert self._walk is not None
        rows, names = self._walk
        out = []
        for tier in rows:
            by_name = {}
            for name, arrays in zip(names, tier, strict=True):
                pages = by_name[name] = joined(arrays)
                if len(arrays) > 1:  # joined once: whoever reads the rows again
                    arrays[:] = [pages]
            out.append(by_name)
        self._freed_host = out[1] if len(out) > 1 else {}
        self._freed = out[0]

    def count(self, pool: str) -> int:
        return int(self.freed[pool].size)

    def __repr__(self) -> str:
        return (f"EvictResult(freed={self.freed!r}, freed_host={self.freed_host!r}, "
                f"queued={self.queued!r})")


def joined(arrays: list[np.ndarray]) -> np.ndarray:
    """One array of page ids from several (none: empty)."""
    if len(arrays) > 1:
        return np.concatenate(arrays)
    return arrays[0] if arrays else np.empty(0, PAGE)


FREE, LOCKING, HELD, UNLOCKING, ROLLING = "free", "locking", "held", "unlocking", "rolling"
# A node a lock walk is changing: the node, its full_lock before (None: put back already;
# the walk resumes at the node), and (None: untouched) its last window_lock columns before.
Pending = tuple[Node, "int | None", "np.ndarray | None"]


@dataclass(eq=False)
class LockHandle:
    """One lock on the path root..node, with the window and checkpoint just before it.
    Two handles are the same only if they are the same object (two locks of one node are
    two locks)."""

    node: Node
    window_pages: int
    # Where it stands, in one attribute, so that an interrupt finds it before or after
    # each step of a walk, never between two (ShadowRadix._lock_walk): its phase (FREE:
    # made, before its lock walk takes a node, or released; LOCKING; HELD; UNLOCKING;
    # ROLLING: a lock cut short being undone), the first page of the last node its walk
    # did (None: none; it resumes above it), the node it is changing with that node's
    # lock counts from before (None: none), and the page its walk stops at (the nodes
    # ending at or before it are not its own: a rolled-back lock took only the deep ones).
    progress: tuple[str, int | None, Pending | None, int] = (FREE, None, None, 0)
    # Its owner is done with it: set before the unlock, so that a fault as the unlock is
    # called leaves it to the cache (PrefixCache.lock(transient=True)).
    expired: bool = False

    @property
    def released(self) -> bool:
        return self.progress[0] == FREE

    @property
    def done_from(self) -> int | None:
        return self.progress[1]

