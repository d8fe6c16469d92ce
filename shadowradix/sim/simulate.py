"""Capacity planning: replay a trace under several policies at equal bytes.

Drives the real tree and pools in metadata-only mode (no tensors), so a
DeepSeek-V4-Pro sized cache with terabytes of pools fits in a laptop's memory.
With `host_gb` the host tier (HiCache L2) runs too: the same HostTier as the
engine, its copies counted instead of made.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from shadowradix.layout.spec import KVLayout
from shadowradix.pool.arena import Arena
from shadowradix.sim.replay import CountingMover, replay
from shadowradix.sim.sizing import GB, budget_bytes, pages_for_budget, pages_for_shared_budget
from shadowradix.sim.storage import SimStorage
from shadowradix.sim.trace import TraceRequest
from shadowradix.tiers.host_tier import WRITE_POLICIES, HostTier
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tree.policy import ALIASES, POLICIES, CheckpointPolicy, periodic
from shadowradix.tree.tier import DEVICE, HOST

POLICY_NAMES = ("shadowradix", "end-only", "periodic", "eager-swa", "no-shadows")
EXTRA_POLICIES = ("adaptive-lifetime",)  # taken by name, not in the default comparison
TIERS = ("device", "host", "storage")
SHARED_FALLBACK_RATIO = 0.2  # the default policy's window share when a host tier is on


@dataclass(frozen=True)
class PolicyChoice:
    """A named tree policy plus how much of the budget its window pools get (None: the
    pools share one byte budget and the window pool's share follows the workload)."""

    name: str
    policy: CheckpointPolicy
    window_ratio: float | None


def policy_choice(name: str, checkpoint_every: int = 8, window_ratio: float = 0.1) -> PolicyChoice:
    """shadowradix, the default (tree/policy.py DEFAULT): checkpoints at sequence ends,
    branch points, learned offsets before sequence ends and every 16 pages, with one byte
    budget shared by every pool (no flags: checkpoint_every and window_ratio are ignored;
    "adaptive" is its old name). The static settings, for comparison: end-only (sequence
    ends and branch points, the old default), periodic (+ a checkpoint every K pages),
    eager SWA release (SGLang), no shadows (a conventional radix cache that keeps the
    window for every token). adaptive-lifetime: the default with a learned lifetime for
    loose resume points under its shared budget (tree/lifetime.py; not the default yet).
    ValueError for an unknown name, checkpoint_every < 1 or a
    window_ratio outside (0, 1] (0 is not "the shared budget": that is the default's)."""
    if not _is_int(checkpoint_every) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    if not 0 < window_ratio <= 1:  # False for nan
        raise ValueError(f"window_ratio must be in (0, 1], got {window_ratio!r}")
    name = ALIASES.get(name, name)
    if name == "periodic":
        return PolicyChoice(f"periodic-{checkpoint_every}", periodic(checkpoint_every),
                            window_ratio)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; use one of "
                         f"{', '.join(POLICY_NAMES + EXTRA_POLICIES)}")
    ratio = {"shadowradix": None, "adaptive-lifetime": None, "no-shadows": 1.0}.get(
        name, window_ratio)
    return PolicyChoice(name, POLICIES[name], ratio)


def make_cache(layout: KVLayout, choice: PolicyChoice, device_bytes: float,
               host_bytes: float = 0.0, arena: bool = False) -> PrefixCache:
    """The metadata-only cache a choice gets at these byte sizes: fixed pools split by its
    window_ratio, or (window_ratio None, device alone) pools that share one budget.
    With a host tier a shared-budget choice splits at SHARED_FALLBACK_RATIO instead.
    `arena`: a shared-budget choice draws its pages from the engine's arena (pool/arena.py:
    frames, so fragmentation counts; with a host tier too) instead of a byte count."""
    for what, size in (("device", device_bytes), ("host", host_bytes)):
        if not 0 <= size < math.inf:  # a huge device_gb times GB overflows to inf
            raise ValueError(f"{what} bytes must be a finite number >= 0, got {size!r}")
    ratio = _window_ratio(choice, bool(host_bytes) and not arena)
    # The host pools split as SGLang's whatever the device does (the arena is device only).
    host = (pages_for_budget(layout, host_bytes, ratio or SHARED_FALLBACK_RATIO)
            if host_bytes else None)
    if ratio is None and arena:
        return PrefixCache(layout, {}, choice.policy, host_pages=host,
                           arena=Arena(layout, int(device_bytes)))
    if ratio is None:
        return PrefixCache(layout, pages_for_shared_budget(layout, device_bytes), choice.policy,
                           budget=int(device_bytes))
    return PrefixCache(layout, pages_for_budget(layout, device_bytes, ratio), choice.policy,
                       host_pages=host)


def _window_ratio(choice: PolicyChoice, host: bool) -> float | None:
    """The window share a choice's pools split at. A shared budget (None) needs the device
    alone; with a host tier its pools split as SGLang's."""
    if choice.window_ratio is not None:
        return choice.window_ratio
    return SHARED_FALLBACK_RATIO if host else None


