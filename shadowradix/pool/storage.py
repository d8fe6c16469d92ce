"""Tensor storage behind a pool: `[layers, pages, entries_per_page, *entry]`.

Only this module imports torch in the `pool` layer, and only when a pool is
given real storage. A pool of its own has one contiguous tensor; a pool over an
arena (pool/arena.py) is a strided view of the arena's bytes, each page one
contiguous block `[layers, entries_per_page, *entry]` `stride` bytes after the
one before.
"""

from __future__ import annotations

from typing import Any

from shadowradix.layout.spec import PoolSpec


class PoolStorage:
    """The bytes of one pool, on any torch device. Addresses are derived, never stored:
    entry e of page p of a layer is `flat(layer)[p * page_entries + e]`."""

    def __init__(self, spec: PoolSpec, page_size: int, num_pages: int, device: Any = "cpu",
                 pin_memory: bool = False) -> None:
        import torch

        _check_packed(spec)
        self.spec = spec
        self.page_size = page_size
        shape = (spec.layers, num_pages, spec.entries_per_page(page_size), *spec.entry_shape)
        self.data = torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=device,
                                pin_memory=pin_memory)
        self.page_entries = spec.entries_per_page(page_size)
        self._flat = [self.data[layer].flatten(0, 1) for layer in range(spec.layers)]

    @classmethod
    def over(cls, arena: Any, spec: PoolSpec, page_size: int, num_pages: int,
             stride: int) -> PoolStorage:
        """A view of `arena` (a uint8 tensor) in which page p is the block at byte
        p * stride; `stride` is a multiple of the entry's bytes."""
        import torch

        _check_packed(spec)
        dtype = getattr(torch, spec.dtype)
        elems = arena.view(dtype)
        entry = spec.entry_bytes
        epp = spec.entries_per_page(page_size)
        if stride % entry or stride < spec.page_bytes(page_size):
            raise ValueError(f"pool {spec.name!r}: stride {stride} is not a whole number of "
                             f"entries covering a page")
        size = elems.element_size()
        inner = [1]
        for d in reversed(spec.entry_shape[1:]):
            inner.insert(0, inner[0] * d)
        per_entry = entry // size
        self = cls.__new__(cls)
        self.spec = spec
        self.page_size = page_size
        self.page_entries = stride // entry
        self.data = elems.as_strided(
            (spec.layers, num_pages, epp, *spec.entry_shape),
            (epp * per_entry, stride // size, per_entry, *inner))
        reach = elems.numel() // per_entry  # entries from the arena start
        self._flat = [elems.as_strided((reach - layer * epp, *spec.entry_shape),
                                       (per_entry, *inner), layer * epp * per_entry)
                      for layer in range(spec.layers)]
        return self

    def flat(self, layer: int) -> Any:
        """One layer's entries as `[pages * page_entries, *entry]` (a view)."""
        return self._flat[layer]


def _check_packed(spec: PoolSpec) -> None:
    if spec.entry_bytes_override is not None:
        raise ValueError(f"pool {spec.name!r} has a packed entry size; it is metadata-only")
