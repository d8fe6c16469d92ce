"""HiCache tiers. Today: the device tier (tree + pools); host and storage build on it."""

from shadowradix.tiers.prefix_cache import PrefixCache

__all__ = ["PrefixCache"]
