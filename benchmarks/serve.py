"""Online serving: the conversation trace replayed open-loop against a live `shadowradix serve`,
with the prefix cache on and off in the same run.

    python benchmarks/serve.py [--requests 96] [--speedup 50] [--json OUT]

Why: engine.py measures what the cache saves inside the engine, one request at a time. This
measures what a client sees when requests arrive on the trace's schedule while others are
still running: a turn whose prefix the cache holds computes only its new tokens, so its own
prefill is shorter and the engine's steps go to the requests queued behind it. Target (the
issue): TTFT p50 with the cache on at most 0.6x the cache off.

How:
- Workload: the one of `make demo`, the first 4 turns of the bundled trace's multi-turn
  conversations, in arrival order, each 512-token block scaled to --block-tokens pseudo-random
  ids (`shadowradix.demo.scaled_prompt`), so turns share prefixes exactly as the trace says;
  output length output_length * block_tokens / 512, between 1 and --max-tokens.
- Open loop: request i is sent (t_i - t_0) / --speedup seconds after the start whether or not
  the earlier ones have answered (an asyncio task per request, one httpx.AsyncClient), so a
  slower server sees the same arrivals and queues them.
- Two phases, the same requests on the same schedule, each against a fresh
  `python -m shadowradix serve --model tiny` on a free port with the same flags: cache on,
  then cache off (`--disable-prefix-cache`: pages are managed as usual, the match is skipped).
  One request of random ids warms the server up and the cache is flushed before the replay;
  the server is stopped with SIGTERM and must exit 0.
- Measured by chunk, the convention of SGLang's bench_serving: a client sees chunks, not
  tokens, and a token that decodes to no text (one of the tiny tokenizer's reserved ids)
  sends none. TTFT runs from sending the request to the first chunk with a choice; ITL is the
  gaps between consecutive chunks that carry text, pooled over all requests (an empty token's
  time folds into the next gap). Token counts come from the usage chunk. Hit rate is
  cached_tokens / prompt_tokens of the usage chunks, split by the tier that held the hit;
  the split is checked against the server's `shadowradix:cached_tokens_total` on /metrics,
  scraped with `preemptions_total` at the end of each phase.

Defaults: 96 requests (24 conversations, 24,610 prompt tokens) at 50x put 48 s in each phase,
half of them (10K prompt tokens) in its first 4 s, every conversation's first turn (which no
cache can serve) in the first 2 s: requests queue on the cache-off server, which still keeps
up over the phase. Device and
host tiers of 4K and 16K tokens: few preemptions at 30-40 requests in flight, and hits from
both tiers. The ratio depends on the load, the machine's included: TTFT is mostly queueing
here, and other work on a 2-core machine slows torch by far more than its share, so each
phase reports the load average it ran under. Compare phases of one run.

A request fails if it gets no HTTP 200, its stream breaks or ends without usage and
`data: [DONE]`, or it returns other than max_tokens tokens; failures are counted and shown.
Exit status 1 if a request failed or a server did not exit 0; a missed target is a
measurement, not an error (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
import numpy as np
from common import write_json
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from server_util import ServerProcess

from shadowradix.demo import conversations, scaled_prompt
from shadowradix.sim.trace import bundled_trace, load_trace

TIERS = ("device", "host", "storage")
VOCAB = 1024  # the tiny model's
MODEL = "tiny"
TARGET = 0.6  # TTFT p50, cache on over cache off
TURNS = 4  # per conversation, as `make demo`
ON, OFF = "cache on", "cache off"
PHASES = {ON: [], OFF: ["--disable-prefix-cache"]}  # extra server flags


# ------------------------------------------------------------------------------ workload
@dataclass(frozen=True, slots=True)
class Request:
    send_at: float  # seconds after the replay starts
    prompt: list[int]
    max_tokens: int


def workload(requests: int, block_tokens: int, max_tokens: int, speedup: float) -> list[Request]:
    trace = conversations(load_trace(bundled_trace("conversation")), TURNS, requests)
    t0 = trace[0].timestamp  # milliseconds
    return [Request(send_at=(r.timestamp - t0) / 1000 / speedup,
                    prompt=scaled_prompt(r, block_tokens, VOCAB),
                    max_tokens=max(1, min(max_tokens, r.output_length * block_tokens // 512)))
            for r in trace]


# -------------------------------------------------------------------------------- server
def warm_up(url: str) -> None:
    """One request of random ids (no prefix of the trace's), then an empty cache: the first
    forward's one-off costs stay out of the replay."""
    prompt = np.random.default_rng(1 << 40).integers(0, VOCAB, 64).tolist()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
    httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()


def scrape(url: str) -> dict[str, Any]:
    """What one server's /metrics says so far (prometheus-client's parser): requests ended,
    cached tokens by tier, preemptions, L3 faults and bytes to and from L3."""
    out: dict[str, Any] = {"requests": 0, "preemptions": 0, "storage_errors": 0,
                           "cached_tokens": dict.fromkeys(TIERS, 0),
                           "storage_loaded_bytes": 0, "storage_backup_bytes": 0}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, int(s.value)
            if name == "shadowradix:requests_total":
                out["requests"] += value
            elif name == "shadowradix:preemptions_total":
                out["preemptions"] += value
            elif name == "shadowradix:storage_errors_total":
                out["storage_errors"] += value
            elif name == "shadowradix:cached_tokens_total":
                out["cached_tokens"][labels["tier"]] += value
            elif name == "shadowradix:load_back_bytes_total" and labels["source"] == "storage":
                out["storage_loaded_bytes"] += value
            elif name == "shadowradix:backup_bytes_total" and labels["target"] == "storage":
                out["storage_backup_bytes"] += value
    return out


# -------------------------------------------------------------------------------- client
class Failed(Exception):
    """A response the benchmark cannot count as served."""


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; perf_counter() seconds."""

    sent: float
    ended: float = 0.0
    first: float | None = None  # the first chunk with a choice
    texts: list[float] = field(default_factory=list)  # chunks that carry text
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None

    def take(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            raise Failed(f"error in the stream: {chunk['error']}")
        if chunk.get("choices"):
            if self.first is None:
                self.first = now
            if chunk["choices"][0].get("text"):
                self.texts.append(now)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def check(self, req: Request) -> None:
        if not self.done or self.usage is None or self.first is None:
            raise Failed("the stream ended without a choice, usage and [DONE]")
        got = (self.usage["prompt_tokens"], self.usage["completion_tokens"])
        if got != (len(req.prompt), req.max_tokens):
            raise Failed(f"usage {got}, expected {(len(req.prompt), req.max_tokens)}")

    def tokens(self, key: str) -> int:
        assert self.usage is not None
        return int(self.usage[key])

    def cached(self, tier: str) -> int:
        assert self.usage is not None
        return int(self.usage["prompt_tokens_details"]["cached_tokens_by_tier"][tier])


async def sse_events(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     out: Outcome) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to `path` and yield each `data: {json}` event of the stream; `out.done`
    is set at `data: [DONE]`. Raises Failed on a status other than 200 or a malformed line."""
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise Failed(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                raise Failed(f"not an SSE data line: {line[:80]!r}")
            if line == "data: [DONE]":
                out.done = True
                return
            yield json.loads(line[len("data: "):])


async def send(client: httpx.AsyncClient, req: Request) -> Outcome:
    body = {"model": MODEL, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = Outcome(sent=time.perf_counter())
    try:
        async for event in sse_events(client, "/v1/completions", body, out):
            out.take(event, time.perf_counter())
        out.check(req)
    except (Failed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.ended = time.perf_counter()
    return out


Send = Callable[[httpx.AsyncClient, Request], Awaitable[Outcome]]


async def replay(url: str, requests: list[Request],
                 send: Send = send) -> tuple[list[Outcome], float, float]:
    """Send every request at its time (with `send`); (outcomes, seconds from the start to
    the last answer, the latest any request left after its scheduled time)."""
    n = len(requests)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(600, connect=30)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def at_its_time(req: Request) -> Outcome:
            await asyncio.sleep(max(0.0, start + req.send_at - time.perf_counter()))
            return await send(client, req)

        outcomes = await asyncio.gather(*(at_its_time(r) for r in requests))
    lag = max(o.sent - start - r.send_at for o, r in zip(outcomes, requests, strict=True))
    return outcomes, max(o.ended for o in outcomes) - start, lag


# ------------------------------------------------------------------------------- figures
def percentiles_ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(xs, [50, 99]).tolist()
    return {"p50": 1e3 * p50, "p99": 1e3 * p99, "mean": 1e3 * float(np.mean(xs))}


def most_in_flight(outcomes: list[Outcome]) -> int:
    events = sorted([(o.sent, 1) for o in outcomes] + [(o.ended, -1) for o in outcomes])
    return int(max(np.cumsum([d for _, d in events]), default=0))


def summarize(outcomes: list[Outcome], wall: float, lag: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    errors = collections.Counter(o.error for o in outcomes if o.error is not None)
    prompt = sum(o.tokens("prompt_tokens") for o in ok)
    output = sum(o.tokens("completion_tokens") for o in ok)
    cached = {t: sum(o.cached(t) for o in ok) for t in TIERS}
    return {
        "requests": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok),
        "errors": errors.most_common(5),
        "ttft_ms": percentiles_ms([o.first - o.sent for o in ok if o.first is not None]),
        "itl_ms": percentiles_ms([b - a for o in ok for a, b in pairwise(o.texts)]),
        "e2e_ms": percentiles_ms([o.ended - o.sent for o in ok]),
        "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": cached,
        "hit_rate": sum(cached.values()) / max(prompt, 1),
        "hit_rate_by_tier": {t: n / max(prompt, 1) for t, n in cached.items()},
        "wall_s": wall, "output_tokens_per_s": output / wall, "requests_per_s": len(ok) / wall,
        "most_in_flight": most_in_flight(outcomes), "max_send_lag_ms": 1e3 * lag,
    }


def run_phase(server_argv: list[str], requests: list[Request]) -> dict[str, Any]:
    """A fresh server, warmed up; the replay; its /metrics; SIGTERM."""
    with ServerProcess("--model", MODEL, *server_argv, timeout=180) as server:
        warm_up(server.url)
        load = os.getloadavg()[0]
        outcomes, wall, lag = asyncio.run(replay(server.url, requests))
        metrics = scrape(server.url)
    # The 1-minute load average before and after: other work on a shared machine shows here.
    return {**summarize(outcomes, wall, lag), "metrics": metrics,
            "load_average": [load, os.getloadavg()[0]],
            "server": {"argv": server.argv, "exit_code": server.exit_code,
                       "log_tail": server.log[-40:] if server.exit_code != 0 else []}}


# -------------------------------------------------------------------------------- report
def ms(*xs: float | None) -> str:
    return " / ".join("-" if x is None else f"{x:,.0f}" for x in xs)


def report(console: Console, res: dict[str, Any]) -> None:
    s = res["settings"]
    table = Table(title=f"shadowradix serve: {s['requests']} conversation-trace requests, "
                        f"open loop at {s['speedup']:g}x, block {s['block_tokens']} tokens")
    for name in ("", "requests\nok / failed", "TTFT ms\np50 / p99", "ITL ms\np50 / p99",
                 "e2e ms\np50", "output\ntok/s", "req/s", "hit\nrate",
                 "hit % by tier\ndevice / host / storage", "pre-\nempted"):
        table.add_column(name, justify="right" if name else "left")
    for name, p in res["phases"].items():
        split = " / ".join(f"{100 * p['hit_rate_by_tier'][t]:.1f}" for t in TIERS)
        table.add_row(name, f"{p['ok']} / {p['failed']}",
                      ms(p["ttft_ms"]["p50"], p["ttft_ms"]["p99"]),
                      ms(p["itl_ms"]["p50"], p["itl_ms"]["p99"]), ms(p["e2e_ms"]["p50"]),
                      f"{p['output_tokens_per_s']:.1f}", f"{p['requests_per_s']:.2f}",
                      f"{p['hit_rate']:.1%}", split, str(p["metrics"]["preemptions"]))
    console.print(table)
    for name, p in res["phases"].items():
        console.print(f"{name}: {p['prompt_tokens']:,} prompt and {p['output_tokens']:,} output "
                      f"tokens in {p['wall_s']:.1f} s; at most {p['most_in_flight']} in flight; "
                      f"sends up to {p['max_send_lag_ms']:.0f} ms late; load "
                      f"{p['load_average'][0]:.2f} -> {p['load_average'][1]:.2f}")
        for error, n in p["errors"]:
            console.print(f"[red]{name}: {n} failed: {error}[/red]")
        if p["server"]["exit_code"] != 0:
            console.print(f"[red]{name}: the server exited {p['server']['exit_code']} "
                          f"after SIGTERM; its last lines:[/red]")
            console.out("".join(p["server"]["log_tail"]), end="")
        usage, metric = p["cached_tokens"], p["metrics"]["cached_tokens"]
        if usage != metric:
            console.print(f"[yellow]warning: {name}: cached tokens by tier in the usage chunks "
                          f"{usage} != /metrics {metric} "
                          f"({p['metrics']['preemptions']} preemptions)[/yellow]")
    ratio = res["ttft_p50_ratio"]
    verdict = "[green]meets[/green]" if res["meets_target"] else "[red]MISSES[/red]"
    console.print(f"TTFT p50 cache on / off: {'-' if ratio is None else f'{ratio:.2f}'} "
                  f"{verdict} the target (<= {TARGET})")


def add_workload_arguments(ap: argparse.ArgumentParser, requests: int) -> None:
    """The replay's flags (what `workload` takes), shared with fleet.py."""
    ap.add_argument("--requests", type=int, default=requests, help="trace requests to replay")
    ap.add_argument("--block-tokens", type=int, default=16,
                    help="tokens each 512-token trace block becomes")
    ap.add_argument("--speedup", type=float, default=50.0,
                    help="the trace's clock runs this much faster")
    ap.add_argument("--max-tokens", type=int, default=8, help="cap on each request's output")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_arguments(ap, requests=96)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=4096)
    ap.add_argument("--host-tokens", type=int, default=16384)
    ap.add_argument("--step-tokens", type=int, default=None, help="(server default: 512)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    requests = workload(args.requests, args.block_tokens, args.max_tokens, args.speedup)
    server_argv = [f"--{flag.replace('_', '-')}={getattr(args, flag)}"
                   for flag in ("page_size", "device_tokens", "host_tokens", "step_tokens")
                   if getattr(args, flag) is not None]
    console = Console(width=None if sys.stdout.isatty() else 120)  # a log keeps the table whole
    console.print(f"{len(requests)} requests ({sum(len(r.prompt) for r in requests):,} prompt "
                  f"tokens) over {requests[-1].send_at:.1f} s per phase")
    console.print(f"server: --model {MODEL} {' '.join(server_argv)}")
    phases = {}
    for name, extra in PHASES.items():
        t0 = time.perf_counter()
        with console.status(f"{name} ..."):
            phases[name] = run_phase(server_argv + extra, requests)
        console.print(f"{name}: done in {time.perf_counter() - t0:.0f} s (server start included)")
    on, off = phases[ON]["ttft_ms"]["p50"], phases[OFF]["ttft_ms"]["p50"]
    ratio = on / off if on is not None and off else None
    result = {"settings": {**{k: v for k, v in vars(args).items() if k != "json"},
                           "server_argv": server_argv},
              "phases": phases, "target": TARGET, "ttft_p50_ratio": ratio,
              "meets_target": ratio is not None and ratio <= TARGET}
    report(console, result)
    write_json(args.json, result)
    clean = all(p["failed"] == 0 and p["server"]["exit_code"] == 0 for p in phases.values())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
