"""`shadowradix fleet`: N `shadowradix serve` instances on one machine behind SGLang's
router (`sglang-router`), cache-aware by default.

The router sends a conversation's turns to the instance whose cache likely holds their
prefix; when it sends one elsewhere (load balance, a restart), the instances share L3
(`--storage`), so the other instance loads the prefix from there instead of computing it.

Life: every instance starts on a free port of its own and must answer `/health`, then the
router starts at their URLs and must report every one healthy (`/readiness`); then the
fleet prints `shadowradix: fleet of N on URL` (stderr) and watches. SIGTERM or Ctrl-C
stops the router first (no new request reaches an instance), then every instance (each
lets its requests in flight finish and its storage writes land) and exits 0. A child that
dies on its own stops all the others and the fleet exits 1. Children run in process
groups of their own (so a terminal's Ctrl-C reaches the fleet alone and it stops them in
order) and, on Linux, get SIGTERM if the fleet itself is killed: no orphans.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shadowradix.flags import positive_float, positive_int
from shadowradix.server.serve import add_arguments as add_serve_arguments

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
SERVING = re.compile(r"shadowradix: serving .* on (http://\S+)")
POLL = 0.2  # seconds between checks while starting and watching


class FleetError(RuntimeError):
    """The fleet could not start or lost a child; the message says which and why."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The serve flags (every instance gets them; --host and --port are the router's,
    the instances take free ports on the same host), and the fleet's own."""
    add_serve_arguments(ap)
    ap.add_argument("--instances", type=positive_int, default=2, help="servers to start")
    ap.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES)
    ap.add_argument("--router-args", default="", metavar="'FLAGS'",
                    help="more sglang-router flags, one quoted string "
                    "(e.g. '--health-check-interval-secs 10')")
    ap.add_argument("--start-timeout", type=positive_float, default=600.0,
                    help="seconds each instance and the router may take to become healthy")


