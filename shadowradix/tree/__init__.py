"""ShadowRadix: the logical radix tree with per-pool shadows. Pure Python + numpy."""

from shadowradix.tree.node import Node
from shadowradix.tree.policy import POLICIES, CheckpointPolicy, periodic
from shadowradix.tree.radix import ShadowRadix, as_tokens
from shadowradix.tree.results import EvictResult, InsertResult, LockHandle, MatchResult
from shadowradix.tree.rules import MatchRule
from shadowradix.tree.stats import PoolCounts, TreeStats

__all__ = [
    "POLICIES",
    "CheckpointPolicy",
    "EvictResult",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "MatchRule",
    "Node",
    "PoolCounts",
    "ShadowRadix",
    "TreeStats",
    "as_tokens",
    "periodic",
]
