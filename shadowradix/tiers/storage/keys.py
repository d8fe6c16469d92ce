"""L3 object keys (DESIGN.md §5): a chained 128-bit hash of each page's tokens from the
root, one object per (page, pool), in a namespace that fingerprints the layout so two
models (or dtypes, or page sizes) never share objects."""

from __future__ import annotations

import numpy as np
import xxhash

from shadowradix.layout.spec import KVLayout


def namespace(layout: KVLayout) -> str:
    """Stable name of everything that changes a page's bytes."""
    return "sr1-" + xxhash.xxh3_64_hexdigest(layout.fingerprint().encode())


def page_hashes(tokens: np.ndarray, page_size: int) -> list[bytes]:
    """h_i = xxh3_128(h_{i-1} || tokens of page i), for every whole page of `tokens`.

    The chain makes a page's key depend on its entire prefix: equal keys mean equal
    prefixes (up to a 2^-128 collision; a stored object's checksum still guards its bytes).
    """
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    out: list[bytes] = []
    prev = b""
    for i in range(arr.size // page_size):
        prev = xxhash.xxh3_128_digest(prev + arr[i * page_size:(i + 1) * page_size].tobytes())
        out.append(prev)
    return out


def object_key(ns: str, pool: str, page_hash: bytes) -> str:
    return f"{ns}/{pool}/{page_hash.hex()}"
