"""The checks that need an accelerator, in one short run (also runs on CPU, as a dry run).

    python benchmarks/gpu_check.py [--json OUT]

1. Exactness on the device: a tiny DeepSeek-V4 on CUDA serves turn 2 of four
   conversations from the host tier (after a device flush) and from storage (a fresh
   engine), under write-through and write-back; logits against transformers on the
   same device (TF32 off).
2. L2 -> L1 load-back through the StreamMover (pinned host pools, a copy stream) as a
   ratio to one raw pinned host -> device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import write_json
from test_engine import rand_tokens
from tiny_model import reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.mover import mover_for
from shadowradix.tree.tier import HOST

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


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
            diffs = []
            for t, r in zip(turn2, results, strict=True):
                n = len(r.output_ids)
                ref = reference_logits(model, t + r.output_ids)[len(t) - 1:len(t) - 1 + n]
                diffs.append((ref.cpu() - r.logits).abs().max().item())
            out[f"{policy}/{tier}"] = {
                "max_logit_diff": max(diffs),
                "cached_by_tier": [r.cached_by_tier for r in results]}
    return out


def loadback(device: torch.device) -> dict:
    layers, pages, n = 8, 96, 64
    layout = KVLayout("bench", (PoolSpec("kv", 1, Retention.ALL, (512,), "bfloat16", layers),),
                      256)
    cache = PrefixCache(layout, pages, device=device, host_pages=pages)
    host = cache.tensor("kv", HOST)
    host.copy_(torch.randn(host.shape).to(host.dtype))
    mover = mover_for(cache.tensor, device)
    nbytes = n * host[:, 0].numel() * host.element_size()
    src_raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst_raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src_raw.copy_(host.view(torch.uint8).flatten()[:nbytes])  # real bytes, not untouched pages

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    rng = np.random.default_rng(0)
    out = {"bytes": nbytes, "mover": type(mover).__name__,
           "pinned": bool(host.is_pinned()) if device.type == "cuda" else False}
    t_raw = timed(lambda: dst_raw.copy_(src_raw, non_blocking=True))
    for case in ("consecutive", "scattered"):
        if case == "consecutive":
            src, dst = np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32) + 8
        else:
            src = rng.permutation(pages)[:n].astype(np.int32)
            dst = rng.permutation(pages)[:n].astype(np.int32)

        def ours(src=src, dst=dst) -> None:
            mover.wait(mover.submit([("kv", HOST, src, dst)]))

        t = timed(ours)
        assert torch.equal(cache.tensor("kv")[:, int(dst[3])].cpu(), host[:, int(src[3])])
        out[case] = {"ratio": t_raw / t, "GBps": nbytes / t / 1e9,
                     "raw_GBps": nbytes / t_raw / 1e9}
    mover.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        result = {"device": str(device), "torch": torch.__version__,
                  "exactness": exactness(device, Path(tmp)), "loadback": loadback(device)}
    ok = all(v["max_logit_diff"] <= 1e-4 for v in result["exactness"].values())
    result["ok"] = ok
    print(f"device {device}")
    for key, v in result["exactness"].items():
        tiers = v["cached_by_tier"][0]
        print(f"  {key:26} max |logit diff| {v['max_logit_diff']:.1e}; first request {tiers}")
    lb = result["loadback"]
    for case in ("consecutive", "scattered"):
        print(f"  load-back {case:11} {lb[case]['ratio']:.2f}x raw ({lb[case]['GBps']:.1f} vs "
              f"{lb[case]['raw_GBps']:.1f} GB/s, {lb['mover']})")
    print("OK" if ok else "FAILED")
    write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
