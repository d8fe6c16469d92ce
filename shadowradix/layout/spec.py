"""What one token becomes: pool specs and the layout that groups them.

A layout is pure arithmetic: it knows nothing about the tree, the allocators or
torch. Everything that sizes, addresses or fingerprints a pool starts here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Bytes per element for the dtypes a pool may hold. Names follow torch.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Retention(Enum):
    """How long a pool's pages are useful to a later request.

    ALL: every earlier position is read, so a prefix needs the whole history.
    WINDOW: only the last `window - 1` tokens before a resume point are read.
    CHECKPOINT: one entry per page, the running state at the page's end; only
        the entry at the resume point is read.
    """

    ALL = "all"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class PoolSpec:
    """One physical form of a token: its pool's name, granularity and entry shape.

    `ratio` is tokens per entry (1 for raw KV, 4 for C4, 128 for C128). A
    CHECKPOINT pool holds one entry per page and has no ratio (`None`).
    `window` is the sliding window `W` of a WINDOW pool, in tokens: a request
    resuming at position P reads `[P - W + 1, P)`.
    `entry_bytes` overrides `prod(entry_shape) * dtype size` for packed
    formats (e.g. fp8 values with per-block scales) in metadata-only layouts.
    """

    name: str
    ratio: int | None
    retention: Retention
    entry_shape: tuple[int, ...]
    dtype: str
    layers: int
    window: int = 0
    entry_bytes_override: int | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"pool name {self.name!r} must be a non-empty identifier")
        if self.retention is Retention.CHECKPOINT:
            if self.ratio is not None:
                raise ValueError(
                    f"pool {self.name!r}: a CHECKPOINT pool holds one entry per page; "
                    f"pass ratio=None, not {self.ratio}"
                )
        elif self.ratio is None or self.ratio < 1:
            raise ValueError(f"pool {self.name!r}: ratio must be an int >= 1, got {self.ratio}")
        if self.retention is Retention.WINDOW:
            if self.window < 1:
                raise ValueError(f"pool {self.name!r}: a WINDOW pool needs window >= 1")
        elif self.window:
            raise ValueError(f"pool {self.name!r}: window is only meaningful for WINDOW pools")
        if self.layers < 1:
            raise ValueError(f"pool {self.name!r}: layers must be >= 1, got {self.layers}")
        if not self.entry_shape or any(d < 1 for d in self.entry_shape):
            raise ValueError(
                f"pool {self.name!r}: entry_shape must be positive, got {self.entry_shape}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"pool {self.name!r}: unknown dtype {self.dtype!r}; "
                             f"use one of {sorted(DTYPE_BYTES)}")
        if self.entry_bytes_override is not None and self.entry_bytes_override < 1:
            raise ValueError(f"pool {self.name!r}: entry_bytes_override must be >= 1")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry in one layer."""
        if self.entry_bytes_override is not None:
            return self.entry_bytes_override
        return math.prod(self.entry_shape) * DTYPE_BYTES[self.dtype]

    def entries_per_page(self, page_size: int) -> int:
        return 1 if self.ratio is None else page_size // self.ratio

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page across all layers."""
        return self.entries_per_page(page_size) * self.entry_bytes * self.layers

    def bytes_per_token(self, page_size: int) -> float:
        """Bytes per cached token across all layers (a CHECKPOINT pool amortised per page)."""
        return self.page_bytes(page_size) / page_size

    def window_pages(self, page_size: int) -> int:
        """Pages before a page-aligned resume point that a WINDOW pool must still hold."""
        if self.retention is not Retention.WINDOW:
            return 0
        return -(-(self.window - 1) // page_size)

    def entry_index(self, page_table: Any, positions: Any, page_size: int,
                    page_entries: int | None = None) -> Any:
        """Derived address of each position's entry: page * page_entries + offset, where
        page_entries (the entries from one page's start to the next's) is
        entries_per_page unless the pool's pages are spaced wider (an arena's slabs).

        Works on numpy arrays and on torch tensors alike (only indexing and
        integer arithmetic). Positions of a CHECKPOINT pool address the state
        at the end of their page.
        """
        stride = self.entries_per_page(page_size) if page_entries is None else page_entries
        ratio = page_size if self.ratio is None else self.ratio
        return page_table[positions // page_size] * stride + (positions % page_size) // ratio


@dataclass(frozen=True)
class KVLayout:
    """The pools one model needs, and the page size they are cut into."""

    name: str
    pools: tuple[PoolSpec, ...]
    page_size: int

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("a layout needs at least one pool")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        object.__setattr__(self, "_rows", {n: i for i, n in enumerate(names)})  # index()
        object.__setattr__(self, "_names", tuple(names))  # pool_names
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        bad = [p for p in self.pools if p.ratio is not None and self.page_size % p.ratio]
        if bad:
            need = math.lcm(*(p.ratio for p in self.pools if p.ratio is not None))
            raise ValueError(
                f"page_size {self.page_size} is not a multiple of the ratio of "
                f"{', '.join(f'{p.name} ({p.ratio})' for p in bad)}; "
                f"use a multiple of {need}"
            )

    def index(self, name: str) -> int:
        """Row of pool `name` in page tables."""
        row = self._rows.get(name)  # type: ignore[attr-defined]
        if row is not None:
            return row
        raise KeyError(f"layout {self.name!r} has no pool {name!r}; pools: {self.pool_names}")

    def pool(self, name: str) -> PoolSpec:
        return self.pools[self.index(name)]

    @property
    def pool_names(self) -> tuple[str, ...]:
        return self._names  # type: ignore[attr-defined]

    def rows(self, retention: Retention) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.pools) if p.retention is retention)

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes per cached token, per pool, across all layers."""
        return {p.name: p.bytes_per_token(self.page_size) for p in self.pools}

    def total_bytes_per_token(self) -> float:
        return sum(self.bytes_per_token().values())

    def page_bytes(self) -> dict[str, int]:
        return {p.name: p.page_bytes(self.page_size) for p in self.pools}

    def fingerprint(self) -> str:
        """Stable text naming everything that changes the bytes of a page."""
        parts = [f"{self.name}|ps={self.page_size}"]
        for p in self.pools:
            parts.append(
                f"{p.name}:{p.ratio}:{p.retention.value}:{p.window}:"
                f"{'x'.join(map(str, p.entry_shape))}:{p.dtype}:{p.layers}:{p.entry_bytes}"
            )
        return ";".join(parts)

    def with_page_size(self, page_size: int) -> KVLayout:
        return KVLayout(self.name, self.pools, page_size)
