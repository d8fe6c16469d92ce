"""`shadowradix serve`: the engine behind an OpenAI-compatible HTTP server (uvicorn).

The socket is bound first and the model loads on the engine thread, so `/health` answers
503 until it is ready. SIGTERM (or Ctrl-C) stops accepting connections, lets the requests
in flight finish (up to --drain-timeout seconds, then aborts them), finishes the host
copies and storage writes, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line parses its arguments without importing torch
    from shadowradix.engine.config import SpecConfig
    from shadowradix.server.runtime import Limits, Runtime

from shadowradix.flags import (
    byte_size,
    checked,
    int_range,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from shadowradix.tiers.host_tier import WRITE_POLICIES
from shadowradix.tree.policy import named_policy

log = logging.getLogger("shadowradix.server")
DTYPES = ("float32", "bfloat16")


def _policy_name(name: str) -> str:
    """--policy's value, checked while parsing (ValueError naming the choices)."""
    named_policy(name)
    return name


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The serve flags. Every numeric one is range-checked as it is parsed (exit 2, one
    line naming the flag), before any model loads."""
    ap.add_argument("--model", required=True, help="tiny (the demo's random DeepSeek-V4, "
                    "nothing downloaded) or a Hugging Face checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port, default=30000, help="0: any free port (printed)")
    ap.add_argument("--page-size", type=positive_int, default=None,
                    help="tokens per page (default: 16 for tiny, 256 otherwise)")
    ap.add_argument("--device-tokens", type=positive_int, default=None,
                    help="L1 capacity in tokens: the bytes that many tokens take in every "
                    "pool, as one arena (default: 2048 pages)")
    ap.add_argument("--device-bytes", type=byte_size, default=None, metavar="SIZE",
                    help="L1 as one byte budget that every pool draws pages from (40GiB, "
                    "512MiB, ...): the window pool grows and shrinks with the workload; "
                    "instead of --window-tokens / --state-tokens")
    ap.add_argument("--window-tokens", type=positive_int, default=None,
                    help="sliding-window pool of its own, in tokens: every pool then a fixed "
                    "tensor (default: none, the arena)")
    ap.add_argument("--state-tokens", type=positive_int, default=None,
                    help="compressor-state pool of its own, in tokens: every pool then a "
                    "fixed tensor (default: none, the arena)")
    ap.add_argument("--host-tokens", type=non_negative_int, default=0,
                    help="L2 capacity; 0: no host tier")
    ap.add_argument("--write-policy", default="write_through", choices=WRITE_POLICIES,
                    help="what the host tier copies (with --host-tokens)")
    ap.add_argument("--storage", default=None, help="L3: file:///DIR, redis://HOST:PORT/DB "
                    "or redis-cluster://HOST:PORT[,HOST:PORT...]")
    ap.add_argument("--storage-secret-file", default=None, metavar="PATH",
                    help="a file holding the store's shared secret (>= 16 bytes): objects "
                    "are then authenticated, and forged ones are misses (default: the "
                    f"{SECRET_ENV} environment variable, else none: trust the store)")
    ap.add_argument("--hisparse-buffer", type=positive_int, default=None, metavar="N",
                    help="HiSparse: N C4 entries per request and CSA layer stay on the device "
                    "(>= index_topk + 1); the C4 history lives in host memory")
    ap.add_argument("--hisparse-requests", type=positive_int, default=None, metavar="R",
                    help="HiSparse: sets of hot buffers on the device, the most requests "
                    "running at once (default: what the device C4 pool's bytes would hold)")
    ap.add_argument("--policy", default="shadowradix", type=checked(_policy_name),
                    help="resume points the cache keeps: shadowradix (the default), end-only, "
                    "periodic-K, eager-swa, no-shadows")
    ap.add_argument("--disable-prefix-cache", action="store_true",
                    help="every request computes its whole prompt (a baseline to compare with)")
    ap.add_argument("--api-key", default=None, type=checked(_api_key),
                    help="require Authorization: Bearer KEY (/health and /metrics stay open)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model id clients send (default: tiny or the directory name)")
    ap.add_argument("--max-queue", type=positive_int, default=None,
                    help="most requests waiting for admission; more get 503 (default: no cap)")
    ap.add_argument("--step-tokens", type=positive_int, default=512,
                    help="tokens one engine step feeds")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype")
    ap.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                    help="seconds a shutdown waits for requests in flight before aborting")
    add_limit_arguments(ap)
    add_spec_arguments(ap)
    ap.add_argument("--allow-special-tokens-in-content", action="store_true",
                    help="special-token text inside chat messages is encoded as those special "
                    "tokens (by default it is plain text, so a client cannot forge a turn)")


SECRET_ENV = "SHADOWRADIX_STORAGE_SECRET"
SPEC_ALGORITHMS = ("ngram", "mtp")
SPEC_ALIASES = {"nextn": "mtp"}  # SGLang's name for a checkpoint's own MTP layers
NGRAM_WINDOW = ("--speculative-ngram-min-match-window-size",
                "--speculative-ngram-max-match-window-size")


def _spec_algorithm(name: str) -> str:
    """--speculative-algorithm's value, in any case (SGLang writes NGRAM)."""
    value = SPEC_ALIASES.get(name.strip().lower(), name.strip().lower())
    if value not in SPEC_ALGORITHMS:
        raise ValueError(f"must be ngram or mtp (or SGLang's NEXTN, the same as mtp), "
                         f"got {name!r}")
    return value