def _check_sizes(device_gb: float | None, host_gb: float, storage_gb: float,
                 write_policy: str) -> None:
    """ValueError for a size that is not a number of GB (NaN; infinity where only storage
    takes it) or a write policy the host tier would refuse, whether or not a host runs."""
    # In bytes too: a finite GB past about 1.7e299 overflows to infinity.
    if device_gb is not None and not 0 < device_gb * GB < math.inf:
        raise ValueError(f"device_gb must be a finite number > 0 whose bytes fit a float "
                         f"(below 1.6e299), got {device_gb!r}")
    if not 0 <= host_gb * GB < math.inf:
        raise ValueError(f"host_gb must be a finite number >= 0 whose bytes fit a float "
                         f"(below 1.6e299), got {host_gb!r}")
    if not storage_gb >= 0:
        raise ValueError(f"storage_gb must be >= 0 (inf: unbounded), got {storage_gb!r}")
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got "
                         f"{write_policy!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def bound_hit_rate(requests: Sequence[TraceRequest], page_size: int) -> float:
    """The infinite-cache bound. Each request leaves behind its `cached_blocks`: the blocks
    of its sequence (prompt + output) when it has a sequence chain, else those of its
    prompt (a made-up output matches nothing). For each request in order, k = leading
    `prompt_blocks` found among what earlier requests left behind;
    hit = floor(min(k * block_size, input_length - 1) / page_size) * page_size.
    Without chains this is the share of prompt blocks seen in earlier prompts, as before.
    Sharing is known to the block: a next turn resumes at the last full block of the
    sequence before it. A replay with unbounded memory reaches the bound exactly (tested)."""
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        k = 0
        for h in req.prompt_blocks:
            if h not in seen:
                break
            k += 1
        hit += min(k * req.block_size, req.input_length - 1) // page_size * page_size
        total += req.input_length
        seen.update(req.cached_blocks)
    return hit / max(total, 1)


def simulate(requests: Sequence[TraceRequest], layout: KVLayout, choice: PolicyChoice,
             device_gb: float | None, *, chunk_pages: int | None = 32,
             on_request: Callable[[int], None] | None = None,
             bound: float | None = None, host_gb: float = 0.0,
             write_policy: str = "write_through",
             storage_gb: float = 0.0, arena: bool = False) -> dict[str, Any]:
    """One replay; `device_gb=None` means unbounded memory; `host_gb` > 0 adds a host
    tier of that size (pools split like the device's); `storage_gb` > 0 an L3 store of
    that size (inf: unbounded); `arena`: see `make_cache`. Returns the JSON record."""
    _check_sizes(device_gb, host_gb, storage_gb, write_policy)
    arena = arena and device_gb is not None and choice.window_ratio is None
    ratio = _window_ratio(choice, bool(host_gb) and not arena)
    if device_gb is None:
        tokens = sum(r.input_length + r.output_length for r in requests) + layout.page_size
        pages = {p.name: -(-tokens // layout.page_size) + 1 for p in layout.pools}
        cache = PrefixCache(layout, pages, choice.policy, host_pages=(
            pages_for_budget(layout, host_gb * GB, ratio or 1.0) if host_gb else None))
    else:
        cache = make_cache(layout, choice, device_gb * GB, host_gb * GB, arena)
    pages = {n: p.num_pages for n, p in cache.pools.items()}
    budget = cache.budget
    host_pages = bool(cache.host_pools)
    mover = CountingMover()
    host = HostTier(cache, mover, write_policy) if host_pages else None  # type: ignore[arg-type]
    store = None
    if storage_gb:
        bytes_ = storage_gb * GB  # inf (or a size whose bytes overflow to it): unbounded
        store = SimStorage(cache, None if bytes_ == math.inf else bytes_)
    t0 = time.perf_counter()
    st = replay(cache, requests, with_output=True, chunk_pages=chunk_pages,
                on_request=on_request, host=host, storage=store)
    seconds = time.perf_counter() - t0
    frames = cache.stats().get("arena")  # what fragmentation the replay left
    cache.flush(DEVICE)
    if host_pages:
        cache.flush(HOST)
    leaked = {n: p.used_pages for tier in (DEVICE, HOST)
              for n, p in cache.tier_pools(tier).items() if p.used_pages}
    if leaked:
        raise AssertionError(f"pages leaked after the replay: {leaked}")
    if bound is None:
        bound = bound_hit_rate(requests, layout.page_size)
    page_bytes = layout.page_bytes()
    return {
        "policy": choice.name, "layout": layout.name, "page_size": layout.page_size,
        "device_gb": device_gb, "host_gb": host_gb, "storage_gb": storage_gb,
        "write_policy": write_policy if host_pages else None,
        "window_ratio": ratio, "shared_budget": budget is not None or arena,
        "arena": frames,
        "pool_pages": pages,
        "pool_bytes": budget if budget is not None else frames["bytes"] if frames else (
            budget_bytes(pages, layout)),
        "requests": st.requests, "refused": st.refused,
        "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
        "cached_by_tier": {"device": st.cached_tokens - st.host_tokens - st.storage_tokens,
                           "host": st.host_tokens, "storage": st.storage_tokens},
        "computed_tokens": st.computed_tokens,
        "hit_rate": st.hit_rate, "bound_hit_rate": bound,
        "share_of_bound": st.hit_rate / bound if bound else 0.0,
        "seconds": seconds,
        "peak_pages": st.peak_pages,
        "peak_bytes": {n: st.peak_pages[n] * page_bytes[n] for n in st.peak_pages},
        "bytes_moved": {**{f"{a}->{b}": host.bytes[f"{a}->{b}"] if host else 0
                           for a in TIERS for b in TIERS if a != b},
                        **{f"storage->{to}": n * store.page_bytes if store else 0
                           for to, n in st.storage_pages.items()},
                        "device->storage": store.bytes_written if store else 0},
    }
