"""The reference engine on a tiny DeepSeek-V4 (CPU): what the cache saves, what it costs.

    python benchmarks/engine.py [--json OUT] [--contexts 4096,16384,32768]

1. Multi-turn workload (the demo's conversations) with the prefix cache on and off
   (off: the device tier is flushed before every request): prefill tokens computed and
   the wall-time ratio.
2. Decode step time at growing context, as a ratio to the first: the sparse C4 gather
   must not read all C4 entries (target <= 1.5 at 32K vs 4K).
3. Scheduler and cache overhead per decode step at batch 64, as a share of step time
   (target < 2%).
4. Most requests decoding at once in a fixed device budget at 4K context, before and after
   the online engine (capacity.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from capacity import capacity
from capacity import report as capacity_report
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


def _steps(eng: Engine, n: int) -> list[tuple[float, float]]:
    """Step n times; each step's (step seconds, forward seconds) as the engine counts them."""
    out = []
    last = eng.stats()
    for _ in range(n):
        eng.step()
        now = eng.stats()
        out.append((now["step_seconds"] - last["step_seconds"],
                    now["forward_seconds"] - last["forward_seconds"]))
        last = now
    return out


def overhead_at_batch(model, batch: int = 64, prompt: int = 300, page: int = 64,
                      real_steps: int = 4) -> dict:
    """Scheduler and cache bookkeeping per decode step with `batch` requests decoding.

    The prompts are prefilled through a stub forward (zero logits: a real prefill of 64 x 300
    tokens takes over a minute here, and the decode step's cost does not depend on the KV
    values). Bookkeeping (step minus forward) is then the mean over one page's worth of
    decode steps with the stub still in place, so every request crosses one page boundary and
    hands a page to the tree; the forward is the median over `real_steps` steps of the model.
    """
    eng = Engine.from_hf(model, CacheConfig(page_size=page, device_tokens=16 * batch * page),
                         step_tokens=2048)
    g = torch.Generator().manual_seed(1)
    for _ in range(batch):
        eng.add_request(torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=2 * page + real_steps, ignore_eos=True))
    zeros = torch.zeros(1, model.config.vocab_size)
    eng.runner.forward_batch = lambda segments, store: [zeros] * len(segments)
    while eng.scheduler.waiting or not all(r.decoding for r in eng.scheduler.running):
        eng.step()
    book = float(np.mean([step - forward for step, forward in _steps(eng, page)]))
    del eng.runner.forward_batch  # the real model from here on
    real = _steps(eng, real_steps)
    # Every request decoded in every measured step, none was preempted.
    assert len(eng.scheduler.running) == batch and eng.stats()["preemptions"] == 0
    # Medians: a forward that shares the 2 cores with another process can take 10x longer.
    real_book = float(np.median([step - forward for step, forward in real]))
    forward = float(np.median([forward for _, forward in real]))
    return {"batch": batch, "prompt": prompt, "page_size": page, "bookkeeping_steps": page,
            "bookkeeping_ms": 1e3 * book, "bookkeeping_us_per_request": 1e6 * book / batch,
            "real_steps": real_steps, "forward_ms": 1e3 * forward,
            "real_bookkeeping_ms": 1e3 * real_book,
            "overhead_share": book / (book + forward),
            "overhead_share_real_steps": real_book / (real_book + forward)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = tiny_deepseek_v4()
    result = {"multi_turn": multi_turn(model),
              "decode": decode_vs_context(model, [int(c) for c in args.contexts.split(",")]),
              "overhead": overhead_at_batch(model),
              "capacity": capacity()}
    mt, ov = result["multi_turn"], result["overhead"]
    print(f"multi-turn ({mt['on']['prompt_tokens']:,} prompt tokens): prefill computed "
          f"{mt['off']['prefill_tokens']:,} -> {mt['on']['prefill_tokens']:,} "
          f"({mt['prefill_saved']:.0%} saved); wall {mt['off']['wall_s']:.1f} s -> "
          f"{mt['on']['wall_s']:.1f} s (ratio {mt['wall_ratio_on_over_off']:.2f})")
    print("context   decode ms/step   ratio to first")
    for r in result["decode"]["rows"]:
        print(f"{r['context']:>7,}   {r['decode_ms']:>14.2f}   {r['ratio_to_first']:>14.2f}")
    print(f"batch {ov['batch']} decode ({ov['prompt']}-token prompts, page {ov['page_size']}): "
          f"scheduler + cache {ov['bookkeeping_ms']:.2f} ms/step "
          f"({ov['bookkeeping_us_per_request']:.0f} us per request), forward "
          f"{ov['forward_ms']:.0f} ms/step: overhead {ov['overhead_share']:.2%} of step time "
          f"({ov['overhead_share_real_steps']:.2%} in the {ov['real_steps']} real steps alone)")
    capacity_report(result["capacity"])
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
