"""The checks that need an accelerator, in one short run (also runs on CPU, as a dry run).

    python benchmarks/gpu_check.py [--json OUT]

1. Exactness on the device: a tiny DeepSeek-V4 on CUDA serves turn 2 of four
   conversations from the host tier (after a device flush) and from storage (a fresh
   engine), under write-through and write-back; logits against transformers on the
   same device (TF32 off).
2. L2 -> L1 load-back through the StreamMover (pinned host pools, a copy stream) as a
   ratio to one raw pinned host -> device copy of the same bytes.
3. The online core on the device: requests added between steps, one aborted mid-decode,
   decodes that outgrow a small device (preemption) and a window pool smaller than the
   sequences, pages poisoned as they are handed out, write-back spills; every output
   against transformers, `check_integrity` after every step.
4. The server on the device: `shadowradix serve --model tiny --device DEV` (uvicorn on
   127.0.0.1), four concurrent greedy `/generate` requests against transformers' greedy
   tokens on the same device, and the metrics it exports.
5. HiSparse on the device: the C4 pool in pinned host memory, hot buffers on the device;
   a mixed batch with a second turn served from the host tier (after a device flush) and
   from storage, against HiSparse off on the same device and against transformers; the
   hit rate and bytes moved, and decode step time on / off.
6. Speculative decoding on the device: ngram, MTP (a random MTP block) and an oracle
   drafter (always right) at K = 3 and 7, with HiSparse and the host tier on, against
   speculation off (identical greedy tokens) and transformers; acceptance and wall time
   per generated token against off.
7. The arena on the device (`CacheConfig(device_bytes=)`: one uint8 tensor, every pool a
   strided view of it): six requests in an arena of about 12 pages of every pool, so
   they preempt each other, pages poisoned as they are handed out; alone and over a
   write-back host tier; against transformers, `check_integrity` at the end.
8. Arena compaction on the device (tree pages moved by a device copy inside the arena's
   tensor to give frames back, later turns reading them exact), HiSparse beside the arena,
   and a bfloat16 checkpoint over the arena (bf16 and fp32 pools as views of one uint8
   tensor) against transformers in bfloat16 on the same device.

Each check runs on its own: one that raises is reported with its traceback and the
rest still run (a lent device's minutes are few).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from common import write_json
from server_util import ServerThread, metrics
from test_engine import rand_tokens
from tiers import loadback_ratio
from tiny_model import greedy_tokens, reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.model.mtp import random_mtp

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


def max_logit_diff(model, prompts, results) -> float:
    """The largest |logit diff| of the results against transformers' uncached forward of
    each prompt and its outputs (on the model's device)."""
    diffs = []
    for t, r in zip(prompts, results, strict=True):
        n = len(r.output_ids)
        ref = reference_logits(model, t + r.output_ids)[len(t) - 1:len(t) - 1 + n]
        diffs.append((ref.cpu() - r.logits).abs().max().item())
    return max(diffs)


def page_bytes(model) -> int:
    """Bytes of one logical page of every pool of `model` at page size 16."""
    probe = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=16))
    page = sum(probe.layout.page_bytes().values())
    probe.close()
    return page


def exactness(device: torch.device, workdir: Path) -> dict:
    model = tiny_model().to(device)
    convs = [rand_tokens(40 + 9 * i, 300 + i) for i in range(4)]
    out = {}
    for policy in ("write_through", "write_back"):
        cfg = CacheConfig(page_size=16, device_tokens=512, host_tokens=4096,
                          write_policy=policy, storage=f"file://{workdir / policy}")
        eng = Engine.from_hf(model, cfg)
        first = eng.generate(convs, P)
        turn2 = [c + r.output_ids + rand_tokens(7, 400 + i)
                 for i, (c, r) in enumerate(zip(convs, first, strict=True))]
        eng.cache.flush(tiers=("device",))
        served = {"host": eng.generate(turn2, P, return_logits=True)}
        eng.close()
        fresh = Engine.from_hf(model, cfg)
        served["storage"] = fresh.generate(turn2, P, return_logits=True)
        fresh.close()
        for tier, results in served.items():
            out[f"{policy}/{tier}"] = {
                "max_logit_diff": max_logit_diff(model, turn2, results),
                "cached_by_tier": [r.cached_by_tier for r in results]}
    return out


