"""Tensor storage behind a pool: `[layers, pages, entries_per_page, *entry]`.

Only this module imports torch in the `pool` layer, and only when a pool is
given real storage.
"""

from __future__ import annotations

from typing import Any

from shadowradix.layout.spec import PoolSpec


class PoolStorage:
    """The bytes of one pool, on any torch device. Addresses are derived, never stored."""

    def __init__(self, spec: PoolSpec, page_size: int, num_pages: int, device: Any = "cpu",
                 pin_memory: bool = False) -> None:
        import torch

        if spec.entry_bytes_override is not None:
            raise ValueError(f"pool {spec.name!r} has a packed entry size; it is metadata-only")
        self.spec = spec
        self.page_size = page_size
        shape = (spec.layers, num_pages, spec.entries_per_page(page_size), *spec.entry_shape)
        self.data = torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=device,
                                pin_memory=pin_memory)

    def flat(self, layer: int) -> Any:
        """One layer's entries as `[pages * entries_per_page, *entry]` (a view)."""
        return self.data[layer].flatten(0, 1)
