"""What the model is handed for one request's forward: page tables, pool storage, state.

The model never sees the tree. The engine gives it, per pool, the physical page
of every logical page the request touches; addresses are derived from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shadowradix.layout.spec import KVLayout
from shadowradix.pool.storage import PoolStorage


@dataclass
class CompressorState:
    """A request's running compressor state for one layer and one series.

    buffer_kv / buffer_gate: rows of the unfinished window (fewer than `ratio`).
    overlap_kv / overlap_gate: the Ca half of the last full window (CSA only);
    None before the first window closes.
    """

    buffer_kv: torch.Tensor
    buffer_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None


class C4Reader(Protocol):
    """Where a request's selected C4 entries come from when the C4 pool is not on the
    device (HiSparse: sparse/hot_buffer.py). Two phases per layer and step, so that every
    request's copies move together: `plan` takes one request's selection `[L, k]` (with
    its valid mask, its entry count and the address of any logical entry) and decides
    what must be copied; `fetch`, called on any one reader of the step, does the copies
    for every plan at once and returns each request's entries `[L, k, *entry]` on the
    device, in `picked`'s order."""

    def plan(self, layer: int, address: Callable[[torch.Tensor], torch.Tensor],
             picked: torch.Tensor, valid: torch.Tensor, count: int) -> Any: ...

    def fetch(self, layer: int, source: torch.Tensor, plans: list[Any]) -> list[torch.Tensor]:
        ...


@dataclass
class RequestKV:
    """One request's view of the pools.

    page_tables[pool]: long tensor, physical page of each logical page in [0, total pages).
    states[(layer, series)]: compressor state ("compressor" or "indexer").
    topk: when set (not None), each CSA layer appends to topk[layer] the C4 entries the
    indexer selected for the chunk's LAST query row, with the entry count then: (ids, count).
    The caller sets it only for forwards whose last row it wants (HiSparse's access stream);
    None, the default, records nothing.
    c4: with HiSparse, the request's C4 reader (its hot buffers); None reads the C4 pool
    directly.
    journal: set ({}) for a speculative step's chunk: every compressor and indexer records
    what `compressor.rewind_states` needs to put its state back at an accepted row, and
    `topk` records every row's selection, not only the last.
    """

    page_tables: dict[str, torch.Tensor]
    states: dict[tuple[int, str], CompressorState] = field(default_factory=dict)
    topk: dict[int, list[tuple[torch.Tensor, int]]] | None = None
    c4: C4Reader | None = None
    journal: dict[tuple[int, str], Any] | None = None


@dataclass(frozen=True)
class PagedStorage:
    """The device pools' tensors plus the mapping from model layer to pool layer."""

    layout: KVLayout
    pools: dict[str, PoolStorage]
    pool_layer: dict[tuple[str, int], int]  # (pool, model layer) -> layer index in that pool

    @classmethod
    def for_layer_types(cls, layout: KVLayout, pools: dict[str, PoolStorage],
                        layer_types: list[str]) -> PagedStorage:
        index: dict[tuple[str, int], int] = {}
        counts = {"compressed_sparse_attention": 0, "heavily_compressed_attention": 0}
        for i, kind in enumerate(layer_types):
            index[("swa", i)] = i
            if kind in counts:
                names = (("c4", "c4_index", "state") if kind == "compressed_sparse_attention"
                         else ("c128",))
                for name in names:
                    index[(name, i)] = counts[kind]
                counts[kind] += 1
        return cls(layout, pools, index)

    def flat(self, pool: str, layer: int) -> torch.Tensor:
        """Entries of `pool` for model layer `layer`, as [pages * page_entries, *entry]."""
        return self.pools[pool].flat(self.pool_layer[(pool, layer)])

    def address(self, pool: str, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat entry index of each token position (DESIGN.md §2: derived, never stored)."""
        spec = self.layout.pool(pool)
        return spec.entry_index(table, positions, self.layout.page_size,
                                self.pools[pool].page_entries)

    def page_entry(self, pool: str, pages: Any) -> Any:
        """Flat index of the first entry of each page (a CHECKPOINT pool's one entry)."""
        return pages * self.pools[pool].page_entries
