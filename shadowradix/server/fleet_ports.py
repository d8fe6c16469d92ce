"""The fleet's ports: picking them on --host (free, or the ones asked for if no one listens
there), the URL of a host and port, and what a process listens on (from /proc)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from contextlib import ExitStack
from typing import TypeAlias

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


class PortError(RuntimeError):
    """A port cannot be listened on; the message names the flag and says why."""


def http_url(host: str, port: int) -> str:
    """`http://HOST:PORT`, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def pick_ports(host: str, wanted: dict[str, int]) -> list[int]:
    """A port on `host` for each flag: the one it asks for, or a free one for 0, each
    listened on (SO_REUSEADDR, as the router's: a closed connection's TIME_WAIT does not
    count, a listener does) until all are picked, then released. PortError naming the
    flag if one cannot be listened on (in use, or --host not this machine's)."""
    with ExitStack() as held:
        ports = []
        for flag, port in wanted.items():
            s = held.enter_context(socket.socket(_family(host)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                s.listen()
            except OSError as e:
                if not port:
                    raise PortError(f"--host {host}: cannot listen there: {e.strerror}") from None
                if e.errno != errno.EADDRINUSE:
                    raise PortError(f"{flag} {port}: cannot listen on {host} port {port}: "
                                    f"{e.strerror}") from None
                raise PortError(f"{flag} {port}: {host} port {port} is in use (another fleet "
                                "or server?); choose another, or 0 for a free one") from None
            ports.append(int(s.getsockname()[1]))
        return ports


def listen_addresses(pid: int) -> set[tuple[IPAddress, int]] | None:
    """The (address, port) pairs process `pid` listens on, TCP, from /proc (empty once it
    is gone), or None where the system cannot say (not Linux)."""
    if sys.platform != "linux":
        return None
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    held = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        # sl local_address rem_address st ... inode; st 0A: LISTEN; the address in hex,
        # 32-bit words each in the machine's byte order
        for row in rows:
            if row[3] == "0A" and row[9] in inodes:
                addr, port = row[1].split(":")
                raw = bytes.fromhex(addr)
                if sys.byteorder == "little":
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                held.add((ipaddress.ip_address(raw), int(port, 16)))
    return held