def online(device: torch.device) -> dict:
    model = tiny_model().to(device)
    out = {}
    for policy in ("write_through", "write_back"):
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=256,
                                                window_tokens=128, host_tokens=1024,
                                                write_policy=policy, debug_poison=True),
                             step_tokens=32)
        p = SamplingParams(max_new_tokens=24, ignore_eos=True)
        prompts = {eng.add_request(t, p, return_logits=True): t
                   for t in (rand_tokens(30 + 5 * i, 500 + i) for i in range(6))}
        results, steps, victim = {}, 0, next(iter(prompts))
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    results[o.request_id] = o.result
            steps += 1
            if steps == 6:
                eng.abort(victim)
                late = rand_tokens(45, 600)
                prompts[eng.add_request(late, p, return_logits=True)] = late
            eng.check_integrity()
        diff = max_logit_diff(model, [prompts[rid] for rid in results], results.values())
        st = eng.stats()
        eng.close()
        out[policy] = {"max_logit_diff": diff, "finished": len(results),
                       "preemptions": st["preemptions"], "steps": steps}
    return out


def served(device: torch.device) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from shadowradix.demo import tiny_deepseek_v4

    server = ServerThread.from_args("--model", "tiny", "--device", str(device),
                                    "--host-tokens", "8192")
    try:
        prompts = [rand_tokens(60 + 11 * i, 700 + i) for i in range(4)]

        def ask(ids: list[int]) -> list[int]:
            r = httpx.post(f"{server.url}/generate", timeout=120, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                      "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        model = tiny_deepseek_v4().to(device)
        same = sum(g == greedy_tokens(model, p, 16) for g, p in zip(got, prompts, strict=True))
        m = metrics(server.url)
        return {"greedy_identical": same, "requests": len(prompts),
                "generation_tokens": m["shadowradix:generation_tokens_total"],
                "ttft_count": m["shadowradix:time_to_first_token_seconds_count"]}
    finally:
        server.stop()


def hisparse(device: torch.device, workdir: Path) -> dict:
    model = tiny_model().to(device)
    prompts = [rand_tokens(n, 700 + n) for n in (20, 90, 150, 233)]
    p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs, out = {}, {}
    for mode, buffer in (("off", None), ("on", 9)):
        cfg = CacheConfig(page_size=16, device_tokens=2048, host_tokens=4096,
                          storage=f"file://{workdir / ('hisparse-' + mode)}",
                          hisparse_buffer=buffer, hisparse_requests=8 if buffer else None)
        eng = Engine.from_hf(model, cfg)
        if buffer is not None:
            out["c4_pinned"] = bool(eng.store.flat("c4", 1).is_pinned())
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = eng.generate(prompts, p, return_logits=True)
        turn2 = [t + r.output_ids + rand_tokens(5, 800 + i)
                 for i, (t, r) in enumerate(zip(prompts, first, strict=True))]
        eng.cache.flush(tiers=("device",))
        second = eng.generate(turn2, p, return_logits=True)
        st = eng.stats()
        eng.close()
        fresh = Engine.from_hf(model, cfg)
        third = fresh.generate(turn2, p, return_logits=True)
        fresh.close()
        runs[mode] = (first + second + third, st)
    results_off, _ = runs["off"]
    results_on, st = runs["on"]
    ref_diff = max_logit_diff(model, prompts + turn2 + turn2, results_on)
    hs = st["hisparse"]
    seconds = {m: runs[m][1]["forward_seconds"] / max(runs[m][1]["steps"], 1) for m in runs}
    return {**out,
            "tokens_identical": all(a.output_ids == b.output_ids
                                    for a, b in zip(results_off, results_on, strict=True)),
            "max_diff_vs_off": max((a.logits - b.logits).abs().max().item()
                                   for a, b in zip(results_off, results_on, strict=True)),
            "max_logit_diff": ref_diff, "hit_rate": hs["hit_rate"], "misses": hs["misses"],
            "bytes_moved": hs["bytes_moved"],
            "tiers_second_turn": [r.cached_by_tier for r in runs["on"][0][4:8]],
            "tiers_fresh_engine": [r.cached_by_tier for r in runs["on"][0][8:]],
            "forward_ms_per_step": {m: v * 1e3 for m, v in seconds.items()}}


def speculative(device: torch.device) -> dict:
    model = tiny_model().to(device)
    block = random_mtp(model.config, seed=1).to(device)
    prompts = [rand_tokens(n, 900 + n) for n in (20, 90, 150, 233)]
    prompts[0] = prompts[0][:10] * 6  # repetition: the n-gram drafter has something to find
    p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    cfg = CacheConfig(page_size=16, device_tokens=2048, host_tokens=4096, hisparse_buffer=5,
                      hisparse_requests=8)

    def run(spec: SpecConfig | None) -> tuple[list, dict, float]:
        eng = Engine.from_hf(model, cfg, speculative=spec,
                             mtp=block if spec is not None and spec.method == "mtp" else None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        results = eng.generate(prompts, p, return_logits=True)
        st = eng.stats()
        eng.check_integrity()
        eng.close()
        return results, st, st["step_seconds"] / sum(len(r.output_ids) for r in results)

    base, base_st, base_s = run(None)
    truth = [t + r.output_ids for t, r in zip(prompts, base, strict=True)]

    def oracle(tokens: list[int], k: int) -> list[int]:
        full = next(f for f in truth if f[:len(tokens)] == list(tokens))
        return full[len(tokens):len(tokens) + k]

    out = {"off": {"steps": base_st["steps"], "ms_per_token": base_s * 1e3}}
    for name, spec in (("ngram-3", SpecConfig("ngram", 3)), ("mtp-3", SpecConfig("mtp", 3)),
                       ("oracle-7", SpecConfig("custom", 7, proposer=oracle))):
        results, st, secs = run(spec)
        ref_diff = max_logit_diff(model, prompts, results)
        out[name] = {"tokens_identical": all(a.output_ids == b.output_ids
                                             for a, b in zip(base, results, strict=True)),
                     "max_logit_diff": ref_diff, "steps": st["steps"],
                     "mean_accepted_length": st["spec"]["mean_accepted_length"],
                     "draft_tokens": st["spec"]["draft_tokens"],
                     "accepted_tokens": st["spec"]["accepted_tokens"],
                     "ms_per_token": secs * 1e3, "vs_off": secs / base_s}
    return out


def arena(device: torch.device) -> dict:
    model = tiny_model().to(device)
    page = page_bytes(model)
    out = {}
    for host in (0, 1024):
        extra = {"host_tokens": host, "write_policy": "write_back"} if host else {}
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_bytes=12 * page,
                                                debug_poison=True, **extra), step_tokens=32)
        prompts = [rand_tokens(30 + 5 * i, 700 + i) for i in range(6)]
        p = SamplingParams(max_new_tokens=24, ignore_eos=True)
        results = eng.generate(prompts, p, return_logits=True)
        eng.check_integrity()
        st = eng.stats()
        out[f"host-{host}"] = {"max_logit_diff": max_logit_diff(model, prompts, results),
                               "finished": len(results),
                               "preemptions": st["preemptions"],
                               "frames": st["arena"]["frames"],
                               "tensor_device": str(eng._prefix.arena.data.device)}
        eng.close()
    return out


