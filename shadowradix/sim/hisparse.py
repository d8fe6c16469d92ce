"""HiSparse capacity planning (DESIGN.md §6): the device bytes one decoding request needs,
with and without hot buffers. Pure arithmetic over a layout: no torch, no tree walk.

A decoding request at context T has written positions [0, T), one token per step, in pages
of `ps` tokens. `hold` is what the manager keeps before the point it last handed to the
tree (`MatchRule.lock_pages`: the window's pages, at least 1 with a state pool). Per pool,
with the default policy (tombstones on), its device pages are:

    # retention   device pages                 why
    # ALL         ceil(T / ps)                 every earlier entry is read (the last page
    #                                          is allocated whole)
    # WINDOW      min(ceil(T / ps), hold + 1)  the pages the window reaches into, plus the
    #                                          page being written
    # CHECKPOINT  min(T // ps, hold + 1)       whole pages only: the state at the last
    #                                          hand-over, plus the page just completed until
    #                                          it is handed over (the decode step's peak)

and bytes = pages * `PoolSpec.page_bytes(ps)`. `CacheManager.peak_pages(T, 1)` bounds
the short-lived pools at 2 * hold + 2 for admission: it also counts the matched resume
point's pages (locked only until the first hand-over) and a chunk straddling a page end;
a request in steady decode holds the figures above (tests drive a CacheManager to check).

HiSparse on (buffer N): the c4 pool lives in host memory, the device holds the request's
hot buffers instead, N entries per CSA layer whatever the history (the engine allocates
them whole): N * entry_bytes * layers. With a C4 history shorter than N the buffer is
larger than the pages it replaces, and the figures say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shadowradix.layout.presets import DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO
from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.sim.sizing import GB
from shadowradix.tree.rules import MatchRule

C4 = "c4"  # the pool HiSparse moves to the host
INDEX_TOPK = {"deepseek-v4-flash": int(DEEPSEEK_V4_FLASH.index_topk),
              "deepseek-v4-pro": int(DEEPSEEK_V4_PRO.index_topk)}


@dataclass(frozen=True)
class DecodeFootprint:
    """Bytes one decoding request holds at `context` tokens, per pool.

    device: what it needs on the device (HiSparse on: the c4 entry is its hot buffers).
    host: what HiSparse keeps in host memory instead (the C4 history); empty when off.
    """

    context: int
    buffer: int | None
    device: dict[str, int]
    host: dict[str, int]

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def requests_per_gb(self, gb: float = 1.0) -> int:
        """Decoding requests at this context that fit in `gb` GB (2**30 bytes) of device."""
        return int(gb * GB // self.device_bytes)


def decode_pages(layout: KVLayout, context: int) -> dict[str, int]:
    """Device pages per pool of one decoding request at `context` tokens, HiSparse off
    (the table in the module docstring)."""
    _check_context(context)
    ps = layout.page_size
    touched, whole = -(-context // ps), context // ps
    hold = MatchRule.of(layout).lock_pages
    out = {}
    for spec in layout.pools:
        if spec.retention is Retention.ALL:
            out[spec.name] = touched
        elif spec.retention is Retention.WINDOW:
            out[spec.name] = min(touched, hold + 1)
        else:
            out[spec.name] = min(whole, hold + 1)
    return out


def decode_footprint(layout: KVLayout, context: int, buffer: int | None = None, *,
                     index_topk: int | None = None,
                     page_size: int | None = None) -> DecodeFootprint:
    """Device (and host) bytes of one decoding request at `context` tokens.

    buffer: HiSparse's hot buffer, C4 entries per CSA layer; None: off. It must be at
        least `index_topk + 1` (the newest entry needs a slot besides the top-k read), so
        `index_topk` (the model's: 512 for V4-Flash, 1024 for V4-Pro, `INDEX_TOPK`) is
        required with it. page_size: cut the layout's pools into other pages.
    Changes nothing. Raises ValueError naming the bad argument, or a layout with no c4
    pool when `buffer` is given.
    """
    if page_size is not None:
        layout = layout.with_page_size(page_size)
    pages = decode_pages(layout, context)
    device = {p.name: pages[p.name] * p.page_bytes(layout.page_size) for p in layout.pools}
    if buffer is None:
        return DecodeFootprint(context, None, device, {})
    _check_buffer(layout, buffer, index_topk)
    c4 = layout.pool(C4)
    host = {C4: device[C4]}
    device[C4] = buffer * c4.entry_bytes * c4.layers
    return DecodeFootprint(context, buffer, device, host)


def hisparse_rows(layout: KVLayout, contexts: list[int], buffer: int,
                  index_topk: int) -> list[dict[str, Any]]:
    """Per context, HiSparse off against on: bytes per request, decoding requests per
    device GB (floored), and `ratio` = device bytes off / on, how many times more
    decoding requests the same device memory holds (exact; the floors are coarse once a
    request takes a sizeable share of a GB). JSON-ready."""
    rows = []
    for t in contexts:
        off = decode_footprint(layout, t)
        on = decode_footprint(layout, t, buffer, index_topk=index_topk)
        rows.append({
            "context": t, "device_bytes_off": off.device_bytes,
            "device_bytes_on": on.device_bytes, "host_bytes_on": on.host_bytes,
            "device_pool_bytes_off": off.device, "device_pool_bytes_on": on.device,
            "requests_per_gb_off": off.requests_per_gb(),
            "requests_per_gb_on": on.requests_per_gb(),
            "ratio": off.device_bytes / on.device_bytes,
        })
    return rows


def index_topk_of(model: str) -> int:
    """The indexer's top-k of a `--model` name: a preset, or a config.json's index_topk."""
    if model in INDEX_TOPK:
        return INDEX_TOPK[model]
    if model.endswith(".json"):
        try:
            with open(model, encoding="utf-8") as f:
                return int(json.load(f)["index_topk"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read index_topk from {model} ({e}); "
                             "pass --index-topk") from None
    raise ValueError(f"model {model!r} has no compressed sparse attention to keep hot; "
                     f"HiSparse needs one of {', '.join(INDEX_TOPK)} or a DeepSeek-V4 "
                     "config.json")


def parse_contexts(text: str) -> list[int]:
    """'16384,65536' -> [16384, 65536]; ValueError naming a bad entry."""
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"--context takes tokens, comma-separated; got {part!r}") from None
    for t in out:
        _check_context(t)
    return out


def _check_context(context: int) -> None:
    if not _is_int(context) or context < 1:
        raise ValueError(f"context must be an int >= 1 (tokens), got {context!r}")


def _check_buffer(layout: KVLayout, buffer: int, index_topk: int | None) -> None:
    if index_topk is None or not _is_int(index_topk) or index_topk < 1:
        raise ValueError(f"index_topk must be the model's indexer top-k (an int >= 1) when "
                         f"buffer is set, got {index_topk!r}")
    if not _is_int(buffer) or buffer < index_topk + 1:
        raise ValueError(f"buffer must be an int >= index_topk + 1 = {index_topk + 1}, "
                         f"got {buffer!r}")
    if C4 not in layout.pool_names:
        raise ValueError(f"layout {layout.name!r} has no {C4!r} pool (no compressed sparse "
                         "attention): HiSparse has nothing to keep hot")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
