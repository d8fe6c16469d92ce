"""HiSparse offline replay: LRU against Belady on top-k streams recorded from the engine.

    python benchmarks/hisparse_replay.py [--json OUT] [--save-streams FILE] [--streams FILE]

Runs the demo's tiny DeepSeek-V4 (`shadowradix.demo.tiny_deepseek_v4`: 2 CSA layers, indexer
top-k 16, C4 compression ratio 4) through the engine with `record_topk=True`, on the first two
turns of conversations from the bundled conversation trace: each 512-token trace block becomes
`--block-tokens` pseudo-random ids (`shadowradix.demo.scaled_prompt`), keeping the prompts of
1-2K tokens, and each request decodes `--decode` greedy tokens (ignore_eos). Turn 1 of every
conversation runs as one batch, then turn 2 (which hits turn 1's prompt in the prefix cache).

Every (request, CSA layer) decode stream is replayed through a hot buffer (shadowradix.sparse:
fast path while the whole C4 history fits, misses replace entries not selected this step) at
capacities k+1, 1.5k, 2k, 3k, 4k and 8k, under LRU and under Belady's optimum. Goal (issue
"HiSparse"): LRU >= 0.9 x Belady at 2k.

The model is random (untrained): its indexer's selections may have less temporal locality
than a trained model's, so these figures say how the policies compare on this stream, not
what a real DeepSeek-V4 would hit. The streams are reported as recorded, untuned.
`--streams FILE` replays saved streams (from `--save-streams`) without running the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json
from rich.console import Console
from rich.table import Table

from shadowradix.sparse import AccessStream, sweep

GOAL = 0.9  # LRU hits over Belady hits at a buffer of 2 x top-k
FACTORS = (("k+1", None), ("1.5k", 1.5), ("2k", 2.0), ("3k", 3.0), ("4k", 4.0), ("8k", 8.0))


def capacities(k: int) -> dict[str, int]:
    return {name: k + 1 if f is None else max(k + 1, round(f * k)) for name, f in FACTORS}


def long_conversations(count: int, block_tokens: int, lo: int, hi: int) -> list[list[Any]]:
    """The first `count` conversations of the trace (requests sharing their first two blocks)
    whose first two turns both scale to lo..hi prompt tokens: [[turn 1, turn 2], ...]."""
    from shadowradix.sim.trace import bundled_trace, load_trace

    groups: dict[tuple[int, ...], list[Any]] = {}
    for r in load_trace(bundled_trace("conversation")):
        if len(r.hash_ids) >= 2:
            groups.setdefault(tuple(r.hash_ids[:2]), []).append(r)

    def tokens(r: Any) -> int:  # scaled_prompt's length
        return -(-r.input_length * block_tokens // 512)

    chosen = [g[:2] for g in groups.values()
              if len(g) >= 2 and all(lo <= tokens(r) <= hi for r in g[:2])]
    return chosen[:count]


def record(conversations: int, block_tokens: int, decode: int) -> tuple[list[dict], dict]:
    """Run the workload with record_topk=True: every stream, tagged with its request and
    layer, and a summary of the run."""
    import torch

    from shadowradix.demo import scaled_prompt, tiny_deepseek_v4
    from shadowradix.engine import CacheConfig, Engine, SamplingParams

    torch.set_num_threads(2)
    model = tiny_deepseek_v4()
    vocab = model.config.vocab_size
    convs = long_conversations(conversations, block_tokens, 1024, 2048)
    eng = Engine.from_hf(model, CacheConfig(page_size=64, device_tokens=32 * 1024),
                         record_topk=True)
    params = SamplingParams(max_new_tokens=decode, ignore_eos=True)
    streams, prompts, cached = [], [], 0
    t0 = time.perf_counter()
    for turn in range(2):
        batch = [scaled_prompt(c[turn], block_tokens, vocab) for c in convs]
        for i, r in enumerate(eng.generate(batch, params)):
            assert r.topk is not None
            cached += r.cached_tokens
            for layer, s in r.topk.items():
                streams.append({"request": f"conv{i}-turn{turn + 1}", "layer": layer,
                                "stream": s})
        prompts += [len(p) for p in batch]
    eng.close()
    setup = {"model": "shadowradix.demo.tiny_deepseek_v4 (random weights)",
             "index_topk": model.config.index_topk, "compress_ratio": 4,
             "workload": f"first 2 turns of {len(convs)} conversation-trace conversations, "
                         f"{block_tokens} tokens per 512-token block",
             "requests": len(prompts), "prompt_tokens": prompts, "cached_tokens": cached,
             "decode_tokens": decode, "record_s": time.perf_counter() - t0}
    return streams, setup


def locality(streams: list[AccessStream]) -> dict[str, float]:
    """Two descriptive figures: the share of a step's selections also selected at the step
    before, and the median age (entries since it was produced) of a selected entry."""
    same = total = 0
    ages = []
    for s in streams:
        prev: set[int] = set()
        for ids, count in s.steps():
            cur = set(ids.tolist())
            same += len(cur & prev)
            total += len(cur)
            prev = cur
            ages.append(count - 1 - ids)
    age = np.concatenate(ages) if ages else np.zeros(1)
    return {"reselected_from_previous_step": same / max(total, 1),
            "median_age_entries": float(np.median(age))}


def analyse(tagged: list[dict]) -> dict:
    streams = [t["stream"] for t in tagged]
    k = streams[0].top_k
    caps = capacities(k)
    out = sweep(streams, list(caps.values()))
    rows = []
    for name, c in caps.items():
        lru, opt = out["lru"][c], out["belady"][c]
        rows.append({"buffer": name, "capacity": c, "lru": lru.to_dict(),
                     "belady": opt.to_dict(),
                     "lru_over_belady": lru.hits / opt.hits if opt.hits else None})
    two_k = caps["2k"]
    per_layer = {}
    for layer in sorted({t["layer"] for t in tagged}):
        mine = [t["stream"] for t in tagged if t["layer"] == layer]
        res = sweep(mine, [two_k])
        per_layer[str(layer)] = {"streams": len(mine), "lru_hit_rate": res["lru"][two_k].hit_rate,
                                 "belady_hit_rate": res["belady"][two_k].hit_rate,
                                 **locality(mine)}
    ratio = next(r["lru_over_belady"] for r in rows if r["buffer"] == "2k")
    return {"top_k": k, "streams": len(streams), "steps": sum(len(s) for s in streams),
            "rows": rows, "per_layer_at_2k": per_layer, "locality": locality(streams),
            "goal": {"buffer": "2k", "capacity": two_k, "target": GOAL,
                     "lru_over_belady": ratio, "met": ratio is not None and ratio >= GOAL}}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def report(console: Console, res: dict) -> None:
    a = res["analysis"]
    table = Table(title=f"HiSparse replay: {a['streams']} streams (request x CSA layer), "
                        f"{a['steps']:,} decode steps, top-k {a['top_k']}")
    for col in ("buffer", "entries", "LRU hit", "Belady hit", "LRU/Belady", "compulsory",
                "misses LRU / Belady", "fast path"):
        table.add_column(col, justify="left" if col == "buffer" else "right")
    for r in a["rows"]:
        lru, opt = r["lru"], r["belady"]
        table.add_row(r["buffer"], str(r["capacity"]), pct(lru["hit_rate"]),
                      pct(opt["hit_rate"]), pct(r["lru_over_belady"]), f"{lru['compulsory']:,}",
                      f"{lru['misses']:,} / {opt['misses']:,}", pct(lru["fast_path_share"]))
    console.print(table)
    layers = Table(title=f"per CSA layer at 2k ({a['goal']['capacity']} entries)")
    for col in ("layer", "streams", "LRU hit", "Belady hit", "reselected from prev step",
                "median age (entries)"):
        layers.add_column(col, justify="right")
    for layer, v in a["per_layer_at_2k"].items():
        layers.add_row(layer, str(v["streams"]), pct(v["lru_hit_rate"]),
                       pct(v["belady_hit_rate"]), pct(v["reselected_from_previous_step"]),
                       f"{v['median_age_entries']:.0f}")
    console.print(layers)
    g = a["goal"]
    verdict = "[green]met[/green]" if g["met"] else "[red]NOT met[/red]"
    console.print(f"goal: LRU >= {g['target']:.0%} of Belady at {g['buffer']} "
                  f"({g['capacity']} entries): LRU/Belady = {pct(g['lru_over_belady'])}: "
                  f"{verdict} (random model: see the docstring)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--block-tokens", type=int, default=48)
    ap.add_argument("--decode", type=int, default=320, help="greedy tokens per request")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--save-streams", type=Path, default=None,
                    help="write the recorded streams (JSON) for a later --streams")
    ap.add_argument("--streams", type=Path, default=None,
                    help="replay saved streams instead of running the model")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    if args.streams is not None:
        saved = json.loads(args.streams.read_text())
        tagged = [{**t, "stream": AccessStream.from_dict(t["stream"])} for t in saved["streams"]]
        setup = saved["setup"]
    else:
        with console.status("recording top-k streams through the engine ..."):
            tagged, setup = record(args.conversations, args.block_tokens, args.decode)
    if not tagged:
        console.print("[red]no streams: no conversation fits the prompt range[/red]")
        return 1
    console.print(f"{setup['requests']} requests ({setup['workload']}), prompts "
                  f"{min(setup['prompt_tokens']):,}-{max(setup['prompt_tokens']):,} tokens, "
                  f"{setup['cached_tokens']:,} served from the prefix cache, "
                  f"{setup['decode_tokens']} decode tokens each; model: {setup['model']}")
    t0 = time.perf_counter()
    result = {"setup": setup, "analysis": analyse(tagged)}
    result["replay_s"] = time.perf_counter() - t0
    report(console, result)
    saved_streams = [{**t, "stream": t["stream"].to_dict()} for t in tagged]
    write_json(args.save_streams, {"setup": setup, "streams": saved_streams})
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