def add_spec_arguments(ap: argparse.ArgumentParser) -> None:
    """Speculative decoding, under SGLang's flag names. Off unless --speculative-algorithm
    is given; the others without it are refused (spec_config), never ignored."""
    ap.add_argument("--speculative-algorithm", type=checked(_spec_algorithm), default=None,
                    metavar="ngram|mtp", help="speculative decoding (default: off): ngram "
                    "(prompt lookup: drafts from the request's own earlier tokens) or mtp "
                    "(the checkpoint's MTP block; SGLang's NEXTN); any case")
    ap.add_argument("--speculative-num-draft-tokens", type=int_range(1, 64), default=None,
                    metavar="K", help="draft tokens one step verifies per request, in [1, 64] "
                    "(default: 3); a step then releases up to K + 1 tokens")
    ap.add_argument(NGRAM_WINDOW[0], type=positive_int, default=None, metavar="N",
                    help="ngram: the shortest suffix of a request's tokens looked up (default 1)")
    ap.add_argument(NGRAM_WINDOW[1], type=positive_int, default=None, metavar="N",
                    help="ngram: the longest suffix looked up, tried first (default 3)")


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    """The engine's SpecConfig from the speculative flags (None: off). ValueError naming
    the flags for a combination the parser cannot see: a speculative flag without
    --speculative-algorithm, an ngram window with mtp, a window whose min exceeds its max,
    mtp on a model without an MTP block (`_check_mtp_model`: no weights are loaded)."""
    from shadowradix.engine.config import SpecConfig

    algorithm = getattr(args, "speculative_algorithm", None)
    k = getattr(args, "speculative_num_draft_tokens", None)
    lo = getattr(args, "speculative_ngram_min_match_window_size", None)
    hi = getattr(args, "speculative_ngram_max_match_window_size", None)
    given = [flag for flag, value in (("--speculative-num-draft-tokens", k),
                                      (NGRAM_WINDOW[0], lo), (NGRAM_WINDOW[1], hi))
             if value is not None]
    if algorithm is None:
        if given:
            raise ValueError(f"{given[0]} needs --speculative-algorithm (ngram or mtp); "
                             f"without it speculative decoding is off")
        return None
    window = [flag for flag in given if flag in NGRAM_WINDOW]
    if algorithm != "ngram" and window:
        raise ValueError(f"{window[0]} is for --speculative-algorithm ngram, not {algorithm}")
    defaults = SpecConfig()
    lo = defaults.ngram_min if lo is None else lo
    hi, default_hi = (defaults.ngram_max, ", its default") if hi is None else (hi, "")
    if lo > hi:
        raise ValueError(f"{NGRAM_WINDOW[0]} ({lo}) must be <= {NGRAM_WINDOW[1]} "
                         f"({hi}{default_hi})")
    if algorithm == "mtp":
        _check_mtp_model(getattr(args, "model", None))
    return SpecConfig(method=algorithm,
                      num_draft_tokens=defaults.num_draft_tokens if k is None else k,
                      ngram_min=lo, ngram_max=hi)


def _check_mtp_model(model: str | None) -> None:
    """ValueError when --model `model` has no MTP block for --speculative-algorithm mtp:
    the demo's random `tiny` model, or a checkpoint directory whose index / safetensors
    header names no `mtp.0.*` tensor (`has_mtp`: reads no tensor). Anything else (no
    --model, not a directory) is left to the model's own checks."""
    if model is None:
        return
    if model == "tiny":
        raise ValueError("--speculative-algorithm mtp needs a checkpoint with an MTP block "
                         "(mtp.0.* tensors); --model tiny has none (use ngram)")
    if not Path(model).is_dir():
        return
    from shadowradix.model.mtp import has_mtp

    if not has_mtp(model):
        raise ValueError(f"--speculative-algorithm mtp: --model {model} has no MTP block (no "
                         f"mtp.0.* tensors in its safetensors index or model.safetensors); "
                         f"use ngram")


