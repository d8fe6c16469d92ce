"""`shadowradix fleet` as an operator meets it, with real processes on 127.0.0.1: two fleets
on one machine (each router's metrics on --host, on a port of its own, announced), a port
that is already in use (refused, never announced as ready), a reader of the fleet's stderr
that stalls or goes away (the instances keep answering), and SIGTERM at any moment of
start-up (exit 0, no child left)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server_util import ROOT, FleetProcess, alive, child_pids, wait_for

TINY = ("--model", "tiny", "--instances", "1", "--drain-timeout", "2")
READY = re.compile(r"shadowradix: fleet of \d+ on (\S+) \(router metrics on (\S+)\)")
FLEET_URL = re.compile(r"shadowradix: fleet of \d+ on (\S+)")  # as parsed since the start
SERVING = re.compile(r"\[instance 0\] shadowradix: serving \S+ on (\S+)")


# ------------------------------------------------------------------------------ helpers
def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process `pid` listens on (TCP, IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words, each in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add((socket.inet_ntop(family, raw), int(port, 16)))
    return out


def is_router(pid: int) -> bool:
    try:
        return b"sglang" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Launched:
    """`python -m shadowradix fleet ARGV`, its stderr read line by line into `log` by a
    thread (until a line holds `read_until`: then nobody reads it any more); `seen`: the
    pid of every process the fleet started, noted as they appear."""

    def __init__(self, *argv: str, read_until: str | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "shadowradix", "fleet", *argv],
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.seen: set[int] = set()
        self.read_until = read_until
        self.reading = threading.Thread(target=self._read, daemon=True)
        self.reading.start()
        threading.Thread(target=self._note_children, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.log.append(raw.decode(errors="replace"))
            if self.read_until is not None and self.read_until in self.log[-1]:
                return

    def _note_children(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(child_pids(self.proc.pid))
            time.sleep(0.02)

    def line(self, pattern: re.Pattern[str], timeout: float = 120) -> re.Match[str]:
        """The first line of the log matching `pattern`, once there is one."""
        found: list[re.Match[str]] = []

        def search() -> bool:
            if self.proc.poll() is not None and not self.reading.is_alive():
                raise AssertionError(f"the fleet exited {self.proc.returncode}:\n{self.text}")
            found.extend(m for m in map(pattern.search, list(self.log)) if m)
            return bool(found)

        wait_for(search, timeout, what=pattern.pattern)
        return found[0]

    @property
    def text(self) -> str:
        return "".join(self.log)

    def left(self) -> list[int]:
        return [pid for pid in self.seen if alive(pid)]

    def kill(self) -> None:
        """Whatever is left, even after a failure: the fleet, then every child it started."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.left():
            os.kill(pid, signal.SIGKILL)


class FakeRouter(ThreadingHTTPServer):
    """Another fleet's router, as far as a readiness poll can tell: every GET is 200, and
    /readiness reports one healthy worker."""

    def __init__(self, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"status": "ready", "healthy_workers": 1}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


# ------------------------------------------------------------------ 1: metrics, two fleets
def test_two_fleets_at_once_each_with_its_router_metrics_on_host():
    """Two fleets start at the same time on one machine: each router's Prometheus port is
    on --host (127.0.0.1, never every interface), a free one of its own, the one the ready
    line announces; no child of either listens anywhere but 127.0.0.1. One stops on
    SIGTERM, the other on SIGINT: both exit 0, no process left."""
    fleets: list[FleetProcess] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            started = [pool.submit(FleetProcess, *TINY, "--port", "0") for _ in range(2)]
        fleets += [f.result() for f in started if not f.exception()]  # (killed at the end)
        for future in started:
            future.result()  # raises if that fleet did not start
        ports = set()
        for fleet in fleets:
            [ready] = [m for m in map(READY.search, fleet.log) if m]
            url, metrics_url = urlsplit(ready.group(1)), urlsplit(ready.group(2))
            assert url.hostname == metrics_url.hostname == "127.0.0.1", ready.group(0)
            assert metrics_url.path == "/metrics" and metrics_url.port != url.port
            [router] = [pid for pid in fleet.children if is_router(pid)]
            assert listening(router) == {("127.0.0.1", url.port), ("127.0.0.1", metrics_url.port)}
            for pid in fleet.children:
                assert {addr for addr, _ in listening(pid)} == {"127.0.0.1"}, pid
            r = httpx.get(ready.group(2), timeout=10)  # the router's own metrics, no key
            assert r.status_code == 200 and "# TYPE" in r.text, r.text[:200]
            ports |= {url.port, metrics_url.port}
        assert len(ports) == 4  # nothing shared between the two fleets
        fleets[0].proc.send_signal(signal.SIGTERM)
        fleets[1].proc.send_signal(signal.SIGINT)
        for fleet in fleets:
            assert fleet.proc.wait(60) == 0, "".join(fleet.log)
            assert not [pid for pid in fleet.children if alive(pid)]
    finally:
        for fleet in fleets:
            fleet.kill()


