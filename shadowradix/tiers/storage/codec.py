"""Objects carry their own checksum: a bad or truncated object is detected on read.

    magic "SRK1" | payload length (8 bytes, little endian) | xxh3_128(payload) | payload
"""

from __future__ import annotations

import xxhash

MAGIC = b"SRK1"
HEADER = len(MAGIC) + 8 + 16


class CorruptObject(ValueError):
    """An object failed its integrity check; treat it as a miss."""


def encode(payload: bytes) -> bytes:
    return MAGIC + len(payload).to_bytes(8, "little") + xxhash.xxh3_128_digest(payload) + payload


def decode(blob: bytes) -> bytes:
    """The payload, or CorruptObject naming what is wrong."""
    if len(blob) < HEADER or blob[:4] != MAGIC:
        raise CorruptObject("not a shadowradix object (bad magic or shorter than its header)")
    size = int.from_bytes(blob[4:12], "little")
    payload = blob[HEADER:]
    if len(payload) != size:
        raise CorruptObject(f"truncated: {len(payload)} of {size} payload bytes")
    if xxhash.xxh3_128_digest(payload) != blob[12:HEADER]:
        raise CorruptObject("checksum mismatch")
    return payload
