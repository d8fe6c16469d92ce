"""HiSparse's hot buffers (DESIGN.md §6): each running request's working set of C4 entries
on the device, one buffer of `capacity` entries per CSA layer; the full C4 history stays in
the host-resident C4 pool.

    # decode, history <= capacity   fast path: slot w holds entry w; new entries are
    #                               filled in as their windows close, no lookup
    # decode, history >  capacity   each selected entry is a hit (resident) or a miss:
    #                               copied from the host into a slot not selected this
    #                               step, least recently used first
    # verify (speculative decoding) the rows of one decode query and its drafts share the
    #                               buffer: the union of their selections is made resident
    #                               as one decode step would (staged instead when it does
    #                               not fit); entries the drafts' windows closed are
    #                               forgotten after the step (`forget`) unless accepted,
    #                               since the accepted tokens rewrite those addresses
    # prefill chunk (any rows)      staging: the union of the rows' selections is
    #                               gathered from the host once; residency is unchanged

Each layer and step runs in two phases (model/context.py's C4Reader): `plan` does one
request's bookkeeping and lists its copies; `fetch` serves every request's plan with one
host -> device copy for the buffers' misses and fills, and one for prefill staging.

Residency is keyed by the entry's physical address in the C4 pool (page, entry), not by
its position in the request, so copies of pages the tree shares are never confused with
a request's own; `remap` forgets entries whose page moved when the request's page table
changed. A buffer holds copies only: the C4 pool keeps every entry.

Without speculation, replacement matches `sparse.replay`'s LRU model step for step
(tests compare the live counters with an offline replay of the recorded stream; a verify
step's union lookup is not in that model): when a request leaves the fast
path its buffer holds the whole history, never-selected entries first (by id), then by
last selection; within a step hits are touched in selection order, then misses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

EMPTY = -2  # the stamp of an empty slot: filled before anything is evicted
NEVER = -1  # the stamp of a resident entry never selected (fast-path history)


class _Layer:
    """One request's buffer for one CSA layer: which entry each slot holds."""

    __slots__ = ("fast", "filled", "keys", "stamps", "where")

    def __init__(self, capacity: int) -> None:
        self.fast = True  # slot w holds entry w, for w < filled
        self.filled = 0
        self.keys = np.full(capacity, -1, dtype=np.int64)  # physical address per slot
        self.stamps = np.full(capacity, EMPTY, dtype=np.int64)
        self.where: dict[int, int] = {}  # physical address -> slot (off the fast path)


@dataclass
class _Plan:
    """One request's reads in one layer and step. Decode: `slots` (its buffer slot per
    selected row, `[k]`) after copying `src` rows of the pool into slots `dst`. Prefill:
    `src` are the distinct addresses to stage and `inverse` maps each selection to one.
    A verify step's `slots` are `[rows, k]`."""

    owner: int  # the request's set in the arena
    src: np.ndarray
    dst: np.ndarray | None = None  # decode only
    slots: np.ndarray | None = None  # decode only
    inverse: torch.Tensor | None = None  # prefill only


