"""shadowradix: KV cache management for hybrid-attention LLMs (DeepSeek-V4 first).

Importing the package does not import torch; the tree and the simulator run
without it.
"""

from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tree import CheckpointPolicy, ShadowRadix

__version__ = "0.1.0"

__all__ = ["CacheConfig", "CheckpointPolicy", "Engine", "KVLayout", "PoolSpec", "PrefixCache",
           "Retention", "SamplingParams", "ShadowRadix", "SpecConfig", "__version__"]

_ENGINE = {"Engine", "CacheConfig", "SamplingParams", "SpecConfig"}


def __getattr__(name: str) -> object:
    """The engine needs torch and transformers: import it only when asked for."""
    if name in _ENGINE:
        from shadowradix import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'shadowradix' has no attribute {name!r}")