def instance_argv(args: argparse.Namespace) -> list[str]:
    """`shadowradix serve` flags for one instance: every serve flag the fleet was given
    (those left at their defaults are left out), on a free port."""
    ap = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(ap)
    argv = ["--port", "0"]
    for action in ap._actions:  # argparse has no public list of a parser's options
        value = getattr(args, action.dest, None)
        if action.dest == "port" or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def router_argv(args: argparse.Namespace, urls: list[str], port: int) -> list[str]:
    """The router's command line: cache-aware (or the chosen policy) over `urls`, health
    checks every 5 s, the instances' API key (it then requires it from clients too and
    sends it to the instances), and a shutdown grace as long as the instances' drain."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", args.router_policy, "--host", args.host, "--port", str(port),
            "--health-check-interval-secs", "5", "--log-level", "warn",
            "--shutdown-grace-period-secs", str(max(1, round(args.drain_timeout)))]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + shlex.split(args.router_args)


@dataclass(eq=False)
class Child:
    """One child process; a thread forwards its output to ours, each line prefixed with
    the child's name, and notes the URL a server prints once it listens."""

    name: str
    proc: subprocess.Popen[str]
    url: str | None = None
    listening: threading.Event = field(default_factory=threading.Event)
    terminated: bool = False

    @classmethod
    def spawn(cls, name: str, argv: list[str]) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, process_group=0,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=_die_with_parent)
        child = cls(name, proc)
        threading.Thread(target=child._forward, name=f"fleet-{name}", daemon=True).start()
        return child

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stderr.write(f"[{self.name}] {line}")
            found = SERVING.search(line)
            if found and self.url is None:
                self.url = found.group(1)
                self.listening.set()

    def describe(self) -> str:
        return f"{self.name} (pid {self.proc.pid})"

    def terminate(self) -> None:
        """SIGTERM, once: a second one would make a draining server quit at once."""
        if not self.terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.terminated = True

    def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL to its whole process group after `timeout` seconds;
        returns its exit code."""
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"shadowradix: fleet: {self.describe()} did not stop in {timeout:g} s; "
                  "killing it", file=sys.stderr, flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)  # its group is its pid (process_group=0)
            return self.proc.wait()


class Fleet:
    """The children and their order: instances first, the router over them last; stopped
    in the reverse order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.instances: list[Child] = []
        self.router: Child | None = None
        self.url = ""
        self.stopping = threading.Event()  # set by SIGTERM / SIGINT

    def start(self) -> None:
        """Start and wait for every child; FleetError if one fails or the fleet is told
        to stop meanwhile (the caller stops what did start)."""
        argv = [sys.executable, "-m", "shadowradix", "serve", *instance_argv(self.args)]
        for i in range(self.args.instances):
            self.instances.append(Child.spawn(f"instance {i}", argv))
        for child in self.instances:
            self._wait(child, child.listening.is_set, "print its URL")
            assert child.url is not None
            self._wait(child, partial(_healthy, child.url), "be healthy")
        port = self.args.port or _free_port(self.args.host)
        urls = [c.url for c in self.instances if c.url]
        self.router = Child.spawn("router", router_argv(self.args, urls, port))
        self.url = f"http://{self.args.host}:{port}"
        self._wait(self.router, self._router_ready, f"report {len(urls)} healthy instances")

    def _router_ready(self) -> bool:
        ready = _get(f"{self.url}/readiness")
        return ready is not None and ready.get("healthy_workers") == len(self.instances)

    def _wait(self, child: Child, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.args.start_timeout
        while not ready():
            if self.stopping.is_set():
                raise FleetError("stopped while starting")
            if child.proc.poll() is not None:
                raise FleetError(f"{child.describe()} exited with code {child.proc.returncode} "
                                 f"before it could {what} (its output is above)")
            if time.monotonic() > deadline:
                raise FleetError(f"{child.describe()} did not {what} in "
                                 f"{self.args.start_timeout:g} s")
            time.sleep(POLL)

    def watch(self) -> None:
        """Return when told to stop; FleetError as soon as a child exits on its own."""
        while not self.stopping.wait(POLL):
            for child in self.children():
                if child.proc.poll() is not None:
                    raise FleetError(f"{child.describe()} exited with code "
                                     f"{child.proc.returncode}; stopping the fleet")

    def children(self) -> list[Child]:
        return [*self.instances, *([self.router] if self.router else [])]

    def stop(self) -> list[str]:
        """Stop the router, then every instance at once; returns the children that did not
        exit cleanly (code 0), described."""
        bad = []
        if self.router is not None and self.router.stop(timeout=self.args.drain_timeout + 10):
            bad.append(f"{self.router.describe()}: code {self.router.proc.returncode}")
        for child in self.instances:
            child.terminate()
        for child in self.instances:  # each drains, finishes its storage writes, exits 0
            if child.stop(timeout=self.args.drain_timeout + 30):
                bad.append(f"{child.describe()}: code {child.proc.returncode}")
        return bad


def run_fleet(args: argparse.Namespace) -> int:
    """`shadowradix fleet`: 0 after a requested stop that every child survived cleanly;
    1 if the fleet could not start or lost a child; ValueError for bad flags."""
    _check(args)
    fleet = Fleet(args)
    error = None
    with _stop_on_signals(fleet.stopping):
        try:
            fleet.start()
            print(f"shadowradix: fleet of {args.instances} on {fleet.url}", file=sys.stderr,
                  flush=True)
            fleet.watch()
        except FleetError as e:
            error = None if fleet.stopping.is_set() else str(e)  # stopped while starting: fine
        finally:
            unclean = fleet.stop()
    if error is not None:
        print(f"shadowradix: fleet: error: {error}", file=sys.stderr, flush=True)
        return 1
    if unclean:
        print(f"shadowradix: fleet: stopped, but not cleanly: {'; '.join(unclean)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    if args.router_policy == "power_of_two" and args.instances < 2:
        raise ValueError("--router-policy power_of_two needs --instances >= 2")
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("the fleet needs SGLang's router: pip install 'sglang-router>=0.3,<0.4'")


@contextmanager
def _stop_on_signals(stopping: threading.Event) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        stopping.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _get(url: str) -> dict[str, Any] | None:
    """The JSON of a 200 answer, or None (any other status, or no answer yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read() or b"{}")
            return body if isinstance(body, dict) else {}
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None


def _healthy(url: str) -> bool:
    return _get(f"{url}/health") is not None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the fleet dies, even by SIGKILL (Linux)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
