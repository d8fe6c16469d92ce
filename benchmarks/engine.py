"""The reference engine on a tiny DeepSeek-V4 (CPU): what the cache saves, what it costs.

    python benchmarks/engine.py [--json OUT] [--contexts 4096,16384,32768]

1. Multi-turn workload (the demo's conversations) with the prefix cache on and off
   (off: the device tier is flushed before every request): prefill tokens computed and
   the wall-time ratio.
2. Decode step time at growing context, as a ratio to the first: the sparse C4 gather
   must not read all C4 entries (target <= 1.5 at 32K vs 4K).
3. Scheduler and cache overhead per decode step at batch 32, as a share of step time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import write_json

from shadowradix.demo import conversations, scaled_prompt, tiny_deepseek_v4
from shadowradix.engine import CacheConfig, Engine, SamplingParams
from shadowradix.model import DeepseekV4Runner, PagedStorage, RequestKV
from shadowradix.sim.trace import bundled_trace, load_trace


def multi_turn(model) -> dict:
    trace = conversations(load_trace(bundled_trace("conversation")), 4, 48)
    prompts = [scaled_prompt(r, 16, model.config.vocab_size) for r in trace]
    out = {}
    for mode in ("off", "on"):
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=8 * 1024))
        t0 = time.perf_counter()
        for p in prompts:
            if mode == "off":
                eng.cache.flush(tiers=("device",))
            eng.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))
        st = eng.stats()
        out[mode] = {"wall_s": time.perf_counter() - t0, "prefill_tokens": st["prefill_tokens"],
                     "prompt_tokens": st["prompt_tokens"], "cached_tokens": st["cached_tokens"]}
    out["prefill_saved"] = 1 - out["on"]["prefill_tokens"] / out["off"]["prefill_tokens"]
    out["wall_ratio_on_over_off"] = out["on"]["wall_s"] / out["off"]["wall_s"]
    return out


@torch.no_grad()
def decode_vs_context(model, contexts: list[int], steps: int = 16) -> dict:
    """One request grows to each context; time single-token decode steps there."""
    from shadowradix.layout import deepseek_v4
    from shadowradix.pool.storage import PoolStorage

    ps = 256
    top = max(contexts) + steps * len(contexts) + ps
    layout = deepseek_v4(model.config, page_size=ps, dtype="float32")
    pages = -(-top // ps)
    pools = {p.name: PoolStorage(p, ps, pages) for p in layout.pools}
    store = PagedStorage.for_layer_types(layout, pools, list(model.config.layer_types))
    req = RequestKV({p.name: torch.arange(pages) for p in layout.pools})
    runner = DeepseekV4Runner(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (top,), generator=g)
    pos, rows = 0, []
    for ctx in contexts:
        while pos < ctx:
            end = min(ctx, pos + 1024)
            runner.forward(tokens[pos:end], pos, store, req)
            pos = end
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.forward(tokens[pos:pos + 1], pos, store, req)
            times.append(time.perf_counter() - t0)
            pos += 1
        rows.append({"context": ctx, "decode_ms": 1e3 * float(np.median(times))})
    base = rows[0]["decode_ms"]
    for r in rows:
        r["ratio_to_first"] = r["decode_ms"] / base
    return {"rows": rows}


def overhead_at_batch(model, batch: int = 32) -> dict:
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=32 * 1024),
                         step_tokens=batch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist()
               for _ in range(batch)]
    # With a budget of `batch` tokens the prefill steps are done first; then every step
    # decodes all 32 requests together.
    eng.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    before = eng.stats()
    eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    after = eng.stats()
    step = after["step_seconds"] - before["step_seconds"]
    forward = after["forward_seconds"] - before["forward_seconds"]
    return {"batch": batch, "steps": after["steps"] - before["steps"], "step_s": step,
            "forward_s": forward, "overhead_share": 1 - forward / step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = tiny_deepseek_v4()
    result = {"multi_turn": multi_turn(model),
              "decode": decode_vs_context(model, [int(c) for c in args.contexts.split(",")]),
              "overhead": overhead_at_batch(model)}
    mt, ov = result["multi_turn"], result["overhead"]
    print(f"multi-turn ({mt['on']['prompt_tokens']:,} prompt tokens): prefill computed "
          f"{mt['off']['prefill_tokens']:,} -> {mt['on']['prefill_tokens']:,} "
          f"({mt['prefill_saved']:.0%} saved); wall {mt['off']['wall_s']:.1f} s -> "
          f"{mt['on']['wall_s']:.1f} s (ratio {mt['wall_ratio_on_over_off']:.2f})")
    print("context   decode ms/step   ratio to first")
    for r in result["decode"]["rows"]:
        print(f"{r['context']:>7,}   {r['decode_ms']:>14.2f}   {r['ratio_to_first']:>14.2f}")
    print(f"batch {ov['batch']} decode: {ov['steps']} steps, scheduler + cache overhead "
          f"{ov['overhead_share']:.1%} of step time")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
