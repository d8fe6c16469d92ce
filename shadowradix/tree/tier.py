"""The cache tiers a page can live in (HiCache, DESIGN.md §5)."""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Indexes a node's shadows (`Node.slot`) and the tree's per-tier books. Storage (L3)
    is not a tier of the tree: it is addressed by page hashes, outside it."""

    DEVICE = 0
    HOST = 1


DEVICE, HOST = Tier.DEVICE, Tier.HOST
