"""L3 object keys (DESIGN.md §5): a chained 128-bit hash of each page's tokens from the
root, one object per (page, pool), in a namespace that fingerprints what determines a
page's bytes, so two models (or weights, dtypes, layouts, page sizes) never share objects."""

from __future__ import annotations

import re

import numpy as np
import xxhash

from shadowradix.layout.spec import KVLayout

# What a namespace, a pool name and a key look like; the file backend only ever lists,
# reads or deletes paths built from names of these shapes.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
DIGEST = re.compile(r"[0-9a-f]{32}")


def namespace(layout: KVLayout, model_fingerprint: str) -> str:
    """Stable name of everything that changes a page's bytes: the layout (pools, dims,
    dtype, page size) and the model (config and weights, see `model_fingerprint`)."""
    if not model_fingerprint:
        raise ValueError("model_fingerprint must be a non-empty string: the KV depends on "
                         "the weights; use shadowradix.model.fingerprint.model_fingerprint")
    text = layout.fingerprint() + "\n" + model_fingerprint
    return "sr2-" + xxhash.xxh3_128_hexdigest(text.encode())


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


def split_key(key: str) -> tuple[str, str, str]:
    """(namespace, pool, hex digest); ValueError for a key `object_key` cannot make."""
    parts = key.split("/")
    if (len(parts) != 3 or not NAME.fullmatch(parts[0]) or not NAME.fullmatch(parts[1])
            or not DIGEST.fullmatch(parts[2])):
        raise ValueError(f"{key!r} is not an L3 key; build keys with object_key(ns, pool, "
                         f"16-byte hash)")
    return parts[0], parts[1], parts[2]
