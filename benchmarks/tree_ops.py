"""Tree operations at trace scale: match -> lock -> allocate (evict if short) -> insert -> unlock.

    python benchmarks/tree_ops.py TRACE --layout full+swa|deepseek-v4-flash --window 128 \
        --page-size 256 --capacity-tokens N --json OUT

Every pool is sized to N tokens. Prints a table and writes JSON with wall_s,
hit_rate, match_us_per_page, insert_us_per_page, evict_s and the leak check.
The in-run baseline is the infinite-cache bound on the same trace (hit rate)
and the bare cost of expanding the trace into tokens (time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from common import write_json

from shadowradix.layout import LAYOUT_NAMES, named_layout
from shadowradix.sim import load_trace, replay
from shadowradix.sim.simulate import bound_hit_rate
from shadowradix.tiers import PrefixCache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace", help="Mooncake-format JSONL (.jsonl or .jsonl.gz)")
    ap.add_argument("--layout", default="full+swa", help=f"one of {', '.join(LAYOUT_NAMES)}")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--capacity-tokens", type=int, default=2_000_000)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    layout = named_layout(args.layout, args.page_size, window=args.window)
    requests = load_trace(args.trace, args.limit)
    pages = args.capacity_tokens // args.page_size
    cache = PrefixCache(layout, pages)

    t0 = time.perf_counter()
    for req in requests:
        req.prompt_tokens()
    expand_s = time.perf_counter() - t0

    st = replay(cache, requests)
    # Leak check: nothing is held by requests now; after a flush every pool is empty.
    cache.check_integrity(held={})
    t0 = time.perf_counter()
    cache.flush()
    flush_s = time.perf_counter() - t0
    leak = {name: pool.used_pages for name, pool in cache.pools.items()}

    result = {
        "trace": str(args.trace), "layout": layout.name, "page_size": args.page_size,
        "window": args.window, "capacity_tokens": args.capacity_tokens,
        "requests": st.requests, "refused": st.refused,
        "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
        "hit_rate": st.hit_rate, "bound_hit_rate": bound_hit_rate(requests, args.page_size),
        "wall_s": st.wall_s, "match_s": st.match_s, "alloc_s": st.alloc_s,
        "insert_s": st.insert_s, "evict_s": cache.evict_seconds, "flush_s": flush_s,
        "trace_expand_s": expand_s,
        "match_us_per_page": st.match_s / max(st.prompt_pages, 1) * 1e6,
        "insert_us_per_page": st.insert_s / max(st.inserted_pages, 1) * 1e6,
        "peak_pages": st.peak_pages, "pages_per_pool": pages,
        "leak_pages_after_flush": leak, "leak_free": not any(leak.values()),
    }
    print_table(result)
    write_json(args.json, result)
    return 0 if result["leak_free"] else 1


def print_table(r: dict) -> None:
    rows = [
        ("layout", r["layout"]), ("requests", f"{r['requests']:,} ({r['refused']} refused)"),
        ("hit rate", f"{r['hit_rate']:.4f} (bound {r['bound_hit_rate']:.4f})"),
        ("wall s", f"{r['wall_s']:.2f}"),
        ("  match / alloc+evict / insert s",
         f"{r['match_s']:.2f} / {r['alloc_s']:.2f} / {r['insert_s']:.2f}"),
        ("  evict s", f"{r['evict_s']:.2f}"),
        ("  trace expansion s (baseline)", f"{r['trace_expand_s']:.2f}"),
        ("match us/page", f"{r['match_us_per_page']:.2f}"),
        ("insert us/page", f"{r['insert_us_per_page']:.2f}"),
        ("peak pages", ", ".join(f"{k} {v}" for k, v in r["peak_pages"].items())),
        ("leak check", "ok: every pool empty after flush" if r["leak_free"]
         else f"LEAK {r['leak_pages_after_flush']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    np.seterr(all="raise")
    sys.exit(main())