def arena_moves(device: torch.device) -> dict:
    """Compaction on the device: a tight arena and conversations of uneven lengths leave
    holes in frames; compaction moves the tree's pages (a device copy inside the one
    uint8 tensor) to give frames back, and later turns that read the moved pages are
    exact. Then HiSparse beside the arena (its hot buffers set apart from it)."""
    model = tiny_model().to(device)
    page = page_bytes(model)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_bytes=20 * page,
                                            debug_poison=True), step_tokens=64)
    chats = [rand_tokens(17 + 13 * (i % 5), 400 + i) for i in range(10)]
    p = SamplingParams(max_new_tokens=6, ignore_eos=True)
    worst = 0.0
    for turn in range(3):
        for i, prompt in enumerate(chats):
            r = eng.generate([prompt], p, return_logits=True)[0]
            worst = max(worst, max_logit_diff(model, [prompt], [r]))
            chats[i] = prompt + r.output_ids + rand_tokens(5 + 7 * ((i + turn) % 3), 500 + i)
        both = [chats[turn], chats[turn + 5]]
        worst = max(worst, max_logit_diff(model, both, eng.generate(both, p, return_logits=True)))
    eng.check_integrity()
    moved = int(sum(eng._prefix.moved.values()))
    eng.close()
    hs = Engine.from_hf(model, CacheConfig(page_size=16, device_bytes=30 * page,
                                           hisparse_buffer=9, hisparse_requests=2,
                                           debug_poison=True))
    prompts = [rand_tokens(70, 90), rand_tokens(50, 91)]
    hs_diff = max_logit_diff(model, prompts, hs.generate(
        prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), return_logits=True))
    hs.check_integrity()
    hs.close()
    return {"compaction": {"max_logit_diff": worst, "pages_moved": moved},
            "hisparse": {"max_logit_diff": hs_diff}}


