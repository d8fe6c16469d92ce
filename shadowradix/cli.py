"""Command line: `shadowradix demo`, `shadowradix simulate TRACE ...`, `shadowradix serve`,
`shadowradix fleet`, `shadowradix trace synth|from-chats`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from shadowradix.flags import (
    checked,
    float_range,
    int_range,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    share,
)
from shadowradix.layout import LAYOUT_NAMES, named_layout
from shadowradix.sim.simulate import (
    POLICY_NAMES,
    PolicyChoice,
    bound_hit_rate,
    policy_choice,
    simulate,
)
from shadowradix.sim.trace import TraceError, load_trace
from shadowradix.tiers.host_tier import WRITE_POLICIES

T = TypeVar("T")

SIMULATE_HELP = """\
Replay a Mooncake-format trace through the real ShadowRadix tree (metadata-only
pools) under several policies at equal device bytes.

Bytes per token and pool (page 256; a CHECKPOINT pool is amortised per page):
  DeepSeek-V4-Flash bf16: swa 44032, c4 5376, c4_index 1344, c128 160, state 840
  DeepSeek-V4-Flash fp8:  swa 25112, c4 3066, c4_index 693, c128 91.2, state 1680
  DeepSeek-V4-Pro   bf16: swa 62464, c4 7680, c4_index 1920, c128 248, state 1200
  DeepSeek-V4-Pro   fp8:  swa 35624, c4 4380, c4_index 990, c128 141.4, state 2400
