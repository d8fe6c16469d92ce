"""CacheConfig and SamplingParams: explicit configuration, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """How much cache the engine keeps, and where.

    page_size: tokens per logical page (a multiple of every compression ratio).
    device_tokens: L1 capacity in logical tokens; every pool is sized from it.
    storage: L3, "file:///dir" or "redis://host:port/db": computed pages are written
        through, and a request that misses the device loads what it can from there.
    host_tokens / hisparse_buffer: the host tier and HiSparse (not built yet: 0 / None).
    """

    page_size: int = 256
    device_tokens: int = 65536
    host_tokens: int = 0
    storage: str | None = None
    hisparse_buffer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.device_tokens, int) or self.device_tokens < self.page_size:
            raise ValueError(f"device_tokens must be an int >= page_size ({self.page_size}), "
                             f"got {self.device_tokens!r}")
        if self.host_tokens:
            raise ValueError("host_tokens: the host tier (HiCache) is not available yet; use 0")
        if self.storage is not None and not self.storage.startswith(
                ("file://", "redis://", "rediss://")):
            raise ValueError(f"storage must be None, 'file:///DIR' or 'redis://HOST:PORT/DB', "
                             f"got {self.storage!r}")
        if self.hisparse_buffer is not None:
            raise ValueError("hisparse_buffer: HiSparse is not available yet; use None")


@dataclass(frozen=True)
class SamplingParams:
    """Greedy, or temperature / top-p sampling reproducible from `seed`."""

    max_new_tokens: int = 16
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
