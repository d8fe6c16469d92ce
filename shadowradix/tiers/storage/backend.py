"""The small, batched interface every L3 backend implements (DESIGN.md §5).

Storage is optional at every step: a backend never raises for a fault of the store
(missing, corrupt, unwritable, full, unreachable) on a read or a write. It answers with
misses and failed writes, and counts each event in `errors`, so a fault costs recompute,
never a wrong token and never an exception in `generate`. The one exception is `clear`,
an explicit request: it raises StorageUnavailable when it could not finish.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence


class StorageUnavailable(RuntimeError):
    """The store did not answer an explicit request (`clear`); objects may remain."""


class StorageBackend(ABC):
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()  # fault kind -> count

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a cheap probe; a later get may still miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's payload, verified against its checksum and its key; None for a miss
        or a fault (a corrupt object, or an intact one of another key: both counted)."""

    @abstractmethod
    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Store payloads; True where the object is now durable, False where it failed."""

    @abstractmethod
    def clear(self, namespace: str) -> int:
        """Delete every object under `namespace` (one model's layout); returns how many.
        Other namespaces are untouched. Raises StorageUnavailable if the store did not
        answer or refused a deletion, so objects may remain."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections and files. Idempotent; the default holds nothing."""
