"""A recorded top-k access stream: which C4 entries one (request, CSA layer) read per decode step.

HiSparse's replacement policy is judged offline against such streams (DESIGN.md §6), so a
stream is plain data: it can be saved as JSON and replayed later, without torch or a model.

Stored compactly, like a CSR matrix: `ids` holds every step's selected entry ids back to back,
`offsets[i]:offsets[i + 1]` is step i's slice, and `counts[i]` is how many C4 entries existed
at step i (entry w exists once its 4-token window is closed, so ids of step i lie in
[0, counts[i])).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT = "shadowradix.access_stream/1"


def _frozen_ints(values: Any, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class AccessStream:
    """One (request, layer)'s decode-time selections. Immutable; arrays are read-only copies.

    top_k: the indexer's k (a step selects min(k, count) entries in the engine; a stream
    may select fewer, never more). Construction validates everything and raises ValueError
    (TypeError for non-integer data) naming what is wrong: counts must be non-negative and
    non-decreasing (a request's history only grows), and each step's ids distinct and in
    [0, count).
    """

    top_k: int
    counts: np.ndarray  # int64 [steps]
    offsets: np.ndarray  # int64 [steps + 1], offsets[0] == 0, offsets[-1] == len(ids)
    ids: np.ndarray  # int64 [total selections]

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer) or (
                self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1, got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        for name in ("counts", "offsets", "ids"):
            object.__setattr__(self, name, _frozen_ints(getattr(self, name), name))
        counts, offsets, ids = self.counts, self.offsets, self.ids
        if offsets.size != counts.size + 1 or offsets[0] != 0 or offsets[-1] != ids.size:
            raise ValueError(f"offsets must have len(counts) + 1 = {counts.size + 1} values "
                             f"from 0 to len(ids) = {ids.size}, got {offsets.size} values "
                             f"from {offsets[0] if offsets.size else None}")
        sizes = np.diff(offsets)
        if (sizes < 0).any():
            raise ValueError("offsets must be non-decreasing")
        if sizes.size and sizes.max() > self.top_k:
            step = int(np.argmax(sizes))
            raise ValueError(f"step {step} selects {sizes[step]} entries, more than "
                             f"top_k = {self.top_k}")
        if counts.size and (counts[0] < 0 or (np.diff(counts) < 0).any()):
            raise ValueError("counts must be non-negative and non-decreasing (entries are "
                             "only ever added to a request's history)")
        step_of = np.repeat(np.arange(counts.size), sizes)
        bad = (ids < 0) | (ids >= counts[step_of])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"step {step_of[i]} selects entry {ids[i]}, outside "
                             f"[0, {counts[step_of[i]]}): an entry can be selected only once "
                             "it exists")
        if ids.size:
            order = np.lexsort((ids, step_of))
            same = (np.diff(step_of[order]) == 0) & (np.diff(ids[order]) == 0)
            if same.any():
                j = order[int(np.argmax(same))]
                raise ValueError(f"step {step_of[j]} selects entry {ids[j]} twice")

    # ------------------------------------------------------------ building
    @classmethod
    def from_steps(cls, top_k: int,
                   steps: Iterable[tuple[Sequence[int] | np.ndarray, int]]) -> AccessStream:
        """Build from (selected ids, entry count) per decode step, in step order."""
        counts: list[int] = []
        parts: list[np.ndarray] = []
        for selected, count in steps:
            counts.append(int(count))
            parts.append(np.asarray(selected, dtype=np.int64).reshape(-1))
        sizes = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return cls(top_k, np.asarray(counts, dtype=np.int64), offsets, ids)

    # ------------------------------------------------------------ reading
    def __len__(self) -> int:
        """Decode steps recorded."""
        return int(self.counts.size)

    def step(self, i: int) -> np.ndarray:
        """Step i's selected entry ids (a read-only view)."""
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def steps(self) -> list[tuple[np.ndarray, int]]:
        """Every step as (selected ids, entry count): the inverse of `from_steps`."""
        return [(self.step(i), int(self.counts[i])) for i in range(len(self))]

    @property
    def selections(self) -> int:
        return int(self.ids.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AccessStream):
            return NotImplemented
        return (self.top_k == other.top_k and np.array_equal(self.counts, other.counts)
                and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.ids, other.ids))

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable-looking arrays

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (plain ints); `from_dict` reads it back to an equal stream.

        Per step only its size is stored beside the flat ids, so the text stays about one
        number per selection."""
        return {"format": FORMAT, "top_k": self.top_k, "counts": self.counts.tolist(),
                "sizes": np.diff(self.offsets).tolist(), "ids": self.ids.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AccessStream:
        """Inverse of `to_dict`. Raises ValueError on another format or inconsistent data."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not an access stream: expected format {FORMAT!r}, got {got!r}")
        sizes = _frozen_ints(data["sizes"], "sizes")
        if (sizes < 0).any():
            raise ValueError("sizes must be non-negative")
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return cls(data["top_k"], data["counts"], offsets, data["ids"])
