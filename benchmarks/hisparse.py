"""HiSparse live: decoding requests that fit in a fixed device budget, and what a decode step
costs, with the C4 pool on the device (off) and in host memory behind hot buffers (on).

    python benchmarks/hisparse.py [--context 16384] [--buffer N] [--off-requests 3]
                                  [--quick] [--json OUT]

The tiny random DeepSeek-V4 of `shadowradix.model.tiny` with the indexer's top-k at 16 (2 CSA
layers, C4 ratio 4, window 8), page 256, chunks of 512 tokens, on CPU: "device" below means
the pools' tensors the engine would put on the accelerator, "host" the C4 pool HiSparse keeps
in host memory (pinned on CUDA). Every request has a prompt of --context random tokens of its
own (no shared prefix), greedy, ignore_eos, and as many output tokens as the pools could hold
for it alone (none finishes during the run).

Budget: the bytes of the smallest HiSparse-off configuration in which --off-requests requests
decode at once at context T. That is --off-requests x `sim.hisparse.decode_footprint` (at the
context they reach while the others prefill) plus the slack the engine's sizing adds: the
window and state pools hold, beyond 2 pages per decoding request, the pages one prefilling
request needs for its chunk (`CacheManager.peak_pages`).
Each mode then gets the most requests whose configuration fits in that budget: `device_tokens`
= n x the request's pages, `window_tokens` = `state_tokens` = 2n + the prefill pages (in
pages of tokens), and with HiSparse
`hisparse_requests` = n (the hot-buffer arena counts as device bytes; the C4 pool does not).
The bytes are measured on the built engine (the pools' tensors and the arena) and must not
exceed the budget.

1. Peak decoding: submit n + 2 requests (n: what the mode's sizing predicts) and step until
   every running request decodes and the running set has not changed for --steps steps; the
   peak is the most requests that had produced their first token and were running at once.
   Then the waiting requests are aborted and `check_integrity()` runs.
2. Decode step time: every running request but the first k (k = HiSparse off's peak) is
   aborted, and --steps decode steps with those k requests are timed (median ms/step). Like
   for like: the same k prompts in both modes (on-mode's have decoded a few hundred tokens
   more; 1-2% of the context).
3. With HiSparse on, over the timed steps: hits, misses, bytes moved host -> device per step,
   and the fast-path share (lookups whose C4 history still fits the buffer).
4. Exactness: the first --check greedy tokens of the k prompts are equal on and off.

torch runs on one thread: on a shared 2-core machine two threads wait for each other and a
step can take 10x longer; the 1-minute load average is reported before and after each mode.
Defaults take about 2.5 minutes; --quick (context 2048) about 15 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import write_json
from rich.console import Console
from rich.table import Table

from shadowradix.engine import CacheConfig, Engine, SamplingParams
from shadowradix.engine.validation import model_layout
from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.model.tiny import tiny_deepseek_v4
from shadowradix.sim.hisparse import decode_footprint
from shadowradix.tree.rules import MatchRule

PAGE, STEP_TOKENS, INDEX_TOPK, C4 = 256, 512, 16, "c4"
MODES = ("off", "on")


@dataclass(frozen=True)
class Plan:
    """One mode's configuration for n requests and the bytes it allocates (predicted from the
    layout; the run measures them)."""

    mode: str
    requests: int
    config: CacheConfig
    device_bytes: int
    host_bytes: int


def reach(context: int, requests: int, steps: int) -> int:
    """The context the first request reaches: it decodes one token per step while the others
    prefill (their chunks get the step's other tokens), then `steps` more."""
    per_prefill = -(-context // (STEP_TOKENS - requests)) + 1
    return context + (requests - 1) * per_prefill + 2 * steps + 8


def plan(layout: KVLayout, mode: str, n: int, context: int, buffer: int, steps: int) -> Plan:
    ps = layout.page_size
    pages = -(-reach(context, n, steps) // ps)
    hold = MatchRule.of(layout).lock_pages
    prefill = min(pages, 2 * hold + -(-STEP_TOKENS // ps) + 1)  # CacheManager.peak_pages
    short = n * (hold + 1) + prefill - (hold + 1)  # window and state pools alike
    on = mode == "on"
    cfg = CacheConfig(page_size=ps, device_tokens=n * pages * ps, window_tokens=short * ps,
                      state_tokens=short * ps, hisparse_buffer=buffer if on else None,
                      hisparse_requests=n if on else None)
    device = host = 0
    for p in layout.pools:
        b = p.page_bytes(ps) * (n * pages if p.retention is Retention.ALL else short)
        if on and p.name == C4:
            host += b
        else:
            device += b
    if on:
        c4 = layout.pool(C4)
        device += n * c4.layers * buffer * c4.entry_bytes
    return Plan(mode, n, cfg, device, host)


def most_requests(layout: KVLayout, mode: str, budget: int, **kw: Any) -> Plan:
    n = 1
    while plan(layout, mode, n + 1, **kw).device_bytes <= budget:
        n += 1
    return plan(layout, mode, n, **kw)


def measured_bytes(eng: Engine) -> dict[str, int]:
    """Bytes the engine allocated per pool tensor, and "hot" for the hot-buffer arena (with
    HiSparse the C4 pool is host memory)."""
    out = {name: pool.storage.data.numel() * pool.storage.data.element_size()
           for name, pool in eng._prefix.pools.items()}
    if eng.hot is not None:
        out["hot"] = eng.hot.nbytes
    return out


def run_mode(model: Any, p: Plan, prompts: list[list[int]], keep: int | None, steps: int,
             console: Console) -> dict[str, Any]:
    """Measures 1-4 for one mode; keep: requests to time (None: the peak)."""
    load = os.getloadavg()[0]
    eng = Engine.from_hf(model, p.config, step_tokens=STEP_TOKENS)
    pools = measured_bytes(eng)
    host = pools[C4] if eng.hot is not None else 0
    device = sum(pools.values()) - host
    # As many outputs as the pools could ever hold for one request: none finishes in the run.
    params = SamplingParams(max_new_tokens=p.config.device_tokens - len(prompts[0]),
                            ignore_eos=True)
    ids = [eng.add_request(x, params) for x in prompts]
    reqs = {r.id: r for r in eng.scheduler.waiting}
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    peak, peak_pools, stable, last, n_steps = 0, {}, 0, None, 0
    t0 = time.perf_counter()
    with console.status("") as status:
        while stable < steps:
            for o in eng.step():
                outputs[o.request_id] += o.new_token_ids
            n_steps += 1
            running = eng.scheduler.running
            decoding = sum(1 for r in running if outputs[r.id])
            if decoding > peak:
                peak = decoding
                peak_pools = {n: q["capacity"] - q["free"] - q["evictable"]
                              for n, q in eng.stats()["pools"].items()}
            now = tuple(r.id for r in running)
            settled = decoding == len(running) and now == last
            stable = stable + 1 if settled else 0
            last = now
            status.update(f"HiSparse {p.mode}: step {n_steps}, {time.perf_counter() - t0:.0f} s, "
                          f"{decoding} decoding, {len(running) - decoding} prefilling, "
                          f"{len(eng.scheduler.waiting)} waiting (peak {peak})")
    admitted = [r.id for r in running]
    for r in list(eng.scheduler.waiting):
        eng.abort(r.id)
    eng.check_integrity()
    # 2-3: the first `keep` requests alone, decode steps timed.
    keep = peak if keep is None else keep
    for rid in admitted[keep:]:
        eng.abort(rid)
    timed = admitted[:keep]
    before = eng.stats()["hisparse"]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for o in eng.step():
            outputs[o.request_id] += o.new_token_ids
        times.append(time.perf_counter() - t)
    after = eng.stats()["hisparse"]
    assert all(reqs[r].decoding for r in timed) and len(eng.scheduler.running) == keep
    for rid in timed:
        eng.abort(rid)
    eng.check_integrity()
    eng.close()
    out: dict[str, Any] = {
        "requests": p.requests, "config": {k: getattr(p.config, k) for k in (
            "page_size", "device_tokens", "window_tokens", "hisparse_buffer",
            "hisparse_requests")},
        "device_bytes": device, "device_bytes_planned": p.device_bytes, "host_bytes": host,
        "bytes_by_pool": pools, "submitted": len(prompts), "peak_decoding": peak,
        "pinned_pages_at_peak": peak_pools,
        "steps_to_peak": n_steps, "wall_s": time.perf_counter() - t0,
        "timed_requests": keep, "timed_steps": steps,
        "decode_ms": 1e3 * float(np.median(times)), "decode_ms_mean": 1e3 * float(np.mean(times)),
        "first_tokens": {ids.index(r): outputs[r] for r in timed},
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if after.get("enabled"):
        delta = {k: after[k] - before[k] for k in ("hits", "misses", "fast_path_lookups",
                                                   "filled", "staged", "bytes_moved")}
        lookups = steps * keep * len(after["per_layer"])  # one per request, step and CSA layer
        out["hisparse"] = {**delta, "lookups": lookups,
                           "hit_rate": delta["hits"] / max(delta["hits"] + delta["misses"], 1),
                           "fast_path_share": delta["fast_path_lookups"] / lookups,
                           "bytes_moved_per_step": delta["bytes_moved"] / steps}
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def report(console: Console, res: dict[str, Any]) -> None:
    s, b = res["setup"], res["budget"]
    table = Table(title=f"HiSparse at {s['context']:,} tokens, buffer {s['buffer']} entries "
                        f"(top-k {s['index_topk']}), device budget {mib(b['bytes'])}; ms/step with "
                        f"{res['off']['timed_requests']} requests decoding in both")
    for col in ("HiSparse", "device budget", "device used", "host (C4)", "requests sized",
                "peak decoding", "ms/step", "hit rate",
                "fast path", "moved/step"):
        table.add_column(col, justify="left" if col == "HiSparse" else "right")
    for mode in MODES:
        m, h = res[mode], res[mode].get("hisparse")
        table.add_row(mode, mib(b["bytes"]), mib(m["device_bytes"]), mib(m["host_bytes"]),
                      str(m["requests"]), str(m["peak_decoding"]), f"{m['decode_ms']:.1f}",
                      f"{h['hit_rate']:.1%}" if h else "-",
                      f"{h['fast_path_share']:.0%}" if h else "-",
                      f"{h['bytes_moved_per_step'] / 1024:.1f} KiB" if h else "-")
    console.print(table)
    r = res["ratios"]
    console.print(f"on / off: peak decoding {r['peak_decoding']:.2f}x (decode_footprint predicts "
                  f"{r['footprint']:.2f}x per request), decode step {r['decode_ms']:.2f}x; "
                  f"first {s['check']} tokens equal on and off: {res['exact']}")
    console.print(f"budget = {s['off_requests']} x decode_footprint {mib(b['footprint'])} at "
                  f"{b['footprint_context']:,} tokens + slack {mib(b['slack'])} (window and state "
                  f"pages for one prefill chunk); load average "
                  f"off {res['off']['load_average']}, on {res['on']['load_average']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens per request")
    ap.add_argument("--buffer", type=int, default=2 * INDEX_TOPK,
                    help="hot-buffer entries per CSA layer (default 2 x top-k)")
    ap.add_argument("--off-requests", type=int, default=3,
                    help="decoding requests the budget holds with HiSparse off")
    ap.add_argument("--steps", type=int, default=20, help="decode steps settled and timed")
    ap.add_argument("--check", type=int, default=8, help="greedy tokens compared on vs off")
    ap.add_argument("--quick", action="store_true", help="context 2048: a smoke test")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.context = 2048
    console = Console(width=None if sys.stdout.isatty() else 140)
    torch.set_num_threads(1)
    model = tiny_deepseek_v4(0, index_topk=INDEX_TOPK)
    layout = model_layout(model, PAGE)
    kw = {"context": args.context, "buffer": args.buffer, "steps": args.steps}
    plans = {"off": plan(layout, "off", args.off_requests, **kw)}
    budget = plans["off"].device_bytes
    plans["on"] = most_requests(layout, "on", budget, **kw)
    at = reach(args.context, args.off_requests, args.steps)
    foot_off = decode_footprint(layout, at)
    foot_on = decode_footprint(layout, at, args.buffer, index_topk=INDEX_TOPK)
    n_max = max(p.requests for p in plans.values())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, args.context).tolist()
               for _ in range(n_max + 2)]
    console.print(f"budget {mib(budget)}: HiSparse off sized for {plans['off'].requests}, on for "
                  f"{plans['on'].requests} requests of {args.context:,} tokens; "
                  f"load average {os.getloadavg()[0]:.2f}")
    res: dict[str, Any] = {}
    for mode in MODES:
        p = plans[mode]
        keep = None if mode == "off" else res["off"]["peak_decoding"]
        res[mode] = run_mode(model, p, prompts[:p.requests + 2], keep, args.steps, console)
        m = res[mode]
        console.print(f"HiSparse {mode}: {m['peak_decoding']} decoding at the peak, "
                      f"{m['decode_ms']:.1f} ms/step, {m['wall_s']:.0f} s")
        if m["device_bytes"] > budget:
            console.print(f"[red]HiSparse {mode} allocates {m['device_bytes']:,} device bytes, "
                          f"over the budget {budget:,}[/red]")
    res["setup"] = {"model": f"shadowradix.model.tiny.tiny_deepseek_v4(index_topk={INDEX_TOPK})",
                    "context": args.context, "buffer": args.buffer, "index_topk": INDEX_TOPK,
                    "page_size": PAGE, "step_tokens": STEP_TOKENS, "check": args.check,
                    "off_requests": args.off_requests, "steps": args.steps, "torch_threads": 1}
    res["budget"] = {"bytes": budget, "footprint_context": at,
                     "footprint": foot_off.device_bytes,
                     "footprint_on": foot_on.device_bytes,
                     "slack": budget - args.off_requests * foot_off.device_bytes}
    firsts = [{i: t[:args.check] for i, t in res[m]["first_tokens"].items()} for m in MODES]
    res["exact"] = firsts[0] == firsts[1]
    res["ratios"] = {"peak_decoding": res["on"]["peak_decoding"] / res["off"]["peak_decoding"],
                     "decode_ms": res["on"]["decode_ms"] / res["off"]["decode_ms"],
                     "footprint": foot_off.device_bytes / foot_on.device_bytes}
    report(console, res)
    write_json(args.json, res)
    within = all(res[m]["device_bytes"] <= budget for m in MODES)
    return 0 if within and res["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
