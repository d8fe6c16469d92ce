"""The match rule (DESIGN.md §2), vectorised over a path's page table."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shadowradix.layout.spec import KVLayout, Retention


@dataclass(frozen=True)
class MatchRule:
    """Which rows a resume point at page boundary q needs, derived from a layout.

    q is resumable iff every ALL row covers pages [0, q), every WINDOW row
    covers the `k` pages before q (k = ceil((W-1)/page_size)), and every
    CHECKPOINT row holds page q-1 (the state at q). q = 0 always is.
    """

    all_rows: list[int]
    windows: tuple[tuple[int, int], ...]  # (row, pages needed before q)
    checkpoint_rows: tuple[int, ...]
    lock_pages: int  # pages before q that a lock at q must keep (window and state)
    prev_rows: list[int]  # rows that need exactly page q-1 (one-page windows, checkpoints)
    wide_windows: tuple[tuple[int, int], ...]  # windows spanning more than one page
    checkpoint_names: frozenset[str]  # CHECKPOINT pools: one entry per full page
    has_checkpoints: bool = field(init=False)  # resuming needs more than the ALL rows

    @classmethod
    def of(cls, layout: KVLayout) -> MatchRule:
        windows = tuple((i, p.window_pages(layout.page_size)) for i, p in enumerate(layout.pools)
                        if p.retention is Retention.WINDOW)
        ckpt = layout.rows(Retention.CHECKPOINT)
        lock = max([k for _, k in windows] + [1 if ckpt else 0])
        prev = [r for r, k in windows if k == 1] + list(ckpt)
        wide = tuple((r, k) for r, k in windows if k > 1)
        names = frozenset(layout.pools[r].name for r in ckpt)
        return cls(list(layout.rows(Retention.ALL)), windows, ckpt, lock, prev, wide, names)

    def __post_init__(self) -> None:
        # Whether resuming needs more than the ALL rows (so a node can be dead weight).
        object.__setattr__(self, "has_checkpoints",
                           any(k for _, k in self.windows) or bool(self.checkpoint_rows))

    def needed(self, n_rows: int, q: int) -> np.ndarray:
        """need[row, i]: whether resuming at boundary q reads page i of pool `row`."""
        need = np.zeros((n_rows, q), dtype=bool)
        if q == 0:
            return need
        need[self.all_rows] = True
        for row, k in self.windows:
            need[row, max(q - k, 0):] = True
        need[list(self.checkpoint_rows), q - 1] = True
        return need

    def deepest_after(self, table: np.ndarray, extra: int) -> int:
        """The deepest resume point when, past `table` [rows, m], pages [m, m + extra) are
        held in every pool (what a store holds whole): never less than m."""
        if extra <= 0:
            return table.shape[1]
        return max(self.deepest(_extended(table, extra)), table.shape[1])

    def points_after(self, table: np.ndarray, extra: int) -> np.ndarray:
        """Every resume point q in (m, m + extra] when, past `table` [rows, m], pages
        [m, m + extra) are held in every pool (see `deepest_after`), in order."""
        m = table.shape[1]
        if extra <= 0:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.resumable(_extended(table, extra))[m + 1:]) + m + 1

    def resumable(self, pages: np.ndarray) -> np.ndarray:
        """ok[q] for q in 0..m, over a path's page table `pages` [rows, m]."""
        m = pages.shape[1]
        ok = np.ones(m + 1, dtype=bool)
        if m == 0:
            return ok
        present = pages >= 0
        if self.all_rows:
            missing = np.flatnonzero(~present[self.all_rows, :].all(axis=0))
            if missing.size:
                ok[missing[0] + 1:] = False
        for row, k in self.windows:
            if k == 1:
                ok[1:] &= present[row]
            elif k > 1:
                held = np.concatenate(([0], np.cumsum(present[row])))
                q = np.arange(m + 1)
                lo = np.maximum(q - k, 0)
                ok &= (held - held[lo]) == (q - lo)
        for row in self.checkpoint_rows:
            ok[1:] &= present[row]
        ok[0] = True
        return ok

    def deepest(self, pages: np.ndarray) -> int:
        """The deepest resumable page boundary of a path's page table.

        Same answer as `resumable(pages)`'s last True, with fewer array passes:
        this runs on every match.
        """
        m = pages.shape[1]
        if m == 0:
            return 0
        if self.wide_windows:
            return int(np.flatnonzero(self.resumable(pages))[-1])
        present = pages >= 0
        rows = self.prev_rows
        cand = None
        if rows:  # first: none at all (a dead leaf) needs no look at the ALL rows
            cand = present[rows[0]] if len(rows) == 1 else np.logical_and.reduce(present[rows])
            if not np.count_nonzero(cand):
                return 0
        limit = m
        rows = self.all_rows
        if rows:
            whole = present[rows[0]] if len(rows) == 1 else present[rows].all(axis=0)
            if np.count_nonzero(whole) < m:
                limit = int(whole.argmin())
        if cand is None:
            return limit
        cand = cand[:limit]
        if limit == 0 or not np.count_nonzero(cand):
            return 0
        return limit - int(cand[::-1].argmax())


def _extended(table: np.ndarray, extra: int) -> np.ndarray:
    """`table` [rows, m] with `extra` more pages held in every row."""
    return np.concatenate([table, np.zeros((table.shape[0], extra), table.dtype)], axis=1)