# ---------------------------------------------------------------------- 2: a busy port
def test_a_port_in_use_is_refused_never_announced():
    """--port (held by what answers /readiness like a router) or --router-metrics-port
    (held by a plain listening socket) already in use: exit 1 at once, a message naming
    the flag, never the ready line."""
    port = free_port()
    fake = FakeRouter(port)
    try:
        run = subprocess.run([sys.executable, "-m", "shadowradix", "fleet", *TINY, "--port",
                              str(port)], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
    finally:
        fake.close()
    assert run.returncode == 1, run.stderr
    assert "fleet of" not in run.stderr and f"--port {port}: " in run.stderr, run.stderr
    assert "is in use" in run.stderr and "[instance 0]" not in run.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = str(held.getsockname()[1])
        run = subprocess.run([sys.executable, "-m", "shadowradix", "fleet", *TINY, "--port",
                              "0", "--router-metrics-port", busy], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1, run.stderr
    assert f"--router-metrics-port {busy}: " in run.stderr and "fleet of" not in run.stderr


def test_a_port_taken_while_the_router_starts_is_not_its_router():
    """The port is free when the router is started but taken (by what answers /readiness
    like a router) while it imports (a second or so, before it binds): the router that
    answers is not the fleet's own, so the fleet never says it is ready; its router fails
    to bind and the fleet exits 1."""
    port = free_port()
    fleet = Launched(*TINY, "--port", str(port))
    fake = None
    try:
        deadline = time.monotonic() + 120
        while not any(is_router(pid) for pid in list(fleet.seen)):
            assert fleet.proc.poll() is None and time.monotonic() < deadline, fleet.text
            time.sleep(0.005)
        fake = FakeRouter(port)  # OSError: the router bound it first (it never has yet)
        assert fleet.proc.wait(120) == 1, fleet.text
        fleet.reading.join(10)
        assert "fleet of" not in fleet.text
        assert re.search(r"router \(pid \d+\) exited with code 1 before it could listen on "
                         rf"ports {port} and \d+", fleet.text), fleet.text[-3000:]
        assert not fleet.left()
    finally:
        fleet.kill()
        if fake is not None:
            fake.close()


# --------------------------------------------------------- 3: a reader that stalls or goes
def test_output_never_waits_for_its_reader():
    """The fleet's stderr: a reader that stalls costs the children's lines that do not fit
    (counted, and a note once it reads again), never a wait; the fleet's own lines wait
    their turn whatever the room; a reader that goes away costs every line, quietly."""
    from shadowradix.server.fleet_output import Output  # (here: the other tests run on any fleet)

    read, write = os.pipe()
    try:
        os.set_blocking(write, False)
        full = 0
        with contextlib.suppress(BlockingIOError):
            while True:  # the reader stalls: the pipe is full
                full += os.write(write, b"-" * 4096)
        os.set_blocking(write, True)
        out = Output(write, room=1000)
        began = time.monotonic()
        for i in range(500):  # 50 KB; the buffer holds 1000 bytes
            out.child_line(b"%03d " % i + b"x" * 95 + b"\n")
        out.say("fleet: still here")
        assert time.monotonic() - began < 1 and out.dropped >= 500 - 10
        assert not out.flush(0.2)  # held up by the reader
        got = b""
        while b"still here" not in got:
            got += os.read(read, 65536)
        lines = got[full:].decode().splitlines()
        kept = [line for line in lines if line.endswith("x" * 95)]
        assert kept == [f"{i:03d} " + "x" * 95 for i in range(len(kept))]  # the first ones
        assert lines[len(kept):] == [f"shadowradix: fleet: {500 - len(kept)} lines of the "
                                     "children's output dropped here (stderr was not read)",
                                     "shadowradix: fleet: still here"]
        assert out.dropped == 500 - len(kept)
        assert out.flush(5)
        os.close(read)
        read = -1
        dropped = out.dropped
        out.child_line(b"nobody reads this\n")
        out.say("fleet: nor this")
        assert out.flush(5) and out.dropped == dropped + 1
    finally:
        os.close(write)
        if read >= 0:
            os.close(read)


def flood(url: str, lines: int) -> int:
    """Make the instance at `url` log `lines` lines (uvicorn's one warning per request
    that is not HTTP); returns how many it answered before it stopped answering."""
    where = urlsplit(url)
    for sent in range(lines):
        try:
            with socket.create_connection((where.hostname, where.port), timeout=3) as s:
                s.sendall(b"GARBAGE\r\n\r\n")  # "WARNING:  Invalid HTTP request received."
                if not s.recv(4096):
                    return sent
        except OSError:
            return sent
    return lines


def answers(instance: str, router: str) -> None:
    """The instance answers directly and through the router."""
    assert httpx.get(f"{instance}/health", timeout=10).status_code == 200
    r = httpx.post(f"{router}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_instances_keep_answering_when_nobody_reads_the_fleets_stderr():
    """A reader of the fleet's stderr that stops reading (a stalled `tee`), then goes away
    (`| head`): each time an instance logs far more than the pipes hold (its own to the
    fleet, the fleet's to the reader), and still answers, directly and through the router;
    SIGTERM then stops the fleet cleanly (exit 0, no child left)."""
    fleet = Launched(*TINY, "--port", "0", read_until="shadowradix: fleet of")
    try:
        router = fleet.line(FLEET_URL).group(1)
        instance = fleet.line(SERVING).group(1)
        assert fleet.proc.stderr is not None
        fleet.reading.join(10)
        assert not fleet.reading.is_alive()  # nobody reads the fleet's stderr from here on
        fcntl.fcntl(fleet.proc.stderr.fileno(), 1031, 4096)  # F_SETPIPE_SZ: fill it sooner
        assert flood(instance, 3000) == 3000, "the instance stopped answering: a full pipe"
        answers(instance, router)
        fleet.proc.stderr.close()  # the reader goes away: the fleet's writes fail (EPIPE)
        assert flood(instance, 3000) == 3000, "the instance stopped answering: a full pipe"
        answers(instance, router)
        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(60) == 0
        wait_for(lambda: not fleet.left(), 10, what="every child gone")
    finally:
        fleet.kill()


# ------------------------------------------------------------- 4: SIGTERM while starting
def first_child(fleet: Launched) -> None:
    wait_for(lambda: fleet.seen, 60, what="the fleet's first child")


def instance_url(fleet: Launched) -> None:
    fleet.line(SERVING)


def router_started(fleet: Launched) -> None:
    wait_for(lambda: any(is_router(pid) for pid in fleet.seen), 60, what="the router")


@pytest.mark.parametrize("moment", [first_child, instance_url, router_started])
def test_sigterm_at_any_moment_of_start_up_exits_0(moment):
    """SIGTERM as soon as the fleet has a child (still importing), once the instance
    printed its URL, and while the router starts (there twice, 50 ms apart): exit 0, no
    ready line, no child left."""
    fleet = Launched(*TINY, "--port", "0")
    try:
        moment(fleet)
        fleet.proc.send_signal(signal.SIGTERM)
        if moment is router_started:
            time.sleep(0.05)
            fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(60) == 0, fleet.text[-3000:]
        assert "fleet of" not in fleet.text
        wait_for(lambda: not fleet.left(), 10, what="every child gone")
    finally:
        fleet.kill()
