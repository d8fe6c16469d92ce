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

from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.codec import Codec, CorruptObject


class StorageUnavailable(RuntimeError):
    """The store did not answer an explicit request (`clear`); objects may remain."""


class StorageBackend(ABC):
    """`secret`: the store's shared secret (bytes or str, at least 16 bytes), or None.
    With one, every object carries a keyed digest and one that fails it is a counted
    miss ("forged"); without one, objects are only checksummed (see codec.py)."""

    def __init__(self, secret: bytes | str | None = None) -> None:
        self.errors: Counter[str] = Counter()  # fault kind -> count
        self.codec = Codec(secret)

    def verified(self, key: str, blob: bytes, size: int | None = None) -> bytes | None:
        """`blob`'s payload if it is an intact (and, with a secret, authentic) object of
        `key` with a `size`-byte payload; else None, counted by what is wrong."""
        if (size is not None and len(blob) > self.codec.stored_size(key, size)
                and blob[:4] == self.codec.magic):  # (another kind fails on its magic)
            self.errors["oversized"] += 1  # refused unparsed (and, mostly, unread)
            return None
        try:
            payload = self.codec.decode(key, blob)
        except CorruptObject as e:
            self.errors[self.codec.fault(e)] += 1
            return None
        if size is not None and len(payload) != size:
            self.errors["wrong_size"] += 1  # intact, but not a page of this layout
            return None
        return payload

    def breakers(self) -> list[CircuitBreaker]:
        """The circuit breakers of its endpoints (none for a store without one)."""
        return []

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a cheap probe; a later get may still miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Each key's payload, verified against its digest and its key; None for a miss
        or a fault (a corrupt or forged object, or an intact one of another key: all
        counted). `sizes[i]`: the payload size key i must have; a stored value longer
        than its object is refused ("oversized") before it is parsed, and where the store
        allows it (files, Redis GETRANGE) is never read whole into memory."""

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
