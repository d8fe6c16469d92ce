"""How much device memory HiSparse's hot buffers take (sparse/hot_buffer.py), from the
layout alone: the engine sizes them with it, and the server checks `--device-bytes` with it
before any model loads."""

from __future__ import annotations

from shadowradix.layout.spec import KVLayout


def hot_sets(layout: KVLayout, buffer: int, requests: int | None, c4_pages: int,
             device_bytes: int | None = None) -> int:
    """Hot-buffer sets on the device (at most this many requests run at once): `requests`,
    or by default as many as the bytes the C4 pool would have taken on the device hold:
    `c4_pages` of it (`device_tokens`'), or over a `device_bytes` budget C4's share of it
    (its pages where every pool holds the same tokens), and at least one set. So turning
    HiSparse on never grows device memory, and a budget that serves with it off still
    builds with it on wherever one set fits in C4's share."""
    if requests is not None:
        return requests
    if device_bytes is not None:
        c4_pages = device_bytes // sum(layout.page_bytes().values())
    per_page = layout.pool("c4").entries_per_page(layout.page_size)
    return max(1, c4_pages * per_page // buffer)


def hot_bytes(layout: KVLayout, csa_layers: int, sets: int, buffer: int) -> int:
    """The bytes of `sets` hot-buffer sets of `buffer` C4 entries per CSA layer."""
    return csa_layers * sets * buffer * layout.pool("c4").entry_bytes
