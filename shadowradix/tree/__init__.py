"""ShadowRadix: the logical radix tree with per-pool shadows. Pure Python + numpy."""

from shadowradix.tree.node import Node
from shadowradix.tree.policy import POLICIES, CheckpointPolicy, periodic
from shadowradix.tree.radix import ShadowRadix, as_tokens
from shadowradix.tree.results import EvictResult, InsertResult, LockHandle, MatchResult, Peek
from shadowradix.tree.rules import MatchRule
from shadowradix.tree.spill import SpillRoom
from shadowradix.tree.stats import PoolCounts, TreeStats
from shadowradix.tree.tier import DEVICE, HOST, Tier

__all__ = [
    "DEVICE",
    "HOST",
    "POLICIES",
    "CheckpointPolicy",
    "EvictResult",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "MatchRule",
    "Node",
    "Peek",
    "PoolCounts",
    "ShadowRadix",
    "SpillRoom",
    "Tier",
    "TreeStats",
    "as_tokens",
    "periodic",
]
