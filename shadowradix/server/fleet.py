"""`shadowradix fleet`: N `shadowradix serve` instances on one machine behind SGLang's
router (`sglang-router`), cache-aware by default.

The router sends a conversation's turns to the instance whose cache likely holds their
prefix; when it sends one elsewhere (load balance, a restart), the instances share L3
(`--storage`), so the other instance loads the prefix from there instead of computing it.

Life: a `--port` or `--router-metrics-port` that is already in use is refused at once.
Every instance starts on a free port of its own and must answer `/health`, then the router
starts at their URLs (its Prometheus metrics on `--host` too, on a free port by default)
and is ready once it is the process listening on both ports and reports every instance
healthy (`/readiness`); then the fleet prints `shadowradix: fleet of N on URL (router
metrics on URL/metrics)` (stderr) and watches. SIGTERM or Ctrl-C, at any moment, stops the
router first (no new request reaches an instance), then every instance (each lets its
requests in flight finish and its storage writes land) and exits 0; a child that does not
answer yet serves nothing and is killed instead (its process group). A child that dies on
its own stops all the others and the fleet exits 1. Children run in process groups of
their own (so a terminal's Ctrl-C reaches the fleet alone and it stops them in order) and,
on Linux, get SIGTERM if the fleet itself is killed: no orphans. The children's output is
forwarded line by line through a bounded buffer: a reader of the fleet's stderr that
stalls or goes away costs lines (counted), never a child blocked on its own log.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shadowradix import early_signals
from shadowradix.flags import port, positive_float, positive_int
from shadowradix.server.fleet_output import Output, forward, stderr_fd
from shadowradix.server.fleet_ports import PortError, http_url, listen_addresses, pick_ports
from shadowradix.server.serve import add_arguments as add_serve_arguments
from shadowradix.server.serve import spec_config

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# Router flags the fleet sets itself (and announces, and checks the router listens on).
OWN_ROUTER_FLAGS = ("--host", "--port", "--prometheus-host", "--prometheus-port",
                    "--worker-urls")
SERVING = re.compile(r"shadowradix: serving .* on http://(\S+):(\d+)")
POLL = 0.2  # seconds between checks while starting and watching


class FleetError(RuntimeError):
    """The fleet could not start or lost a child; the message says which and why."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The serve flags (every instance gets them; --host and --port are the router's,
    the instances take free ports on the same host), and the fleet's own."""
    add_serve_arguments(ap)
    ap.add_argument("--instances", type=positive_int, default=2, help="servers to start")
    ap.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES)
    ap.add_argument("--router-metrics-port", type=port, default=0,
                    help="the router's Prometheus port, on --host (0: a free one, printed)")
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


def router_argv(args: argparse.Namespace, urls: list[str], port: int,
                metrics_port: int) -> list[str]:
    """The router's command line: cache-aware (or the chosen policy) over `urls` on
    `--host:port`, its Prometheus metrics on `--host:metrics_port` (not the router's
    default, every interface's 29000), health checks every 5 s, the instances' API key (it
    then requires it from clients too and sends it to the instances), and a shutdown grace
    as long as the instances' drain. (sglang-router 0.3 wants an IPv6 --host in brackets
    and its --prometheus-host without: one it cannot parse silently becomes 0.0.0.0.)"""
    ip = ipaddress.ip_address(args.host)
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", args.router_policy, "--host", f"[{ip}]" if ip.version == 6 else str(ip),
            "--port", str(port), "--prometheus-host", str(ip),
            "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", "5", "--log-level", "warn",
            "--shutdown-grace-period-secs", str(max(1, round(args.drain_timeout)))]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + shlex.split(args.router_args)


