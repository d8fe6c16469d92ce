"""`engine.cache`: operations on the cache tiers (flush)."""

from __future__ import annotations

from collections.abc import Sequence

from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import flush_device
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage_tier import StorageTier
from shadowradix.tree.tier import HOST

TIERS = ("device", "host", "storage")


class CacheControl:
    """`engine.cache`: operations on the cache tiers."""

    def __init__(self, cache: PrefixCache, storage: StorageTier | None,
                 host: HostTier | None = None) -> None:
        self._cache = cache
        self._storage = storage
        self._host = host

    def flush(self, tiers: str | Sequence[str] = ("device",)) -> None:
        """Drop every unlocked page from the named tiers ("device", "host", "storage"; a
        bare name is one tier).

        "storage" deletes every object of this model (its layout and weights) from the
        store, including those other engines sharing it wrote. Raises ValueError on an
        unknown name, or on a tier this engine does not have, before flushing anything;
        StorageUnavailable (a RuntimeError) if the store did not answer, so objects may
        remain (the other tiers named are flushed first).
        """
        if isinstance(tiers, str):
            tiers = (tiers,)
        bad = [t for t in tiers if t not in TIERS]
        if bad:
            raise ValueError(f"cannot flush tiers {bad}; use names from {TIERS}")
        if "host" in tiers and not self._cache.has_host:
            raise ValueError("this engine has no host tier (CacheConfig.host_tokens = 0)")
        if "storage" in tiers and self._storage is None:
            raise ValueError("this engine has no storage tier (CacheConfig.storage = None)")
        if "device" in tiers:
            flush_device(self._cache, self._host)
        if "host" in tiers:
            self._cache.flush(HOST)
        if "storage" in tiers:
            assert self._storage is not None
            self._storage.clear()
