"""Speculative decoding on CPU: speculation off vs ngram vs mtp, in one run.

    python benchmarks/train_tiny.py --out out/tiny_mtp      # once: the trained model
    python benchmarks/spec_decode.py --model out/tiny_mtp [--k 3] [--json OUT]

(a) The random tiny model (and a random MTP block): nothing to accept, so the figures are
    the overhead of speculating (target for ngram, which then proposes nothing: <= 1.05x
    the wall time per token of off).
(b) The trained tiny model of `train_tiny.py` on held-out copy/edit prompts (the answer
    repeats a span of the prompt with edits): target >= 2x tokens per forward and >= 1.5x
    faster wall time per token than off.

Each at batch 1 (one request at a time) and batch 8 (eight at once: verification is
batched with the other requests' decode tokens). Per mode: decode steps, tokens per
forward (tokens a request gets per step it decodes), the drafts' acceptance, wall time
per generated token after each request's first (the decode phase; the prefill is the
same in every mode), each as a ratio to off. Greedy tokens are checked identical to off.
The least of `--repeats` runs is kept (the machine is noisy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import write_json
from copy_edit import copy_edit_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine import rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.model.mtp import load_mtp, random_mtp

CFG = CacheConfig(page_size=16, device_tokens=16 * 1024)


def decode_run(model: Any, block: Any, spec: SpecConfig | None, prompts: list[list[int]],
               params: SamplingParams, batch: int) -> dict:
    """Run `prompts`, `batch` at a time, through the online API; time the decode phase."""
    eng = Engine.from_hf(model, CFG, speculative=spec,
                         mtp=block if spec is not None and spec.method == "mtp" else None)
    tokens: dict[str, list[int]] = {}
    decode_s, decode_tokens, decode_outputs, steps = 0.0, 0, 0, 0
    for lo in range(0, len(prompts), batch):
        ids = [eng.add_request(p, params) for p in prompts[lo:lo + batch]]
        for rid in ids:
            tokens[rid] = []
        started: set[str] = set()
        t0 = None
        while eng.has_unfinished():
            t = time.perf_counter()
            outs = eng.step()
            if t0 is not None:
                decode_s += time.perf_counter() - t
                steps += 1
            for o in outs:
                if o.request_id in started:
                    decode_tokens += len(o.new_token_ids)
                    decode_outputs += 1
                elif o.new_token_ids:
                    decode_tokens += len(o.new_token_ids) - 1
                    decode_outputs += len(o.new_token_ids) > 1
                    started.add(o.request_id)
                tokens[o.request_id] += o.new_token_ids
            if t0 is None and len(started) == len(ids):
                t0 = time.perf_counter()
    spec_stats = eng.stats()["spec"]
    eng.close()
    return {"outputs": [tokens[r] for r in sorted(tokens, key=lambda r: int(r.split("-")[1]))],
            "decode_steps": steps, "decode_tokens": decode_tokens,
            "tokens_per_forward": decode_tokens / max(decode_outputs, 1),
            "ms_per_token": 1e3 * decode_s / max(decode_tokens, 1),
            "accepted_tokens": spec_stats["accepted_tokens"],
            "draft_tokens": spec_stats["draft_tokens"],
            "mean_accepted_length": spec_stats["mean_accepted_length"]}


def compare(model: Any, block: Any, prompts: list[list[int]], params: SamplingParams,
            k: int, repeats: int) -> dict:
    modes = {"off": None, "ngram": SpecConfig("ngram", k), "mtp": SpecConfig("mtp", k)}
    out: dict[str, Any] = {}
    for batch in (1, 8):
        runs: dict[str, dict] = {}
        for _ in range(repeats):  # modes alternate, so drift hits each alike
            for name, spec in modes.items():
                r = decode_run(model, block, spec, prompts, params, batch)
                if name not in runs or r["ms_per_token"] < runs[name]["ms_per_token"]:
                    runs[name] = r
        base = runs["off"]
        expected = base["outputs"]
        for r in runs.values():
            r["speedup_vs_off"] = base["ms_per_token"] / r["ms_per_token"]
            r["tokens_per_forward_vs_off"] = r["tokens_per_forward"] / base["tokens_per_forward"]
        for r in runs.values():
            r["identical_to_off"] = r.pop("outputs") == expected
        out[f"batch {batch}"] = runs
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("out/tiny_mtp"),
                    help="the trained checkpoint (train_tiny.py --out DIR)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"k": args.k}
    random_model = tiny_model()
    prompts = [rand_tokens(48 + 8 * (i % 5), 1000 + i) for i in range(args.requests)]
    result["random"] = compare(random_model, random_mtp(random_model.config, seed=1), prompts,
                               SamplingParams(max_new_tokens=24, ignore_eos=True), args.k,
                               args.repeats)
    if (args.model / "config.json").exists():
        from transformers import DeepseekV4ForCausalLM

        trained: Any = DeepseekV4ForCausalLM.from_pretrained(str(args.model)).eval()
        block = load_mtp(args.model, trained.config)
        tasks = copy_edit_prompts(args.requests, seed=7)
        result["trained"] = compare(trained, block, [t.prompt for t in tasks],
                                    SamplingParams(max_new_tokens=24), args.k, args.repeats)
    else:
        print(f"no trained model at {args.model}: run benchmarks/train_tiny.py --out "
              f"{args.model} first (case (b) skipped)")
    print(f"speculative decoding, K = {args.k}, {args.requests} requests, CPU "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'model':8} {'batch':6} {'mode':6} {'steps':>6} {'tok/fwd':>8} {'(x off)':>8} "
          f"{'accepted':>11} {'ms/tok':>7} {'speedup':>8} {'same':>5}")
    for model_name in ("random", "trained"):
        for batch, runs in result.get(model_name, {}).items():
            for name, r in runs.items():
                acc = f"{r['accepted_tokens']}/{r['draft_tokens']}" if name != "off" else "-"
                print(f"{model_name:8} {batch[6:]:6} {name:6} {r['decode_steps']:6d} "
                      f"{r['tokens_per_forward']:8.2f} {r['tokens_per_forward_vs_off']:7.2f}x "
                      f"{acc:>11} {r['ms_per_token']:7.2f} {r['speedup_vs_off']:7.2f}x "
                      f"{r['identical_to_off']!s:>5}")
    write_json(args.json, result)
    ok = all(r["identical_to_off"] for m in ("random", "trained")
             for runs in result.get(m, {}).values() for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
