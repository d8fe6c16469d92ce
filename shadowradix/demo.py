"""`shadowradix demo`: real multi-turn traffic through the engine on a tiny DeepSeek-V4.

A tiny random DeepSeek-V4 (built with transformers, nothing downloaded) serves
the first requests of the bundled conversation trace, scaled down to fit a CPU:
each 512-token block of the trace becomes `block_tokens` tokens, so requests
that share blocks share token prefixes exactly as the trace says. A sample of
the answers is checked against transformers' uncached forward, and every answer
against the same requests served again with HiSparse on.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shadowradix.sim.trace import TraceRequest, bundled_trace, load_trace

DEMO_SHAPE = dict(vocab_size=1024, hidden_size=128, head_dim=64, q_lora_rank=64,
                  o_lora_rank=32, index_head_dim=32, index_topk=16, sliding_window=32,
                  n_routed_experts=8, moe_intermediate_size=64)


def tiny_deepseek_v4(seed: int = 0) -> Any:
    """The demo's model: a little wider than the tests' (vocab 1024, 4 layers)."""
    from shadowradix.model.tiny import tiny_deepseek_v4 as build

    return build(seed, **DEMO_SHAPE)


def scaled_prompt(req: TraceRequest, block_tokens: int, vocab: int) -> list[int]:
    """Block h becomes `block_tokens` pseudo-random ids seeded by h; the last block is cut."""
    out: list[int] = []
    for h in req.hash_ids:
        out += np.random.default_rng(h).integers(0, vocab, block_tokens).tolist()
    return out[:max(1, -(-req.input_length * block_tokens // 512))]


def conversations(requests: list[TraceRequest], turns: int, limit: int,
                  max_blocks: int = 40) -> list[TraceRequest]:
    """The trace's multi-turn conversations (requests sharing their first two blocks), their
    first `turns` turns each, in arrival order, up to `limit` requests."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, req in enumerate(requests):
        if 2 <= len(req.hash_ids) <= max_blocks:
            groups.setdefault(req.hash_ids[:2], []).append(i)
    chosen: list[int] = []
    for members in groups.values():
        if len(members) >= turns and len(chosen) < limit:
            chosen += members[:turns]
    return [requests[i] for i in sorted(chosen[:limit])]


def run_demo(requests: int = 64, block_tokens: int = 16, check: int = 4) -> int:
    import torch
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from shadowradix.engine import CacheConfig, Engine, SamplingParams

    console = Console()
    model = tiny_deepseek_v4()
    vocab = model.config.vocab_size
    trace = conversations(load_trace(bundled_trace("conversation")), 4, requests)
    prompts = [scaled_prompt(r, block_tokens, vocab) for r in trace]
    outs = [max(1, min(8, r.output_length * block_tokens // 512)) for r in trace]
    engine = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2 * 1024,
                                               host_tokens=8 * 1024))
    console.print(f"Serving {len(prompts)} requests (the first 4 turns of {len(prompts) // 4} "
                  f"conversations) of the conversation trace, each 512-token block scaled to "
                  f"{block_tokens} tokens, through a tiny random DeepSeek-V4 on ShadowRadix: "
                  "page 16, 2K device tokens (L1) over 8K host tokens (L2, write-through).")
    t0 = time.perf_counter()
    results = []
    for prompt, n in track(list(zip(prompts, outs, strict=True)), description="requests",
                           console=console, transient=True):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        results.append(engine.generate([prompt], params, return_logits=True)[0])
    wall = time.perf_counter() - t0
    st = engine.stats()
    table = Table(title="shadowradix demo: DeepSeek-V4 (tiny, random) on the conversation trace")
    table.add_column("metric")
    table.add_column("value", justify="right")
    tokens = st["prefill_tokens"] + st["decode_tokens"]
    for k, v in [("requests", f"{st['requests']:,}"),
                 ("prompt tokens", f"{st['prompt_tokens']:,}"),
                 ("cached tokens: device / host / storage",
                  " / ".join(f"{st['hits'][t]:,}" for t in ("device", "host", "storage"))),
                 ("hit rate", f"{st['cached_tokens'] / max(st['prompt_tokens'], 1):.1%}"),
                 ("prefill tokens computed", f"{st['prefill_tokens']:,}"),
                 ("decode tokens", f"{st['decode_tokens']:,}"),
                 ("wall time", f"{wall:.1f} s"),
                 ("tokens/s (prefill + decode)", f"{tokens / wall:,.0f}")]:
        table.add_row(k, v)
    console.print(table)
    # The correctness bar: what the cache served must not change a single logit.
    worst, same = 0.0, True
    by_hit = sorted(range(len(results)), key=lambda i: -results[i].cached_tokens)
    by_host = sorted(range(len(results)), key=lambda i: -results[i].cached_by_tier["host"])
    picks = sorted({*by_hit[:check // 2], *by_host[:check - check // 2]})
    for i in picks:
        seq = prompts[i] + results[i].output_ids
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0].float()
        ref = ref[len(prompts[i]) - 1:len(seq) - 1]
        worst = max(worst, (ref - results[i].logits).abs().max().item())
        same &= results[i].output_ids == ref.argmax(-1).tolist()
    ok = worst <= 1e-4 and same
    engine.close()
    console.print(f"checked {len(picks)} requests with the largest device and host hits against "
                  f"transformers' uncached forward: max |logit diff| {worst:.1e}, greedy tokens "
                  f"{'identical' if same else 'DIFFER'}: {'OK' if ok else 'FAILED'}")
    return 0 if ok and _hisparse_pass(console, model, prompts, outs, results) else 1


def _hisparse_pass(console: Any, model: Any, prompts: list[list[int]], outs: list[int],
                   results: list[Any]) -> bool:
    """The same requests again with HiSparse on (the C4 history in host memory, a hot
    buffer of index_topk + 1 entries per request and CSA layer): the same logits."""
    from rich.progress import track

    from shadowradix.engine import CacheConfig, Engine, SamplingParams

    buffer = int(model.config.index_topk) + 1
    engine = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2 * 1024,
                                               host_tokens=8 * 1024, hisparse_buffer=buffer))
    worst = 0.0
    for prompt, n, before in track(list(zip(prompts, outs, results, strict=True)),
                                   description="HiSparse", console=console, transient=True):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        r = engine.generate([prompt], params, return_logits=True)[0]
        if r.output_ids != before.output_ids:
            worst = float("inf")
            break
        worst = max(worst, (r.logits - before.logits).abs().max().item())
    hs = engine.stats()["hisparse"]
    engine.close()
    ok = worst <= 1e-6
    rate = "-" if hs["hit_rate"] is None else f"{hs['hit_rate']:.1%}"
    console.print(f"again with HiSparse (buffer {buffer} C4 entries per request and CSA layer "
                  f"on the device, the history in host memory): {hs['hits']:,} hits, "
                  f"{hs['misses']:,} misses (hit rate {rate}), {hs['fast_path_lookups']:,} "
                  f"fast-path lookups; max |logit diff| against HiSparse off {worst:.1e}: "
                  f"{'OK' if ok else 'FAILED'}")
    return ok
