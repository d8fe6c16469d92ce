"""Objects carry their own key and checksum: a bad, truncated or misplaced object is
detected on read.

    magic "SRK2" | key length (2 bytes, LE) | key (utf-8) | payload length (8 bytes, LE)
    | xxh3_128(everything before it, then payload) | payload

The key (namespace, pool, page hash) is inside the checksummed header, so an object
copied or swapped to another key's place is refused even though its bytes are intact.
"""

from __future__ import annotations

import xxhash

MAGIC = b"SRK2"
_DIGEST = 16


class CorruptObject(ValueError):
    """An object failed its integrity check; treat it as a miss."""


class WrongKey(CorruptObject):
    """An intact object that belongs to another key (moved, copied or swapped)."""


def _header(key: str, size: int) -> bytes:
    k = key.encode()
    return MAGIC + len(k).to_bytes(2, "little") + k + size.to_bytes(8, "little")


def encode(key: str, payload: bytes) -> bytes:
    """The stored form of `payload` under `key`."""
    head = _header(key, len(payload))
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(payload)
    return head + h.digest() + payload


def decode(key: str, blob: bytes) -> bytes:
    """The payload of `blob` read from `key`'s place; CorruptObject naming what is wrong,
    WrongKey if it is an intact object of another key."""
    if len(blob) < 6 or blob[:4] != MAGIC:
        raise CorruptObject("not a shadowradix object (bad magic or shorter than its header)")
    end = 6 + int.from_bytes(blob[4:6], "little") + 8
    if len(blob) < end + _DIGEST:
        raise CorruptObject("truncated header")
    size = int.from_bytes(blob[end - 8:end], "little")
    payload = memoryview(blob)[end + _DIGEST:]
    if len(payload) != size:
        raise CorruptObject(f"truncated: {len(payload)} of {size} payload bytes")
    h = xxhash.xxh3_128()
    h.update(memoryview(blob)[:end])
    h.update(payload)
    if h.digest() != blob[end:end + _DIGEST]:
        raise CorruptObject("checksum mismatch")
    stored = bytes(blob[6:end - 8])
    if stored != key.encode():
        raise WrongKey(f"object of key {stored.decode(errors='replace')!r} found at {key!r}")
    return bytes(payload)