def storage_secret(args: argparse.Namespace) -> bytes | None:
    """The storage secret: the file --storage-secret-file names, else
    $SHADOWRADIX_STORAGE_SECRET (ignored without --storage), else None. Never taken from
    the command line itself (other users can read it). ValueError naming the source for
    a file that cannot be read, a secret too short, the variable set but empty (never a
    silent start without the secret), or the file flag without --storage."""
    from shadowradix.tiers.storage.codec import check_secret

    path = getattr(args, "storage_secret_file", None)
    if path is not None:
        source = f"--storage-secret-file {path!r}"
        try:
            raw = _read_secret_file(path, 4097)
        except OSError as e:
            raise ValueError(f"{source}: cannot read it ({e.strerror})") from None
        if len(raw) > 4096:
            raise ValueError(f"{source}: longer than 4096 bytes; is it the right file?")
        value: bytes | str = raw.strip()
        if args.storage is None:
            raise ValueError(f"{source}: a storage secret needs --storage")
    elif SECRET_ENV in os.environ and args.storage is not None:
        source, value = f"${SECRET_ENV}", os.environ[SECRET_ENV]
        if not value.strip():  # fail closed: never run unauthenticated by a typo
            raise ValueError(f"{source} is set but empty (an unset variable?); set it to the "
                             f"secret, or unset it to run without one (trusting the store)")
    else:
        return None
    try:
        return check_secret(value)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _read_secret_file(path: str, limit: int) -> bytes:
    """At most `limit` bytes of `path`. Opened without waiting, so a FIFO no writer holds
    reads as empty (refused as too short) instead of blocking start-up forever; a pipe
    with a writer (`--storage-secret-file <(...)`) is read to its end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        os.set_blocking(fd, True)  # a FIFO without a writer now reads as end of file
        return f.read(limit)


def _api_key(key: str) -> str:
    """--api-key's value: an empty one (an unset "$KEY") would silently serve everyone."""
    if not key.strip():
        raise ValueError("must not be empty (an unset variable?); leave --api-key out to "
                         "serve without a key")
    if key != key.strip():
        raise ValueError("must not start or end with whitespace (no header can carry it)")
    return key


def add_limit_arguments(ap: argparse.ArgumentParser) -> None:
    """What one client may ask of the server. Left out, a flag keeps runtime.Limits'
    default (the one its help names)."""
    ap.add_argument("--max-choices", type=positive_int, metavar="N",
                    help="most choices (prompts x n) one request may ask for; more get 400 "
                    "before anything is built (default: 1024)")
    ap.add_argument("--max-body-bytes", type=positive_int, metavar="B",
                    help="largest request body; more get 413, refused as it is read (default: "
                    "16 bytes per token a request can hold, at least 1 MiB)")
    ap.add_argument("--read-timeout", type=positive_float, metavar="S",
                    help="seconds a connection has to send a whole request head (from opening "
                    "or its last response; then it is closed) and the longest a body may "
                    "stall (then 408) (default: 10)")
    ap.add_argument("--keep-alive-timeout", type=positive_float, metavar="S",
                    help="seconds an idle connection is kept between requests (default: 5)")
    ap.add_argument("--max-connections", type=positive_int, metavar="N",
                    help="connections open at once; more are answered 503 and closed "
                    "(default: 1000)")


LIMIT_FLAGS = ("max_choices", "max_body_bytes", "read_timeout", "keep_alive_timeout",
               "max_connections")


def limits_from_args(args: argparse.Namespace) -> Limits:
    from shadowradix.server.runtime import Limits

    given = {name: getattr(args, name) for name in LIMIT_FLAGS}
    return Limits(**{name: value for name, value in given.items() if value is not None})