@dataclass(eq=False)
class Child:
    """One child process; a thread forwards its output to ours, each line prefixed with
    the child's name, and notes the URL a server prints once it listens. `up`: it answers
    (an instance: HTTP, any status; the router: the fleet's readiness check), so it has
    its signal handlers: from then on it is stopped by SIGTERM, before by SIGKILL."""

    name: str
    proc: subprocess.Popen[bytes]
    output: Output
    url: str | None = None
    listening: threading.Event = field(default_factory=threading.Event)
    up: bool = False
    signalled: bool = False
    killed_early: bool = False  # SIGKILLed by us before it was up

    @classmethod
    def spawn(cls, name: str, argv: list[str], output: Output) -> Child:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=partial(_die_with_parent, os.getpid()))
        child = cls(name, proc, output)
        assert proc.stdout is not None
        threading.Thread(target=forward, name=f"fleet-{name}", daemon=True,
                         args=(proc.stdout, f"[{name}] ".encode(), output,
                               child._note_url)).start()
        return child

    def _note_url(self, line: bytes) -> None:
        """The URL a server prints once it listens, from the first line that has it."""
        if self.url is None and (found := SERVING.search(line.decode(errors="replace"))):
            self.url = http_url(found.group(1).strip("[]"), int(found.group(2)))
            self.listening.set()

    def describe(self) -> str:
        return f"{self.name} (pid {self.proc.pid})"

    def terminate(self) -> None:
        """Ask it to stop, once. One that is up gets SIGTERM (it drains; a second one would
        make a draining server quit at once). One that is not serves nothing yet, and a
        SIGTERM could come before its handlers (it would die of it) or between serve's and
        uvicorn's (lost): its process group gets SIGKILL."""
        if not self.signalled and self.proc.poll() is None:
            if self.up:
                self.proc.send_signal(signal.SIGTERM)
            else:
                _kill_group(self.proc.pid)
                self.killed_early = True
        self.signalled = True

    def stop(self, timeout: float) -> str | None:
        """`terminate`, then SIGKILL to its whole process group after `timeout` seconds;
        None if it stopped cleanly (exit code 0, or killed before it was up), else what
        went wrong. Whatever it leaves in its process group is killed."""
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.output.say(f"fleet: {self.describe()} did not stop in {timeout:g} s; "
                            "killing it")
            _kill_group(self.proc.pid)
            code = self.proc.wait()
        _kill_group(self.proc.pid)
        if code == 0 or (self.killed_early and code == -signal.SIGKILL):
            return None
        return f"{self.describe()}: code {code}"