class HotBuffers:
    """The device arena of every hot buffer, `[csa layers, requests, capacity, *entry]`,
    and the counters `Engine.stats()["hisparse"]` reports. `acquire` hands a running
    request its buffers (None when all `requests` are taken: admission waits). per_page:
    C4 entries per page (a physical address // per_page is its page)."""

    def __init__(self, layers: Sequence[int], requests: int, capacity: int, per_page: int,
                 entry_shape: Sequence[int], dtype: torch.dtype, device: Any) -> None:
        self.layers = list(layers)
        self.capacity = capacity
        self.per_page = per_page  # C4 entries per page: a physical address // per_page
        self.requests = requests
        self.data = torch.zeros((len(self.layers), requests, capacity, *entry_shape),
                                dtype=dtype, device=device)
        self.entry_bytes = self.data[0, 0, 0].numel() * self.data.element_size()
        self._free = list(range(requests - 1, -1, -1))
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self.hits = dict.fromkeys(self.layers, 0)
        self.misses = dict.fromkeys(self.layers, 0)
        self.counts = {"fast_path_lookups": 0, "filled": 0, "staged": 0, "bytes_moved": 0}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def acquire(self) -> HotSet | None:
        if not self._free:
            return None
        return HotSet(self, self._free.pop())

    def release(self, hot: HotSet) -> None:
        if hot.slot is None:
            return
        self._free.append(hot.slot)
        hot.slot = None

    def stats(self) -> dict[str, Any]:
        """hits / misses count lookups off the fast path only; fast-path lookups (history
        within the buffer) apart, so the hit rate is not inflated. bytes_moved: every
        entry copied host -> device (misses, fast-path fills, prefill staging)."""
        totals = self.totals()
        per_layer = {layer: {"hits": self.hits[layer], "misses": self.misses[layer],
                             "hit_rate": _rate(self.hits[layer], self.misses[layer])}
                     for layer in self.layers}
        return {"enabled": True, "buffer": self.capacity, "requests": self.requests,
                "device_bytes": self.nbytes, **self.counts, **totals,
                "hit_rate": _rate(totals["hits"], totals["misses"]), "per_layer": per_layer}

    def fetch(self, layer: int, source: torch.Tensor, plans: list[_Plan]) -> list[torch.Tensor]:
        """Do every plan's copies for `layer`, then read each request's entries."""
        device = self.data.device
        buf = self.data[self._row[layer]].flatten(0, 1)  # [requests * capacity, *entry]
        moves = [(p.owner * self.capacity + p.dst, p.src) for p in plans
                 if p.dst is not None and p.src.size]
        if moves:  # the step's misses and fills: one gather on the host, one copy
            dst = np.concatenate([d for d, _ in moves])
            src = np.concatenate([r for _, r in moves])
            buf[torch.from_numpy(dst).to(device)] = _rows(source, src, device)
        staging = [p for p in plans if p.dst is None]
        staged = _rows(source, np.concatenate([p.src for p in staging]), device) if (
            staging) else None
        out, at = [], 0
        for p in plans:
            if p.slots is not None:
                slots = p.slots if p.slots.ndim == 2 else p.slots[None]
                out.append(buf[torch.from_numpy(p.owner * self.capacity + slots).to(device)])
            else:
                assert staged is not None and p.inverse is not None
                out.append(staged[at:at + p.src.size][p.inverse.to(device)])
                at += p.src.size
        return out

    def totals(self) -> dict[str, int]:
        """The running totals, cheaply (for gauges and counters between steps)."""
        return {"hits": sum(self.hits.values()), "misses": sum(self.misses.values()),
                "fast_path_lookups": self.counts["fast_path_lookups"],
                "bytes_moved": self.counts["bytes_moved"], "in_use": self.requests - self.free}

    def moved(self, kind: str, entries: int) -> None:
        self.counts[kind] += entries
        self.counts["bytes_moved"] += entries * self.entry_bytes


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


