"""A real shadowradix server for tests: uvicorn on 127.0.0.1, an ephemeral port, in a
thread of the test process (or as a child process, for signals), stopped by the test."""

from __future__ import annotations

import argparse
import os
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

        self.runtime = runtime
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(runtime), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
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


class ChildProcess:
    """`python -m shadowradix COMMAND ARGV` as a child process: its stderr is kept in `log`
    and each line goes to `on_line`; ready once that returns True (or the child exits)."""

    def __init__(self, command: str, *argv: str, timeout: float = 180) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "shadowradix", command, *argv],
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.log: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or not self.url:
            raise RuntimeError(f"shadowradix {command} did not start:\n" + "".join(self.log))

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
            self.proc.kill()
            self.proc.wait()


class ServerProcess(ChildProcess):
    """`python -m shadowradix serve ...` on an ephemeral port, once /health says ready."""

    def __init__(self, *argv: str, timeout: float = 120) -> None:
        super().__init__("serve", "--port", "0", *argv, timeout=timeout)
        wait_healthy(self.url, timeout)

    def on_line(self, line: str) -> bool:
        if not self.url and line.startswith("shadowradix: serving "):
            self.url = line.strip().rsplit(" ", 1)[-1]
            return True
        return False


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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
