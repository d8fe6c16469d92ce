"""Counters over the whole tree, for `stats()` and dashboards (a full walk: not hot)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shadowradix.layout.spec import Retention

if TYPE_CHECKING:
    from shadowradix.tree.radix import ShadowRadix


@dataclass(frozen=True)
class PoolCounts:
    pages: int  # pages the tree holds
    locked: int  # of those, pinned by a lock
    tombstones: int  # logical pages whose device shadow in this pool is gone (-1)
    host: int = 0  # pages the tree holds on the host tier

    @property
    def evictable(self) -> int:
        return self.pages - self.locked


@dataclass(frozen=True)
class TreeStats:
    nodes: int
    cached_pages: int  # logical pages (token runs) in the tree
    pools: dict[str, PoolCounts]
    resume_points: int  # page boundaries a request could resume at exactly
    kept_checkpoints: int  # of those, kept by the checkpoint policy

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "cached_pages": self.cached_pages,
            "resume_points": self.resume_points,
            "kept_checkpoints": self.kept_checkpoints,
            "pools": {name: {"pages": c.pages, "locked": c.locked, "evictable": c.evictable,
                             "tombstones": c.tombstones, "host": c.host}
                      for name, c in self.pools.items()},
        }


def count_stats(tree: ShadowRadix) -> TreeStats:
    n_pools = tree.n_pools
    pages = np.zeros(n_pools, np.int64)
    locked = np.zeros(n_pools, np.int64)
    tombs = np.zeros(n_pools, np.int64)
    host = np.zeros(n_pools, np.int64)
    nodes = logical = resume = kept = 0
    kept_row = (tree.rule.checkpoint_rows or tuple(r for r, _ in tree.rule.windows) or (None,))[0]
    for node in tree.nodes():
        nodes += 1
        logical += node.n_pages
        present = node.pages >= 0
        pages += present.sum(axis=1)
        tombs += (~present).sum(axis=1)
        if node.host is not None:
            host += (node.host >= 0).sum(axis=1)
        for row, spec in enumerate(tree.layout.pools):
            if spec.retention is Retention.ALL:
                locked[row] += present[row].sum() if node.full_lock else 0
            else:
                locked[row] += (present[row] & (node.window_lock > 0)).sum()
        ok = tree.rule.resumable(node.pages)[1:]
        resume += int(ok.sum())
        if kept_row is not None:
            kept += int((ok & node.keep[kept_row]).sum())
    return TreeStats(
        nodes=nodes, cached_pages=logical,
        pools={p.name: PoolCounts(int(pages[i]), int(locked[i]), int(tombs[i]), int(host[i]))
               for i, p in enumerate(tree.layout.pools)},
        resume_points=resume, kept_checkpoints=kept)