def _check_arena(args: argparse.Namespace, page: int) -> None:
    """--device-bytes must hold one frame of the model's arena (its largest page, aligned),
    read from its config before anything loads (ValueError naming the flag). The engine
    checks again with the dtypes of the weights it loads."""
    from shadowradix.layout.presets import deepseek_v4
    from shadowradix.model.attention import CSA
    from shadowradix.pool.arena import plan_frames
    from shadowradix.sparse.hot_sizing import hot_bytes, hot_sets

    try:
        if args.model == "tiny":
            from shadowradix.demo import DEMO_SHAPE
            from shadowradix.model.tiny import tiny_config

            hf_config = tiny_config(**DEMO_SHAPE)
        else:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(args.model)
        layout = deepseek_v4(hf_config, page, args.dtype)
    except Exception:  # a config this check cannot read: the engine says why as it loads
        return
    names = [n for n in layout.pool_names if not (args.hisparse_buffer and n == "c4")]
    frame = plan_frames(layout, names).frame_bytes
    hot = 0  # HiSparse's hot buffers, set apart in whole frames (as the engine does)
    if args.hisparse_buffer:
        sets = hot_sets(layout, args.hisparse_buffer, args.hisparse_requests,
                        args.device_tokens or 0, args.device_bytes)
        csa = sum(kind == CSA for kind in hf_config.layer_types)
        hot = -(-hot_bytes(layout, csa, sets, args.hisparse_buffer) // frame) * frame
    if args.device_bytes < frame + hot:
        beside = (f" besides the {hot} bytes of HiSparse's hot buffers (--hisparse-requests "
                  f"{sets}, --hisparse-buffer {args.hisparse_buffer})" if hot else "")
        raise ValueError(f"--device-bytes {args.device_bytes} holds no frame of this "
                         f"model's arena ({frame} bytes: its largest page at page size "
                         f"{page}, aligned){beside}")


def runtime_from_args(args: argparse.Namespace) -> Runtime:
    """Check everything that can be checked before the model loads (ValueError)."""
    from shadowradix.engine import CacheConfig
    from shadowradix.server.engine_loop import EngineLoop
    from shadowradix.server.metrics import ServerMetrics
    from shadowradix.server.runtime import Runtime

    tiny = args.model == "tiny"
    if not tiny and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model!r}: not 'tiny' and not a checkpoint directory "
                         f"(no config.json there)")
    if args.max_queue is not None and args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    speculative = spec_config(args)
    if args.device_bytes is not None:
        apart = [f"--{n}-tokens" for n in ("window", "state") if getattr(args, f"{n}_tokens")]
        if apart:
            raise ValueError(f"{' and '.join(apart)} size pools of their own; with "
                             f"--device-bytes every pool shares one arena (leave them out)")
    page = args.page_size if args.page_size is not None else (16 if tiny else 256)
    if args.device_bytes is not None:
        _check_arena(args, page)
    device = args.device_tokens if args.device_tokens is not None else 2048 * page
    config = CacheConfig(page_size=page, device_tokens=device, device_bytes=args.device_bytes,
                         window_tokens=args.window_tokens, state_tokens=args.state_tokens,
                         host_tokens=args.host_tokens,
                         write_policy=args.write_policy, storage=args.storage,
                         prefix_reuse=not args.disable_prefix_cache, policy=args.policy,
                         storage_secret=storage_secret(args),
                         hisparse_buffer=args.hisparse_buffer,
                         hisparse_requests=args.hisparse_requests)
    name = args.served_model_name or ("tiny" if tiny else Path(args.model).resolve().name)
    metrics = ServerMetrics(name, speculative.num_draft_tokens if speculative else 0)
    runtime = Runtime(loop=None, metrics=metrics, model_name=name,  # type: ignore[arg-type]
                      root=args.model, api_key=args.api_key,
                      specials_in_content=args.allow_special_tokens_in_content,
                      limits=limits_from_args(args))

    def build() -> Any:
        import torch

        from shadowradix.engine import Engine
        from shadowradix.server.info_api import engine_settings
        from shadowradix.server.tokenizer import text_bound

        dtype = getattr(torch, args.dtype)
        if args.model == "tiny":
            from shadowradix.demo import tiny_deepseek_v4
            from shadowradix.server.tokenizer import tiny_tokenizer

            hf = tiny_deepseek_v4().to(dtype=dtype, device=args.device)
            engine = Engine.from_hf(hf, config, step_tokens=args.step_tokens,
                                    speculative=speculative)
            runtime.tokenizer = tiny_tokenizer(engine.vocab_size)
        else:
            from shadowradix.server.tokenizer import load_tokenizer

            engine = Engine.from_pretrained(args.model, config, dtype, args.device,
                                            step_tokens=args.step_tokens,
                                            speculative=speculative)
            runtime.tokenizer = load_tokenizer(args.model)
        runtime.vocab_size = engine.vocab_size
        runtime.eos = frozenset(engine.eos)
        runtime.max_len = engine.max_sequence_len()
        runtime.text_bound = text_bound(runtime.tokenizer, runtime.max_len)
        runtime.settings = engine_settings(engine)
        log.info("loaded %s: max %d tokens per request", name, runtime.max_len)
        return engine

    runtime.loop = EngineLoop(build, metrics, args.max_queue)
    return runtime


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from shadowradix.server.app import build_app
    from shadowradix.server.connections import uvicorn_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    runtime = runtime_from_args(args)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn_config(build_app(runtime), runtime.limits,
                                           args.drain_timeout))
    # uvicorn re-raises the signal that stopped it once it is done; ours only says so,
    # so a shutdown that drained cleanly exits 0. Until uvicorn installs its own handlers,
    # ours is the one a signal meets: it asks the server to stop as soon as it runs.
    def stop(signum: int, frame: Any) -> None:
        log.info("stopped by %s", signal.Signals(signum).name)
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    print(f"shadowradix: serving {runtime.model_name} on http://{host}:{port}", file=sys.stderr,
          flush=True)
    server.run(sockets=[sock])
    return 0
