"""A real shadowradix server for tests: uvicorn on 127.0.0.1, an ephemeral port, in a
thread of the test process (or as a child process, for signals), stopped by the test."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shadowradix.server.runtime import Runtime
from shadowradix.server.serve import add_arguments, runtime_from_args

ROOT = Path(__file__).resolve().parent.parent


def serve_args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(["--port", "0", *argv])


class ServerThread:
    """`shadowradix serve` in this process: `url`, `runtime` (its engine loop, for checks
    that run on the engine thread), `stop()`."""

    def __init__(self, runtime: Runtime, wait_loaded: bool = True) -> None:
        import uvicorn

        from shadowradix.server.app import build_app
        from shadowradix.server.connections import uvicorn_config

        self.runtime = runtime
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(build_app(runtime), runtime.limits, 5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        if wait_loaded and not runtime.loop.ready.wait(120):
            raise RuntimeError("the model did not load")

    @classmethod
    def from_args(cls, *argv: str) -> ServerThread:
        return cls(runtime_from_args(serve_args(*argv)))

    def on_engine(self, fn: Any) -> Any:
        """fn(engine) on the engine thread, between steps."""
        return self.runtime.loop.call(fn).result(30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# A tiny server small enough that a few requests fill its pools and budget.
SMALL_TINY = ("--model", "tiny", "--device-tokens", "4096", "--step-tokens", "256")


class ChildProcess:
    """`python -m shadowradix COMMAND ARGV` as a child process: its stderr is kept in `log`
    and each line goes to `on_line`; ready once that returns True (or the child exits).
    `group`: in a process group of its own (Ctrl-C reaches only the caller, which stops it
    in order). As a context manager, leaving the block stops it: SIGTERM, then `exit_code`
    (None: it did not exit within `stop_timeout` and was killed)."""

    def __init__(self, command: str, *argv: str, timeout: float = 180, group: bool = False,
                 stop_timeout: float = 60) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.argv = [command, *argv]
        self.group = group
        self.stop_timeout = stop_timeout
        self.exit_code: int | None = None
        self.proc = subprocess.Popen([sys.executable, "-m", "shadowradix", *self.argv],
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT, process_group=0 if group
                                     else None)
        self.log: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            if not self._ready.wait(timeout) or not self.url:
                raise RuntimeError(f"shadowradix {command} did not start (exit code "
                                   f"{self.proc.poll()}):\n" + "".join(self.log))
        except BaseException:
            self.kill()
            raise

    def on_line(self, line: str) -> bool:
        raise NotImplementedError

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if self.on_line(line):
                self._ready.set()
        self._ready.set()  # it exited

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.exit_code = self.terminate(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.exit_code = None


class ServerProcess(ChildProcess):
    """`python -m shadowradix serve ...` on an ephemeral port, once /health says ready."""

    def __init__(self, *argv: str, timeout: float = 120, **kw: Any) -> None:
        super().__init__("serve", "--port", "0", *argv, timeout=timeout, **kw)
        try:
            wait_healthy(self.url, timeout, self.proc)
        except BaseException:
            self.kill()
            raise

    def on_line(self, line: str) -> bool:
        if not self.url and line.startswith("shadowradix: serving "):
            self.url = line.strip().rsplit(" ", 1)[-1]
            return True
        return False


class FleetProcess(ChildProcess):
    """`python -m shadowradix fleet ...`: its router URL, its instances' URLs (from their
    forwarded `serving` lines) and its children's pids."""

    def __init__(self, *argv: str, timeout: float = 180, **kw: Any) -> None:
        self.instances: dict[int, str] = {}
        super().__init__("fleet", *argv, timeout=timeout, **kw)
        self.children = child_pids(self.proc.pid)

    def on_line(self, line: str) -> bool:
        if m := re.match(r"\[instance (\d+)\] shadowradix: serving \S+ on (\S+)", line):
            self.instances[int(m.group(1))] = m.group(2)
        if m := re.match(r"shadowradix: fleet of \d+ on (\S+)", line):
            self.url = m.group(1)
            return True
        return False

    def kill(self) -> None:
        """Whatever is left, even after a failure: the fleet, then any child of it."""
        super().kill()
        for pid in getattr(self, "children", []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def child_pids(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_healthy(url: str, timeout: float = 120,
                 proc: subprocess.Popen[str] | None = None) -> None:
    """Until /health answers 200 (the model is loaded); fails at once if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed with prometheus-client's own parser, keyed
    `name{label=value,...}` (labels sorted, model_name left out)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate: Any, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