def arena_bf16(device: torch.device, workdir: Path) -> dict:
    """A bfloat16 checkpoint over the arena (pools of bf16 and fp32 entries as views of one
    uint8 tensor) against transformers in bfloat16 on the same device: within 4 bf16 ulps
    of the largest logit, greedy identical where transformers' top two are clearly apart."""
    from transformers import DeepseekV4ForCausalLM

    path = workdir / "bf16"
    tiny_model().save_pretrained(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval().to(device)
    eng = Engine.from_pretrained(str(path), CacheConfig(page_size=16, device_tokens=16),
                                 dtype=torch.bfloat16, device=device)
    page = sum(eng.layout.page_bytes().values())
    eng.close()
    eng = Engine.from_pretrained(str(path), CacheConfig(page_size=16, device_bytes=40 * page,
                                                        debug_poison=True),
                                 dtype=torch.bfloat16, device=device, step_tokens=29)
    first = [rand_tokens(75, 3), rand_tokens(40, 5)]
    cold = eng.generate(first, P, return_logits=True)
    second = [t + r.output_ids + rand_tokens(11, 4 + i)
              for i, (t, r) in enumerate(zip(first, cold, strict=True))]
    hits = eng.generate(second, P, return_logits=True)
    worst_ulps, greedy_ok = 0.0, True
    for t, r in zip(first + second, cold + hits, strict=True):
        n = len(r.output_ids)
        ref = reference_logits(hf, t + r.output_ids)[len(t) - 1:len(t) - 1 + n].cpu()
        ulp = 2.0 ** -8 * max(1.0, ref.abs().max().item())
        worst_ulps = max(worst_ulps, (ref - r.logits).abs().max().item() / ulp)
        top2 = ref.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 8 * ulp
        greedy_ok = greedy_ok and torch.equal(r.logits.argmax(-1)[clear], ref.argmax(-1)[clear])
    eng.check_integrity()
    eng.close()
    return {"max_ulps": worst_ulps, "greedy_identical": bool(greedy_ok),
            "cached_tokens": [r.cached_tokens for r in hits]}


def run_section(name: str, fn, *args) -> dict:
    """One check, timed; a failure is recorded with its traceback and the next check runs
    (on a lent device every minute counts: one broken path must not hide the others)."""
    start = time.perf_counter()
    print(f"[{name}] ...", flush=True)
    try:
        out = fn(*args)
    except Exception as exc:  # report it, run the rest
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(out["traceback"], flush=True)
    seconds = time.perf_counter() - start
    print(f"[{name}] {seconds:.1f} s", flush=True)
    return {**out, "seconds": seconds} if isinstance(out, dict) else out


def passed(result: dict, device: torch.device) -> dict[str, bool]:
    """Each section's verdict; a section that raised fails."""
    ok: dict[str, bool] = {}
    sections = ("exactness", "online", "served", "hisparse", "speculative", "arena",
                "arena_moves", "arena_bf16", "loadback")
    failed = {k for k in sections if "error" in result[k]}
    for k in failed:
        ok[k] = False
    if "exactness" not in failed:
        ok["exactness"] = all(v["max_logit_diff"] <= 1e-4
                              for _, v in cases(result["exactness"]))
    if "online" not in failed:
        ok["online"] = all(v["max_logit_diff"] <= 1e-4 and v["finished"] == 6
                           for _, v in cases(result["online"]))
    if "served" not in failed:
        ok["served"] = result["served"]["greedy_identical"] == result["served"]["requests"]
    if "hisparse" not in failed:
        hs = result["hisparse"]
        ok["hisparse"] = bool(hs["tokens_identical"] and hs["max_diff_vs_off"] <= 1e-6
                              and hs["max_logit_diff"] <= 1e-4
                              and hs["c4_pinned"] == (device.type == "cuda"))
    if "speculative" not in failed:
        spec = result["speculative"]
        ok["speculative"] = all(v["tokens_identical"] and v["max_logit_diff"] <= 1e-4
                                for k, v in cases(spec) if k != "off") and (
            spec["oracle-7"]["accepted_tokens"] == spec["oracle-7"]["draft_tokens"])
    if "arena" not in failed:
        ok["arena"] = all(v["max_logit_diff"] <= 1e-4 and v["finished"] == 6
                          and v["tensor_device"].startswith(device.type)
                          for _, v in cases(result["arena"]))
    if "arena_moves" not in failed:
        am = result["arena_moves"]
        ok["arena_moves"] = (am["compaction"]["max_logit_diff"] <= 1e-4
                             and am["compaction"]["pages_moved"] > 0
                             and am["hisparse"]["max_logit_diff"] <= 1e-4)
    if "arena_bf16" not in failed:
        ab = result["arena_bf16"]
        ok["arena_bf16"] = ab["max_ulps"] <= 4 and ab["greedy_identical"] and all(
            c > 0 for c in ab["cached_tokens"])
    if "loadback" not in failed:
        ok["loadback"] = True
    return ok


def report(result: dict) -> None:
    print(f"device {result['device']} (torch {result['torch']})")
    reporters = {"exactness": report_exactness, "online": report_online,
                 "served": report_served, "hisparse": report_hisparse,
                 "speculative": report_speculative, "arena": report_arena,
                 "arena_moves": report_arena_moves, "arena_bf16": report_arena_bf16,
                 "loadback": report_loadback}
    for name, reporter in reporters.items():
        if "error" in result[name]:
            print(f"  {name:26} FAILED: {result[name]['error']}")
        else:
            reporter(result[name])
    print("OK" if result["ok"] else "FAILED: " + ", ".join(
        k for k, v in result["passed"].items() if not v))


def cases(section: dict) -> list[tuple[str, dict]]:
    """A section's cases (its "seconds" left out)."""
    return [(k, v) for k, v in section.items() if k != "seconds"]


def report_exactness(r: dict) -> None:
    for key, v in cases(r):
        print(f"  {key:26} max |logit diff| {v['max_logit_diff']:.1e}; first request "
              f"{v['cached_by_tier'][0]}")


def report_online(r: dict) -> None:
    for key, v in cases(r):
        print(f"  online {key:19} max |logit diff| {v['max_logit_diff']:.1e}; "
              f"{v['finished']} finished, {v['preemptions']} preemptions in {v['steps']} steps")


def report_served(sv: dict) -> None:
    print(f"  served                     {sv['greedy_identical']}/{sv['requests']} greedy "
          f"answers identical to transformers; {sv['generation_tokens']:.0f} tokens generated")


def report_hisparse(hs: dict) -> None:
    ms = hs["forward_ms_per_step"]
    print(f"  hisparse                   max |diff| vs off {hs['max_diff_vs_off']:.1e}, vs "
          f"transformers {hs['max_logit_diff']:.1e}; hit rate {hs['hit_rate']:.2f}, "
          f"{hs['bytes_moved']:,} B moved; forward {ms['on']:.1f} vs {ms['off']:.1f} ms/step; "
          f"C4 pool pinned: {hs['c4_pinned']}")


def report_speculative(spec: dict) -> None:
    for key, v in cases(spec):
        if key == "off":
            print(f"  speculative off            {v['steps']} steps, {v['ms_per_token']:.1f} "
                  f"ms/token")
            continue
        print(f"  speculative {key:14} identical: {v['tokens_identical']}, max |logit diff| "
              f"{v['max_logit_diff']:.1e}; {v['steps']} steps, accepted "
              f"{v['accepted_tokens']}/{v['draft_tokens']} (mean length "
              f"{v['mean_accepted_length'] or 0:.2f}); {v['ms_per_token']:.1f} ms/token "
              f"({v['vs_off']:.2f}x off)")


def report_arena(r: dict) -> None:
    for key, v in cases(r):
        print(f"  arena {key:20} max |logit diff| {v['max_logit_diff']:.1e}; "
              f"{v['finished']} finished, {v['preemptions']} preemptions, {v['frames']} "
              f"frames on {v['tensor_device']}")


def report_arena_moves(am: dict) -> None:
    c, h = am["compaction"], am["hisparse"]
    print(f"  arena compaction           max |logit diff| {c['max_logit_diff']:.1e}; "
          f"{c['pages_moved']} pages moved")
    print(f"  arena + hisparse           max |logit diff| {h['max_logit_diff']:.1e}")


def report_arena_bf16(ab: dict) -> None:
    print(f"  arena bf16                 max diff {ab['max_ulps']:.2f} bf16 ulps of the largest "
          f"logit; greedy identical: {ab['greedy_identical']}; cached {ab['cached_tokens']}")


def report_loadback(lb: dict) -> None:
    for case in ("consecutive", "scattered"):
        print(f"  load-back {case:11} {lb[case]['ratio']:.2f}x raw ({lb[case]['GBps']:.1f} vs "
              f"{lb[case]['raw_GBps']:.1f} GB/s, {lb['mover']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        result = {"device": str(device), "torch": torch.__version__,
                  "exactness": run_section("exactness", exactness, device, Path(tmp)),
                  "online": run_section("online", online, device),
                  "served": run_section("served", served, device),
                  "hisparse": run_section("hisparse", hisparse, device, Path(tmp)),
                  "speculative": run_section("speculative", speculative, device),
                  "arena": run_section("arena", arena, device),
                  "arena_moves": run_section("arena_moves", arena_moves, device),
                  "arena_bf16": run_section("arena_bf16", arena_bf16, device, Path(tmp)),
                  "loadback": run_section("loadback", loadback_ratio, str(device))}
    result["passed"] = passed(result, device)
    ok = all(result["passed"].values())
    result["ok"] = ok
    report(result)
    write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
