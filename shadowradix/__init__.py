"""shadowradix: KV cache management for hybrid-attention LLMs (DeepSeek-V4 first).

Importing the package does not import torch; the tree and the simulator run
without it.
"""

from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tree import CheckpointPolicy, ShadowRadix

__version__ = "0.1.0"

__all__ = ["CheckpointPolicy", "KVLayout", "PoolSpec", "PrefixCache", "Retention", "ShadowRadix",
           "__version__"]
