"""HiSparse (DESIGN.md §6): recorded top-k access streams and their offline replay.

Pure Python + numpy, no torch: a stream recorded by the engine can be replayed anywhere.
"""

from shadowradix.sparse.access import AccessStream
from shadowradix.sparse.replay import POLICIES, ReplayStats, min_capacity, replay, sweep

__all__ = ["POLICIES", "AccessStream", "ReplayStats", "min_capacity", "replay", "sweep"]