(fp8 is SGLang's record: 584 B per KV entry, 132 B per indexer key, float32 state.)

--hisparse-buffer N adds a table: device bytes of one decoding request at each --context
with HiSparse off and on (N C4 entries per CSA layer on the device, the C4 history in
host memory), and how many such requests fit per device GB.
"""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shadowradix", description="KV cache for hybrid-attention "
                                 "LLMs: ShadowRadix, HiCache, HiSparse.")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve the bundled conversation trace through the engine "
                          "on a tiny DeepSeek-V4 and check it against transformers")
    demo.add_argument("--requests", type=positive_int, default=64,
                      help="requests: the first 4 turns of N/4 conversations of the trace")
    demo.add_argument("--block-tokens", type=positive_int, default=16,
                      help="tokens per 512-token trace block (scales the trace to the CPU)")
    sim = sub.add_parser("simulate", help="capacity planning on a trace",
                         description=SIMULATE_HELP, formatter_class=argparse.RawTextHelpFormatter)
    sim.add_argument("trace", help="Mooncake-format JSONL (.jsonl or .jsonl.gz)")
    sim.add_argument("--model", default="deepseek-v4-flash",
                     help=f"{' | '.join(LAYOUT_NAMES)} | CONFIG.json")
    sim.add_argument("--kv-dtype", default="bfloat16", help="bfloat16 | float32 | fp8")
    sim.add_argument("--device-gb", type=positive_float, default=40.0)
    sim.add_argument("--host-gb", type=non_negative_float, default=0.0,
                     help="host tier (HiCache L2) size; 0: the device alone")
    sim.add_argument("--write-policy", default="write_through", choices=WRITE_POLICIES,
                     help="what the host tier copies (with --host-gb)")
    sim.add_argument("--storage-gb", type=float_range(0.0, infinite=True), default=0.0,
                     help="L3 store size (inf: unbounded); 0: none")
    sim.add_argument("--page-size", type=positive_int, default=256)
    sim.add_argument("--checkpoint-every", type=positive_int, default=8, metavar="K",
                     help="pages between checkpoints for the periodic policy")
    sim.add_argument("--window-ratio", type=share, default=0.1,
                     help="share of pages the window pool gets, in (0, 1] (SGLang: 0.1)")
    sim.add_argument("--arena", action="store_true",
                     help="the default policy's pools share the engine's device arena "
                     "(frames: fragmentation counts, a host tier too) instead of a byte "
                     "count (the ideal)")
    sim.add_argument("--chunk-pages", type=positive_int, default=32,
                     help="prefill chunk, in pages")
    sim.add_argument("--policy", default=",".join(POLICY_NAMES),
                     help=f"comma-separated, from {', '.join(POLICY_NAMES)}")
    sim.add_argument("--sweep", default=None, metavar="device-gb=10,20,40,80",
                     help="run every policy at each device size")
    sim.add_argument("--unbounded", action="store_true", help="infinite device memory")
    sim.add_argument("--limit", type=positive_int, default=None, help="first N requests only")
    sim.add_argument("--hisparse-buffer", type=positive_int, default=None, metavar="N",
                     help="also size decoding requests with HiSparse: N C4 entries per request "
                     "and CSA layer on the device (>= index_topk + 1)")
    sim.add_argument("--context", default="16384", metavar="T[,T...]",
                     help="tokens per decoding request for --hisparse-buffer (default 16384)")
    sim.add_argument("--index-topk", type=positive_int, default=None, metavar="K",
                     help="the indexer's top-k for --hisparse-buffer (default: the model's: "
                     "V4-Flash 512, V4-Pro 1024, or config.json's)")
    sim.add_argument("--json", type=Path, default=None)
    sim.add_argument("--plot", type=Path, default=None, help="PNG of hit rate vs device GB")
    _add_trace_commands(sub)
    srv = sub.add_parser("serve", help="an OpenAI-compatible server (also SGLang's /generate) "
                         "with Prometheus metrics")
    from shadowradix.server.serve import add_arguments

    add_arguments(srv)
    fleet = sub.add_parser("fleet", help="N servers on this machine behind SGLang's router "
                           "(cache-aware), sharing L3 through --storage",
                           description="Start --instances servers (every serve flag below "
                           "goes to each; they take free ports) and sglang-router in front of "
                           "them on --host:--port; SIGTERM or Ctrl-C stops them all.")
    from shadowradix.server.fleet import add_arguments as add_fleet_arguments

    add_fleet_arguments(fleet)
    args = ap.parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "serve":
            from shadowradix.server.serve import serve

            return serve(args)
        if args.command == "fleet":
            from shadowradix.server.fleet import run_fleet

            return run_fleet(args)
        if args.command == "trace":
            return _synth(args) if args.trace_command == "synth" else _from_chats(args)
        return _simulate(args)
    except (ValueError, OSError) as e:  # TraceError is a ValueError; OSError: port in use
        print(f"shadowradix: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # a valid trace or sizes too large for this machine
        print(f"shadowradix {args.command}: error: out of memory ({e or 'MemoryError'}); "
              f"use a smaller trace, fewer tokens or smaller sizes", file=sys.stderr)
        return 1


TRACE_HELP = """\
Write Mooncake-format traces with sequence chains: besides hash_ids (the prompt's blocks)
each line has sequence_hash_ids (the blocks of prompt + output), so a replay inserts what
the request really ended with and a chat's next turn matches all of it.
"""


def _add_trace_commands(sub: Any) -> None:
    from shadowradix.sim.synth import PROMPT_TOKENS, REPLY_TOKENS, SYSTEM_TOKENS, Lengths

    trace = sub.add_parser("trace", help="make traces: synthetic chats, or your own chat logs",
                           description=TRACE_HELP, formatter_class=argparse.RawTextHelpFormatter)
    cmds = trace.add_subparsers(dest="trace_command", required=True)
    syn = cmds.add_parser("synth", help="multi-turn chat traffic (Poisson arrivals, shared "
                          "system prompts, lognormal lengths)")
    syn.add_argument("--conversations", type=positive_int, default=100)
    syn.add_argument("--turns-min", type=positive_int, default=1)
    syn.add_argument("--turns-max", type=positive_int, default=6)
    syn.add_argument("--system-prompts", type=positive_int, default=4, metavar="K",
                     help="shared system prompts, each conversation picks one")
    for name, dist, what in (("system", SYSTEM_TOKENS, "a system prompt"),
                             ("prompt", PROMPT_TOKENS, "each new user message"),
                             ("reply", REPLY_TOKENS, "each reply")):
        syn.add_argument(f"--{name}-tokens", default=f"{dist.median:g},{dist.sigma:g}",
                         type=checked(partial(Lengths.parse, sigma=dist.sigma)),
                         metavar="MEDIAN[,SIGMA]",
                         help=f"lognormal length of {what}: a finite median >= 1 (at most "
                         "--max-context) and sigma >= 0 (default %(default)s)")
    syn.add_argument("--rate", type=positive_float, default=1.0, help="conversations per second")
    syn.add_argument("--think-time", type=non_negative_float, default=60.0,
                     help="mean seconds between a conversation's turns (exponential)")
    syn.add_argument("--max-context", type=int_range(2, 1 << 30), default=131072,
                     help="a conversation ends before a sequence would pass this")
    syn.add_argument("--block-size", type=positive_int, default=512, help="tokens per hash block")
    syn.add_argument("--seed", type=non_negative_int, default=0)
    syn.add_argument("--prompt-only", action="store_true",
                     help="leave out sequence_hash_ids (what Mooncake's traces record)")
    syn.add_argument("-o", "--output", type=Path, required=True, help="OUT.jsonl[.gz]")
    chats = cmds.add_parser("from-chats", help="a trace from chat logs, through a tokenizer "
                            "and its chat template")
    chats.add_argument("chats", type=Path, help='JSONL: one conversation a line, '
                       '{"messages": [...], "timestamp": ms} or a list of messages')
    chats.add_argument("--tokenizer", required=True, metavar="DIR",
                       help="a model directory with a tokenizer and a chat template")
    chats.add_argument("--block-size", type=positive_int, default=512,
                       help="tokens per hash block")
    chats.add_argument("--gap-ms", type=non_negative_int, default=1000,
                       help="between conversations without a timestamp, and between turns")
    chats.add_argument("-o", "--output", type=Path, required=True, help="OUT.jsonl[.gz]")


def _synth(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from shadowradix.sim import synth
    from shadowradix.sim.trace import write_trace

    try:
        shape = synth.ChatShape(
            conversations=args.conversations, turns_min=args.turns_min,
            turns_max=args.turns_max, system_prompts=args.system_prompts,
            system_tokens=args.system_tokens, prompt_tokens=args.prompt_tokens,
            reply_tokens=args.reply_tokens, rate=args.rate, think_time=args.think_time,
            max_context=args.max_context, block_size=args.block_size, seed=args.seed)
        unfit = shape.unfit()
        if unfit is not None:
            raise unfit
        requests = synth.synth_trace(shape)
    except synth.ShapeError as e:
        raise ValueError(f"--{e.field.replace('_', '-')}: {e.reason}") from None
    if not requests:
        raise ValueError(f"no conversation fits --max-context {args.max_context}: every "
                         "first turn is longer; shorten the lengths or raise --max-context")
    if args.prompt_only:
        requests = [replace(r, sequence_hash_ids=None) for r in requests]
    n = write_trace(args.output, requests)
    print(f"wrote {n:,} requests of {args.conversations:,} conversations to {args.output}")
    return 0


def _from_chats(args: argparse.Namespace) -> int:
    from shadowradix.sim.chats import from_chats
    from shadowradix.sim.trace import write_trace

    requests, summary = from_chats(args.chats, args.tokenizer, args.block_size, args.gap_ms)
    n = write_trace(args.output, requests)
    print(f"wrote {n:,} requests of {summary.conversations:,} conversations to {args.output}")
    if summary.unchained:
        print(f"{summary.unchained:,} requests without sequence_hash_ids: the chat template "
              "renders their prompt differently from the start of their sequence")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from shadowradix.demo import run_demo

    return run_demo(args.requests, args.block_tokens)


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # logs and CI: keep the table on one line per row
    layout = named_layout(args.model, args.page_size, args.kv_dtype)
    requests = load_trace(args.trace, args.limit)
    if not requests:
        raise TraceError(f"{args.trace}: no requests")
    choices = _policies(args)
    sizes: list[float | None] = [None] if args.unbounded else [args.device_gb]
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        if key != "device-gb" or not values:
            raise ValueError(f"--sweep takes device-gb=G1,G2,...; got {args.sweep!r}")
        sizes = [_flag_value("--sweep", v, positive_float) for v in values.split(",")]
    hisparse = _hisparse(args, layout)  # checked before the replays: a bad flag fails fast
    bound = bound_hit_rate(requests, layout.page_size)
    runs: list[dict[str, Any]] = []
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as progress:
        for size in sizes:
            for choice in choices:
                label = f"{choice.name} @ {'unbounded' if size is None else f'{size:g} GB'}"
                task = progress.add_task(label, total=len(requests))

                def tick(i: int, task: Any = task) -> None:
                    if i % 200 == 199:
                        progress.update(task, completed=i + 1)

                runs.append(simulate(requests, layout, choice, size, chunk_pages=args.chunk_pages,
                                     on_request=tick, bound=bound, host_gb=args.host_gb,
                                     write_policy=args.write_policy,
                                     storage_gb=args.storage_gb, arena=args.arena))
                progress.remove_task(task)
    _print_runs(console, runs, layout.name, len(requests), bound)
    if hisparse is not None:
        _print_hisparse(console, hisparse, layout.name)
        for r in runs:
            r["hisparse"] = hisparse
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs if len(runs) > 1 else runs[0], indent=2))
    if args.plot:
        from shadowradix.sim.plot import plot_sweep

        plot_sweep(runs, args.plot, title=f"{layout.name} on {Path(str(args.trace)).name}")
    return 0


def _policies(args: argparse.Namespace) -> list[PolicyChoice]:
    """The --policy list as PolicyChoices; ValueError naming the flag for an unknown name
    or an empty list (",")."""
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--policy names no policy ({args.policy!r}); use one or more of "
                         f"{', '.join(POLICY_NAMES)}, comma-separated")
    try:
        return [policy_choice(n, args.checkpoint_every, args.window_ratio) for n in names]
    except ValueError as e:
        raise ValueError(f"--policy: {e}") from None


def _flag_value(flag: str, text: str, parse: Callable[[str], T]) -> T:
    """One entry of a comma-separated flag, through the same type its scalar flags use;
    ValueError naming the flag (argparse only checks the list's flag as a whole)."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{flag}: {e}") from None


def _print_runs(console: Any, runs: list[dict[str, Any]], layout: str, n: int,
                bound: float) -> None:
    from rich.table import Table

    table = Table(title=f"{layout}: {n:,} requests, infinite-cache bound {bound:.1%}")
    host = any(r["host_gb"] for r in runs)
    storage = any(r["storage_gb"] for r in runs)
    cols = ["policy", "GB", "cache tok", "window tok", "hit rate", "of bound", "prefilled tok"]
    cols += ["from host", "host->device GB", "device->host GB"] if host else []
    cols += ["from storage", "storage read GB"] if storage else []
    for col in [*cols, "s"]:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        pages = r["pool_pages"]
        window = pages.get("swa", max(pages.values()))
        row = [r["policy"], "inf" if r["device_gb"] is None else f"{r['device_gb']:g}",
               _short(max(pages.values()) * r["page_size"]), _short(window * r["page_size"]),
               f"{r['hit_rate']:.2%}", f"{r['share_of_bound']:.0%}",
               _short(r["computed_tokens"])]
        moved, prompt = r["bytes_moved"], max(r["prompt_tokens"], 1)
        if host:
            row += [f"{r['cached_by_tier']['host'] / prompt:.2%}",
                    f"{moved['host->device'] / 2**30:.1f}", f"{moved['device->host'] / 2**30:.1f}"]
        if storage:
            read = moved["storage->host"] + moved["storage->device"]
            row += [f"{r['cached_by_tier']['storage'] / prompt:.2%}", f"{read / 2**30:.1f}"]
        table.add_row(*row, f"{r['seconds']:.1f}")
    console.print(table)


def _hisparse(args: argparse.Namespace, layout: Any) -> dict[str, Any] | None:
    if args.hisparse_buffer is None:
        return None
    from shadowradix.sim.hisparse import hisparse_rows, index_topk_of, parse_contexts

    topk = args.index_topk if args.index_topk is not None else index_topk_of(args.model)
    contexts = parse_contexts(args.context)
    return {"buffer": args.hisparse_buffer, "index_topk": topk, "page_size": layout.page_size,
            "rows": hisparse_rows(layout, contexts, args.hisparse_buffer, topk)}


def _print_hisparse(console: Any, hisparse: dict[str, Any], layout: str) -> None:
    from rich.table import Table

    table = Table(title=f"{layout}: one decoding request, HiSparse buffer "
                  f"{hisparse['buffer']:,} (top-k {hisparse['index_topk']:,}); MB = 2^20 B")
    for col in ("context", "device MB off", "device MB on", "host MB on", "req/GB off",
                "req/GB on", "ratio"):
        table.add_column(col, justify="right")
    for r in hisparse["rows"]:
        table.add_row(f"{r['context']:,}", f"{r['device_bytes_off'] / 2**20:,.1f}",
                      f"{r['device_bytes_on'] / 2**20:,.1f}", f"{r['host_bytes_on'] / 2**20:,.1f}",
                      f"{r['requests_per_gb_off']:,}", f"{r['requests_per_gb_on']:,}",
                      f"{r['ratio']:.2f}x")
    console.print(table)


def _short(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
