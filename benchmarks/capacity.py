"""Most requests decoding at once in a fixed device budget, at 4K context: before and after
the engine went online.

    python benchmarks/capacity.py [--json OUT] [--page-size 64] [--window-ratio 0.1]

Before: commit 4843935, extracted with `git archive` into a temporary directory and run in a
child process. Its admission reserved prompt + max_new_tokens pages in every pool at once,
and every pool had `device_tokens` pages.
After: this tree. Pages grow on demand, a running request hands its full pages to the tree,
and the window pool is sized apart (`CacheConfig.window_tokens`).

Both get the same bytes: what the old rule needs for 8 requests. The new engine splits them
as the simulator does (`pages_for_budget`: every window pool `window_ratio` times the pages
of the others). N requests of 4,096 random tokens (no shared prefix) each generate 64 tokens
(the old rule's page count is the same for 1 to 64: ceil(4160 / 64) = 65); N grows by 8
until the peak stops rising.

The model's forward is a stub that returns zero logits: how many requests fit depends only on
the scheduler and the cache's page accounting, which run unchanged, and a real 4K prefill of
the tiny model takes about 40 s on this machine. The peak counts decode tokens in one forward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shadowradix.engine import CacheConfig, Engine, SamplingParams
from shadowradix.model.tiny import tiny_deepseek_v4

OLD_COMMIT = "4843935"  # the last commit before the online engine (7fcaded)
PROMPT, NEW, STEP_TOKENS, OLD_REQUESTS = 4096, 64, 2048, 8
ROOT = Path(__file__).resolve().parent.parent


def stub_forward(eng: Engine, prompt_len: int) -> dict[str, Any]:
    """Replace the model's forward with zero logits and record, per forward, how many
    segments are decode tokens; at each new peak, the pages running requests pin per pool."""
    seen: dict[str, Any] = {"peak": 0, "pinned": {}}
    zeros = torch.zeros(1, eng.vocab_size)

    def forward_batch(segments: list, store: Any) -> list[torch.Tensor]:
        decoding = sum(1 for ids, start, _ in segments if ids.numel() == 1 and start >= prompt_len)
        if decoding > seen["peak"]:
            pools = eng.stats()["pools"]
            seen["peak"] = decoding
            seen["pinned"] = {n: p["capacity"] - p["free"] - p["evictable"]
                              for n, p in pools.items()}
        return [zeros] * len(segments)

    eng.runner.forward_batch = forward_batch  # type: ignore[method-assign]
    eng.runner.resume = lambda *args: None  # type: ignore[method-assign]
    return seen


def peak_decoding(model: Any, config: CacheConfig, n: int) -> dict[str, Any]:
    """Run n requests to the end; the most that decoded in one step, and preemptions."""
    eng = Engine.from_hf(model, config, step_tokens=STEP_TOKENS)
    seen = stub_forward(eng, PROMPT)
    rng = np.random.default_rng(n)
    prompts = [rng.integers(0, eng.vocab_size, PROMPT).tolist() for _ in range(n)]
    t0 = time.perf_counter()
    results = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    st = eng.stats()
    assert all(len(r.output_ids) == NEW for r in results)
    if hasattr(eng, "check_integrity"):
        eng.check_integrity()
    return {"requests": n, "peak_decoding": seen["peak"], "pinned_at_peak": seen["pinned"],
            "preemptions": st.get("preemptions", 0), "steps": st["steps"],
            "prefill_tokens": st["prefill_tokens"],
            "recomputed": st["prefill_tokens"] - n * PROMPT, "wall_s": time.perf_counter() - t0}


def sweep(model: Any, config: CacheConfig, counts: list[int] | None = None) -> list[dict]:
    """Peaks for the given request counts, or for 8, 16, ... until the peak stops rising."""
    rows: list[dict] = []
    for n in counts or range(8, 257, 8):
        rows.append(peak_decoding(model, config, n))
        if counts is None and len(rows) > 1 and \
                rows[-1]["peak_decoding"] <= rows[-2]["peak_decoding"]:
            break
    return rows


def old_sweep(page_size: int, device_tokens: int, counts: list[int]) -> dict[str, Any]:
    """The same workload on the commit before the online engine, in a child process."""
    with tempfile.TemporaryDirectory(prefix="shadowradix-old-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT, "shadowradix"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": tmp + os.pathsep + os.environ.get("PYTHONPATH", "")}
        spec = json.dumps({"page_size": page_size, "device_tokens": device_tokens,
                           "counts": counts, "expect": tmp})
        out = subprocess.run([sys.executable, __file__, "--child", spec], env=env, check=True,
                             capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def child(spec: dict[str, Any]) -> None:
    import shadowradix

    if not shadowradix.__file__.startswith(spec["expect"]):
        raise RuntimeError(f"the child imported {shadowradix.__file__}, not the old tree")
    torch.set_num_threads(1)
    config = CacheConfig(page_size=spec["page_size"], device_tokens=spec["device_tokens"])
    rows = sweep(tiny_deepseek_v4(sliding_window=128), config, spec["counts"])
    print(json.dumps({"commit": OLD_COMMIT, "rows": rows}))


def capacity(page_size: int = 64, window_ratio: float = 0.1) -> dict[str, Any]:
    from shadowradix.engine.validation import model_layout
    from shadowradix.sim.sizing import budget_bytes, pages_for_budget

    t0 = time.perf_counter()
    model = tiny_deepseek_v4(sliding_window=128)
    layout = model_layout(model, page_size)
    per_request = -(-(PROMPT + NEW) // page_size)  # the old rule, in every pool
    old_pages = OLD_REQUESTS * per_request
    budget = old_pages * sum(layout.page_bytes().values())
    pages = pages_for_budget(layout, budget, window_ratio)
    windowed = [p.name for p in layout.pools if p.window]
    rest = next(n for n in pages if n not in windowed)
    config = CacheConfig(page_size=page_size, device_tokens=pages[rest] * page_size,
                         window_tokens=pages[windowed[0]] * page_size)
    after = sweep(model, config)
    before = old_sweep(page_size, old_pages * page_size, [r["requests"] for r in after])
    best = max(r["peak_decoding"] for r in after)
    old_best = max(r["peak_decoding"] for r in before["rows"])
    top = max(after, key=lambda r: r["peak_decoding"])
    return {"page_size": page_size, "sliding_window": 128, "prompt": PROMPT,
            "max_new_tokens": NEW, "step_tokens": STEP_TOKENS, "budget_bytes": budget,
            "page_bytes": layout.page_bytes(),
            "before": {"pages": {p.name: old_pages for p in layout.pools},
                       "pages_per_request": per_request, **before},
            "after": {"pages": pages, "bytes": budget_bytes(pages, layout),
                      "window_ratio": window_ratio, "rows": after},
            "peak_before": old_best, "peak_after": best, "ratio": best / old_best,
            "window_pages_per_decoder": top["pinned_at_peak"][windowed[0]] / best,
            "wall_s": time.perf_counter() - t0}


def report(res: dict[str, Any]) -> None:
    b, a = res["before"], res["after"]
    print(f"{res['prompt']:,}-token prompts + {res['max_new_tokens']} new, page "
          f"{res['page_size']}, window {res['sliding_window']}, budget "
          f"{res['budget_bytes'] / 2**20:.1f} MiB; pools before {b['pages']['swa']} pages each, "
          f"after {a['pages']} (window ratio {a['window_ratio']})")
    print("requests   decoding at once: before   after   preemptions after   recomputed tokens")
    for old, new in zip(b["rows"], a["rows"], strict=True):
        print(f"{new['requests']:>8}   {old['peak_decoding']:>24}   {new['peak_decoding']:>5}"
              f"   {new['preemptions']:>17}   {new['recomputed']:>17,}")
    peak = max(a["rows"], key=lambda r: r["peak_decoding"])
    print(f"most decoding at once: {res['peak_before']} -> {res['peak_after']} "
          f"({res['ratio']:.2f}x); pages pinned at the peak {peak['pinned_at_peak']} "
          f"(window pool {res['window_pages_per_decoder']:.1f} per request, was "
          f"{b['pages_per_request']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--window-ratio", type=float, default=0.1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    from common import write_json

    torch.set_num_threads(2)
    res = capacity(args.page_size, args.window_ratio)
    report(res)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