class HotSet:
    """One running request's hot buffers (the model's C4 reader, model/context.py)."""

    def __init__(self, arena: HotBuffers, slot: int) -> None:
        self.arena = arena
        self.slot: int | None = slot
        self._layers = {layer: _Layer(arena.capacity) for layer in arena.layers}
        self._tick = 0
        self._table: np.ndarray | None = None
        self.decoding = False  # set per chunk: a decode step (one output token fed back,
        # with its drafts on a speculative step)

    def remap(self, table: np.ndarray) -> None:
        """The request's C4 page table changed: forget entries on pages that moved. The
        new table is taken last: after a fault, the same call again forgets what is left
        (forgetting is idempotent)."""
        new, old = np.asarray(table).copy(), self._table
        if old is not None:
            n = min(old.size, new.size)
            moved = np.flatnonzero(old[:n] != new[:n])
            if moved.size:
                for state in self._layers.values():
                    _forget(state, old[moved], int(moved[0]), self.arena.per_page)
        self._table = new

    def forget(self, lo: int, hi: int) -> None:
        """Drop logical entries [lo, hi) wherever they are held: a speculative step wrote
        them from drafts the model rejected, and the accepted tokens will write other
        entries at the same addresses."""
        if lo >= hi:
            return
        for state in self._layers.values():
            if state.fast:  # slot w holds entry w: refill from lo
                state.filled = min(state.filled, lo)
                continue
            assert self._table is not None
            per_page = self.arena.per_page
            ids = np.arange(lo, hi)
            ids = ids[ids // per_page < self._table.size]
            pages = self._table[ids // per_page]
            for key in (pages * per_page + ids % per_page)[pages >= 0].tolist():
                slot = state.where.pop(key, None)
                if slot is not None:
                    state.keys[slot] = -1
                    state.stamps[slot] = EMPTY

    def reset(self) -> None:
        """Forget every entry: a step that failed between `plan` and `fetch` left slots
        recorded as holding entries that were never copied in. The next decode refills."""
        self._layers = {layer: _Layer(self.arena.capacity) for layer in self.arena.layers}

    def plan(self, layer: int, address: Callable[[torch.Tensor], torch.Tensor],
             picked: torch.Tensor, valid: torch.Tensor, count: int) -> _Plan:
        """Decide this request's reads for `layer` (see C4Reader): address(ids) is the
        physical address of logical entries `ids`; picked/valid `[L, k]` the indexer's
        selection (invalid ones are masked by the caller: any finite entry does); count
        the entries the request has (every id < count)."""
        assert self.slot is not None, "plan after release"
        rows = picked.shape[0]
        if not self.decoding:  # prefill: stage the union once
            return self._stage(address, picked, valid)
        state = self._layers[layer]
        capacity = self.arena.capacity
        selected = picked[0][valid[0]] if rows == 1 else torch.unique(picked[valid])
        if rows > 1 and selected.numel() > capacity:
            return self._stage(address, picked, valid)  # the union does not fit: stage it
        self._tick += 1
        if state.fast and count <= capacity:  # slot w holds entry w
            new = np.arange(state.filled, max(count, state.filled))
            src = new  # nothing to copy (empty) unless windows closed since the last step
            if new.size:
                src = address(torch.from_numpy(new).to(picked.device)).cpu().numpy()
                self.arena.moved("filled", new.size)
                state.stamps[state.filled:count] = NEVER
                state.filled = count
            state.stamps[selected.cpu().numpy()] = self._tick * (capacity + 1)
            self.arena.counts["fast_path_lookups"] += 1
            where = torch.where(valid, picked, torch.zeros_like(picked)).cpu().numpy()
            return _Plan(self.slot, src, new, where[0] if rows == 1 else where)
        if state.fast:  # leaving the fast path: slot w holds entry w, keyed by its address
            state.fast = False
            resident = torch.arange(state.filled, device=picked.device)
            state.keys[:state.filled] = address(resident).cpu().numpy()
            state.where = {int(k): w for w, k in enumerate(state.keys[:state.filled])}
        keys = address(selected).cpu().numpy()
        slots, missing = self._place(layer, state, keys)
        if rows == 1:
            every = np.zeros(picked.shape[1], dtype=np.int64)
            every[valid[0].cpu().numpy()] = slots
        else:  # each row's selections: their slots, by the position of the id in the union
            at = np.searchsorted(selected.cpu().numpy(), picked.cpu().numpy())
            every = np.where(valid.cpu().numpy(), slots[np.minimum(at, slots.size - 1)], 0)
        return _Plan(self.slot, keys[missing], slots[missing], every)

    def _stage(self, address: Callable[[torch.Tensor], torch.Tensor], picked: torch.Tensor,
               valid: torch.Tensor) -> _Plan:
        """Gather the union of the rows' selections once; residency is unchanged."""
        assert self.slot is not None
        addr = address(torch.where(valid, picked, torch.zeros_like(picked)))
        unique, inverse = torch.unique(addr, return_inverse=True)
        self.arena.moved("staged", int(unique.numel()))
        return _Plan(self.slot, unique.cpu().numpy(), inverse=inverse)

    def fetch(self, layer: int, source: torch.Tensor, plans: list[Any]) -> list[torch.Tensor]:
        """Every plan of the step's readers (one arena serves them all)."""
        return self.arena.fetch(layer, source, plans)

    def _place(self, layer: int, state: _Layer, keys: np.ndarray) -> tuple[np.ndarray,
                                                                             np.ndarray]:
        """The slot of each selected key, misses given the least recently used slots
        this step does not read. Returns (slots, indices of the misses in `keys`)."""
        capacity = self.arena.capacity
        slots = np.fromiter((state.where.get(int(k), -1) for k in keys), np.int64, keys.size)
        hit = slots >= 0
        missing = np.flatnonzero(~hit)
        stamps = state.stamps.copy()
        stamps[slots[hit]] = np.iinfo(np.int64).max  # never evict what this step reads
        victims = np.argsort(stamps, kind="stable")[:missing.size]
        for old in state.keys[victims].tolist():
            if old >= 0:
                del state.where[old]
        state.keys[victims] = keys[missing]
        state.where.update(zip(keys[missing].tolist(), victims.tolist(), strict=True))
        slots[missing] = victims
        # Touch hits in selection order, then misses (sparse.replay's LRU order).
        order = np.concatenate((np.flatnonzero(hit), missing))
        state.stamps[slots[order]] = self._tick * (capacity + 1) + np.arange(order.size)
        self.arena.hits[layer] += int(hit.sum())
        self.arena.misses[layer] += int(missing.size)
        self.arena.counts["bytes_moved"] += int(missing.size) * self.arena.entry_bytes
        return slots, missing


def _rows(source: torch.Tensor, rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """source[rows] on `device`: gathered where the pool lives, then one copy. From a
    pinned host pool to CUDA the gather lands in pinned memory and the copy is
    asynchronous on the current stream (the caching host allocator keeps the buffer alive
    until the copy is done), so the reads queued after it wait for it on the GPU only."""
    index = torch.from_numpy(rows)
    if device.type != "cuda" or not source.is_pinned():
        return source[index.to(source.device)].to(device)
    staging = torch.empty((rows.size, *source.shape[1:]), dtype=source.dtype, pin_memory=True)
    torch.index_select(source, 0, index, out=staging)
    return staging.to(device, non_blocking=True)


def _forget(state: _Layer, pages: np.ndarray, first: int, per_page: int) -> None:
    """Drop what a buffer holds from `pages` (physical) that left their logical place."""
    if state.fast:  # slot w holds entry w: refill from the first page that moved
        state.filled = min(state.filled, first * per_page)
        return
    gone = np.isin(state.keys // per_page, pages) & (state.keys >= 0)
    for slot in np.flatnonzero(gone):
        state.where.pop(int(state.keys[slot]), None)  # (gone already if a fault cut it short)
    state.keys[gone] = -1
    state.stamps[gone] = EMPTY
