"""HiCache tiers so far: L3 throughput against the raw client, and what L3 saves.

    python benchmarks/tiers.py [--json OUT]

1. L3 get/set throughput of RedisBackend (checksummed objects, pipelined) as a ratio to
   raw pipelined `redis` calls with the same values, and of FileBackend against raw
   file writes and reads of the same bytes. A real Valkey/Redis server on 127.0.0.1.
2. The multi-turn workload with a small device tier: L1 only vs L1 + L3 (file://),
   prefill tokens computed and wall time. (L2, the host tier, is not built yet.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import write_json
from redis_server import RedisServer

from shadowradix.tiers.storage import FileBackend, RedisBackend, object_key

PAGE_BYTES = 64 * 1024  # one pool-page object (a small page of a small model)
N = 400


def items() -> list[tuple[str, bytes]]:
    return [(object_key("bench", "c4", i.to_bytes(16, "little")), os.urandom(PAGE_BYTES))
            for i in range(N)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def redis_ratio(workdir: Path) -> dict:
    import redis

    server = RedisServer(workdir)
    try:
        data = items()
        keys = [k for k, _ in data]
        raw = redis.Redis.from_url(server.url)

        def raw_set():
            pipe = raw.pipeline(transaction=False)
            for k, v in data:
                pipe.set(k, v)
            pipe.execute()

        ours = RedisBackend(server.url, timeout_s=10)
        t_raw_set = min(timed(raw_set) for _ in range(3))
        t_raw_get = min(timed(lambda: raw.mget(keys)) for _ in range(3))
        t_set = min(timed(lambda: ours.batch_set(data)) for _ in range(3))
        t_get = min(timed(lambda: ours.batch_get(keys)) for _ in range(3))
        assert ours.batch_get(keys[:1]) == [data[0][1]]
        return {"set_ratio": t_raw_set / t_set, "get_ratio": t_raw_get / t_get,
                "set_MBps": N * PAGE_BYTES / t_set / 1e6, "get_MBps": N * PAGE_BYTES / t_get / 1e6}
    finally:
        server.stop()


def file_ratio(workdir: Path) -> dict:
    data = items()
    keys = [k for k, _ in data]
    raw_dir = workdir / "raw"
    raw_dir.mkdir()

    def raw_set():
        for i, (_, v) in enumerate(data):
            (raw_dir / str(i)).write_bytes(v)

    def raw_get():
        for i in range(N):
            (raw_dir / str(i)).read_bytes()

    ours = FileBackend(workdir / "ours")
    t_raw_set, t_raw_get = timed(raw_set), timed(raw_get)
    t_set, t_get = timed(lambda: ours.batch_set(data)), timed(lambda: ours.batch_get(keys))
    return {"set_ratio": t_raw_set / t_set, "get_ratio": t_raw_get / t_get}


def multi_turn(workdir: Path) -> dict:
    from shadowradix.demo import conversations, scaled_prompt, tiny_deepseek_v4
    from shadowradix.engine import CacheConfig, Engine, SamplingParams
    from shadowradix.sim.trace import bundled_trace, load_trace

    model = tiny_deepseek_v4()
    trace = conversations(load_trace(bundled_trace("conversation")), 4, 32)
    prompts = [scaled_prompt(r, 16, model.config.vocab_size) for r in trace]
    out = {}
    for setup, storage in (("L1", None), ("L1+L3", f"file://{workdir / 'l3'}")):
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=1024,
                                                storage=storage))
        t0 = time.perf_counter()
        for p in prompts:
            eng.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))
        st = eng.stats()
        out[setup] = {"wall_s": time.perf_counter() - t0, "prefill_tokens": st["prefill_tokens"],
                      "hits": st["hits"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "r").mkdir()
        (work / "f").mkdir()
        result = {"redis": redis_ratio(work / "r"), "file": file_ratio(work / "f"),
                  "multi_turn": multi_turn(work)}
    r, f, mt = result["redis"], result["file"], result["multi_turn"]
    print(f"L3 redis ({N} x {PAGE_BYTES // 1024} KiB): set {r['set_ratio']:.2f}x, "
          f"get {r['get_ratio']:.2f}x the raw pipelined client "
          f"({r['set_MBps']:.0f} / {r['get_MBps']:.0f} MB/s)")
    print(f"L3 file: set {f['set_ratio']:.2f}x, get {f['get_ratio']:.2f}x raw file I/O")
    for setup, row in mt.items():
        print(f"multi-turn, 1K-token device tier, {setup}: prefill {row['prefill_tokens']:,} "
              f"tokens, {row['wall_s']:.1f} s, hits {row['hits']}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
