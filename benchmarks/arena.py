"""The device arena (one byte budget in frames, pool/arena.py) against fixed pools and the
simulator's ideal byte budget: hit rate, allocation cost, fragmentation.

    python benchmarks/arena.py [--trace conversation|synthetic|PATH] [--sizes 32,64,256]
        [--workers 2] [--repeat 1] [--json OUT]

DeepSeek-V4-Pro, SGLang's fp8 KV records, page 256, the default policy, each size replayed
through the engine's CacheManager over metadata-only pools three ways:

    # pools   today's fixed pools: the window pool a fixed 0.2 of the bytes (the default's
    #         split with a host tier), every pool its own free list
    # bytes   the simulator's shared budget: pages counted in bytes, no frames (the ideal:
    #         no fragmentation)
    # arena   the engine's `CacheConfig(device_bytes=)`: frames of the largest page cut into
    #         per-pool slabs; a frame goes back only once all its pages are free

and reports per size: the hit rates, the arena's gap to the byte budget (#22's target:
within 0.3 points), microseconds per allocation (eviction included) in each mode with the
arena's ratio to the fixed pools (#22's target: within 1.2x) and to the byte budget (what
the frames themselves cost: compaction and frame books), where the arena's microseconds go
(eviction with the frees it makes, compaction), and the fragmentation the replay left
(slack: the frames' bytes past their last slot; holes: free slots in frames still held), and
the tree nodes the eviction walks looked at per allocation (their work: the shared budget's walk
by age visits about twice the nodes the fixed pools' walks do for the same pages). Ratios come
from the same run; take them with nothing else running. A machine whose speed drifts
between replays (a shared host) moves them by 1.5x: `--repeat N` replays each mode N times,
in turn, and keeps each one's fastest (hit rates do not change between repeats).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import trace_args, trace_path, write_json
from rich.console import Console
from rich.table import Table

from shadowradix.layout.presets import named_layout
from shadowradix.sim.replay import replay
from shadowradix.sim.simulate import GB, PolicyChoice, make_cache, policy_choice
from shadowradix.sim.trace import load_trace
from shadowradix.tree.policy import DEFAULT

MODES = ("pools", "bytes", "arena")
FIXED_SHARE = 0.2
_requests: list[Any] = []


def _load(trace: str) -> None:
    global _requests
    _requests = load_trace(trace)


def _run(job: tuple[str, float]) -> dict[str, Any]:
    mode, gb = job
    layout = named_layout("deepseek-v4-pro", 256, "fp8")
    choice = (PolicyChoice("shadowradix", DEFAULT, FIXED_SHARE) if mode == "pools"
              else policy_choice("shadowradix"))
    cache = make_cache(layout, choice, gb * GB, arena=mode == "arena")
    t0 = time.perf_counter()
    st = replay(cache, _requests, with_output=True, chunk_pages=32)
    out = {"mode": mode, "device_gb": gb, "hit_rate": st.hit_rate, "refused": st.refused,
           "seconds": time.perf_counter() - t0, "allocs": cache.allocs,
           "alloc_us": 1e6 * cache.alloc_seconds / max(cache.allocs, 1),
           "evict_seconds": cache.evict_seconds, "compact_seconds": cache.compact_seconds,
           "evicted_pages": sum(cache.evicted.values()), "moved_pages": sum(cache.moved.values()),
           "nodes_visited": cache.tree.nodes_visited()}
    if cache.arena is not None:
        stats = cache.stats()["arena"]
        fb, ps = stats["frame_bytes"], layout.page_size
        slack = sum(p["frames"] * (fb - p["per_frame"] * layout.pool(n).page_bytes(ps))
                    for n, p in stats["pools"].items())
        out.update(frame_bytes=fb, arena_bytes=stats["bytes"], slack_bytes=slack,
                   holes_bytes=stats["fragmented_bytes"] - slack,
                   used_bytes=stats["used_bytes"], free_frames=stats["free_frames"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_args(ap, "32,64,256")
    ap.add_argument("--repeat", type=int, default=1,
                    help="replays of each mode and size, in turn; the fastest is kept")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    console = Console(width=200)
    trace = trace_path(args.trace)
    sizes = [float(s) for s in args.sizes.split(",")]
    jobs = [(mode, gb) for gb in sizes for _ in range(args.repeat) for mode in MODES]
    console.print(f"{trace}: {len(jobs)} replays in {args.workers} processes; load average "
                  f"{os.getloadavg()[0]:.2f}")
    with ProcessPoolExecutor(args.workers, initializer=_load, initargs=(trace,)) as pool:
        every = list(pool.map(_run, jobs))
    runs = []
    for gb in sizes:
        for mode in MODES:
            tries = [r for r in every if r["mode"] == mode and r["device_gb"] == gb]
            best = min(tries, key=lambda r: r["alloc_us"])
            runs.append({**best, "alloc_us_tries": [r["alloc_us"] for r in tries]})
    table = Table(title=f"the arena, DeepSeek-V4-Pro fp8, page 256, default policy, "
                  f"{Path(trace).name}")
    for col in ("device GB", "pools %", "bytes %", "arena %", "arena - bytes", "us/alloc pools",
                "us/alloc bytes", "us/alloc arena", "arena/pools", "arena/bytes",
                "arena: evict us", "arena: compact us", "nodes/alloc pools", "nodes/alloc arena",
                "slack", "holes"):
        table.add_column(col, justify="right")
    goals = {"arena_within_0.3_of_bytes": True, "alloc_within_1.2x_of_pools": True}
    rows = []
    for gb in sizes:
        at = {r["mode"]: r for r in runs if r["device_gb"] == gb}
        pools, ideal, arena = at["pools"], at["bytes"], at["arena"]
        gap = 100 * (arena["hit_rate"] - ideal["hit_rate"])
        ratio = arena["alloc_us"] / pools["alloc_us"]
        over_bytes = arena["alloc_us"] / ideal["alloc_us"]
        evict_us, compact_us = (1e6 * arena[k] / arena["allocs"]
                                for k in ("evict_seconds", "compact_seconds"))
        goals["arena_within_0.3_of_bytes"] &= gap >= -0.3
        goals["alloc_within_1.2x_of_pools"] &= ratio <= 1.2
        visits = {m: at[m]["nodes_visited"] / max(at[m]["allocs"], 1) for m in MODES}
        slack = arena["slack_bytes"] / arena["arena_bytes"]
        holes = arena["holes_bytes"] / arena["arena_bytes"]
        rows.append({"device_gb": gb, "pools": pools["hit_rate"], "bytes": ideal["hit_rate"],
                     "arena": arena["hit_rate"], "gap_points": gap,
                     "alloc_us_pools": pools["alloc_us"], "alloc_us_bytes": ideal["alloc_us"],
                     "alloc_us_arena": arena["alloc_us"], "alloc_ratio": ratio,
                     "alloc_ratio_to_bytes": over_bytes, "arena_evict_us": evict_us,
                     "arena_compact_us": compact_us, "nodes_per_alloc": visits,
                     "slack_share": slack,
                     "holes_share": holes})
        table.add_row(f"{gb:g}", f"{100 * pools['hit_rate']:.2f}",
                      f"{100 * ideal['hit_rate']:.2f}", f"{100 * arena['hit_rate']:.2f}",
                      f"{gap:+.2f}", f"{pools['alloc_us']:.0f}", f"{ideal['alloc_us']:.0f}",
                      f"{arena['alloc_us']:.0f}", f"{ratio:.2f}x", f"{over_bytes:.2f}x",
                      f"{evict_us:.0f}", f"{compact_us:.0f}", f"{visits['pools']:.1f}",
                      f"{visits['arena']:.1f}", f"{slack:.2%}", f"{holes:.2%}")
    console.print(table)
    console.print(f"goals: {goals}")
    write_json(args.json, {"trace": trace, "runs": runs, "rows": rows, "goals": goals})
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