class Fleet:
    """The children and their order: instances first, the router over them last; stopped
    in the reverse order."""

    def __init__(self, args: argparse.Namespace, output: Output) -> None:
        self.args = args
        self.output = output
        self.instances: list[Child] = []
        self.router: Child | None = None
        self.port = self.metrics_port = 0
        self.url = self.metrics_url = ""
        self.stopping = threading.Event()  # set by SIGTERM / SIGINT

    def start(self) -> None:
        """Start and wait for every child; FleetError if one fails, a port asked for is in
        use, or the fleet is told to stop meanwhile (the caller stops what did start)."""
        host = self.args.host
        wanted = {"--port": self.args.port, "--router-metrics-port": self.args.router_metrics_port}
        self._pick_ports(wanted)  # before loading any model: a port in use fails at once
        argv = [sys.executable, "-m", "shadowradix", "serve", *instance_argv(self.args)]
        for i in range(self.args.instances):
            self._check_stopping()
            self.instances.append(Child.spawn(f"instance {i}", argv, self.output))
        for child in self.instances:
            self._wait(child, child.listening.is_set, "print its URL")
            self._wait(child, partial(self._healthy, child), "be healthy")
        self.port, self.metrics_port = self._pick_ports(wanted)  # again: still free?
        urls = [c.url for c in self.instances if c.url]
        self._check_stopping()
        self.router = Child.spawn("router", router_argv(self.args, urls, self.port,
                                                        self.metrics_port), self.output)
        self.url = http_url(host, self.port)
        self.metrics_url = f"{http_url(host, self.metrics_port)}/metrics"
        self._wait(self.router, partial(self._router_ready, self.router),
                   f"listen on ports {self.port} and {self.metrics_port} and report "
                   f"{len(urls)} healthy instances")
        self._check_stopping()

    def _pick_ports(self, wanted: dict[str, int]) -> list[int]:
        try:
            return pick_ports(self.args.host, wanted)
        except PortError as e:
            raise FleetError(str(e)) from None

    def _healthy(self, child: Child) -> bool:
        assert child.url is not None
        status = _status(f"{child.url}/health")
        child.up = child.up or status is not None
        return status == 200

    def _router_ready(self, router: Child) -> bool:
        """Our router reports every instance healthy and is the process listening on both
        ports, on --host (not another fleet's router that held a port: it answers too)."""
        ready = _get(f"{self.url}/readiness")
        if ready is None or ready.get("healthy_workers") != len(self.instances):
            return False
        held = listen_addresses(router.proc.pid)
        ip = ipaddress.ip_address(self.args.host)
        router.up = held is None or {(ip, self.port), (ip, self.metrics_port)} <= held
        return router.up

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise FleetError("stopped while starting")

    def _wait(self, child: Child, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.args.start_timeout
        while True:
            self._check_stopping()
            if ready():
                return
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
        stop cleanly, described."""
        bad = []
        if self.router is not None:
            bad.append(self.router.stop(timeout=self.args.drain_timeout + 10))
        for child in self.instances:
            child.terminate()
        for child in self.instances:  # each drains, finishes its storage writes, exits 0
            bad.append(child.stop(timeout=self.args.drain_timeout + 30))
        return [b for b in bad if b is not None]


def run_fleet(args: argparse.Namespace) -> int:
    """`shadowradix fleet`: 0 after a requested stop (at any moment, start-up included)
    that every child survived cleanly; 1 if the fleet could not start or lost a child;
    ValueError for bad flags."""
    _check(args)
    output = Output(stderr_fd())
    try:
        return _run(Fleet(args, output), output)
    finally:
        output.flush(5.0)  # a reader that holds it up longer loses the rest


def _run(fleet: Fleet, output: Output) -> int:
    error = None
    with _stop_on_signals(fleet.stopping):
        try:
            fleet.start()
            output.say(f"fleet of {fleet.args.instances} on {fleet.url} "
                       f"(router metrics on {fleet.metrics_url})")
            fleet.watch()
        except FleetError as e:
            error = None if fleet.stopping.is_set() else str(e)  # stopped while starting
        finally:
            unclean = fleet.stop()
    if output.dropped:
        output.say(f"fleet: {output.dropped} lines of the children's output dropped in all "
                   "(stderr was not read)")
    if error is not None:
        output.say(f"fleet: error: {error}")
        return 1
    if unclean:
        output.say(f"fleet: stopped, but not cleanly: {'; '.join(unclean)}")
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    if args.router_policy == "power_of_two" and args.instances < 2:
        raise ValueError("--router-policy power_of_two needs --instances >= 2")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        raise ValueError(f"--host must be an IP address (the router takes no host name), "
                         f"got {args.host!r}: e.g. 127.0.0.1, 0.0.0.0 or ::1") from None
    if args.port and args.port == args.router_metrics_port:
        raise ValueError(f"--router-metrics-port must differ from --port ({args.port})")
    spec_config(args)  # a speculative flag combination every instance would refuse
    for word in shlex.split(args.router_args):
        # The router's parser (argparse) takes any unambiguous abbreviation of a flag
        # (`--hos 0.0.0.0` is --host), and the last of a flag given twice wins.
        name = word.split("=", 1)[0]
        own = [f for f in OWN_ROUTER_FLAGS if len(name) > 2 and f.startswith(name)]
        if name.startswith("--") and own:
            raise ValueError(f"--router-args: {name} is the fleet's own {own[0]} (it comes "
                             "from --host, --port, --router-metrics-port and the instances)")
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("the fleet needs SGLang's router: pip install 'sglang-router>=0.3,<0.4'")


@contextmanager
def _stop_on_signals(stopping: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stopping` in the block. Once one came, they are ignored after
    the block (its children are gone by then, none inherits that): the fleet is stopping
    already, and a repeat (a supervisor's, a second Ctrl-C) must not kill it with the old
    handlers (exit -15, or a KeyboardInterrupt) while it flushes its output and exits 0.
    Ignored, not left to a handler of ours: the interpreter's shutdown puts SIG_DFL back
    in place of a Python handler, but leaves SIG_IGN."""
    def handler(signum: int, frame: Any) -> None:
        stopping.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    if early_signals.received():  # one came while the command was still importing
        stopping.set()
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN if stopping.is_set() else h)


def _status(url: str) -> int | None:
    """The HTTP status of a GET, or None (no answer yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:  # URLError and connection errors
        return None


def _get(url: str) -> dict[str, Any] | None:
    """The JSON of a 200 answer, or None (any other status, or no answer yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read() or b"{}")
            return body if isinstance(body, dict) else {}
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None



def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in a child's group (its group is its pid:
    process_group=0); nothing if none is."""
    with suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGTERM when the fleet dies, even by SIGKILL (Linux); no
    exec at all if it died already (before the request could take effect)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
