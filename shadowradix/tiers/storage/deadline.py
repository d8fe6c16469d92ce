"""A deadline for a whole call to a Redis-protocol store, not for each wait on its socket.

redis-py's socket timeout bounds each recv: a server (or a proxy) that trickles its reply,
1 KiB every 0.4 s, never trips it, and one call lasts as long as the reply takes. Here a
call gets a deadline when its connection leaves the pool (redis-py calls `connect()` on
every checkout): `budget_s` from then, or the calling thread's `within()` deadline if that
is sooner. Every socket operation of the call (the connect, the handshake, each send and
each recv) waits at most what is left; once nothing is left the next one raises
socket.timeout at once:

    checkout --connect/handshake--send--recv--recv--recv--|deadline: socket.timeout
             <---------------------- budget_s ------------>

redis-py answers a socket timeout by disconnecting that connection (so half a reply never
stays in the pool) and raising redis.TimeoutError, which the breaker-guarded call counts
as "unreachable" and which opens the breaker. Works with any parser (hiredis or not) and
with TLS, since it wraps whatever socket the connection class made.

Resolving the store's host name (`getaddrinfo`, inside redis-py's connect) takes no
timeout at all: a resolver that stalls would hold the call for as long as it likes. A
connection to a host given by name is therefore made on a thread of its own, by a copy of
the connection (whose timeouts nothing else changes), and waited on for what is left of
the deadline (`_connect_by`). A socket it makes too late is closed; while `MAX_LATE`
such threads wait on a resolver past their deadline, a new connect fails at once. A host
given as an IP address needs no lookup and connects in place.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")
_local = threading.local()
MAX_LATE = 8  # connect threads past their deadline on a resolver before new ones fail
_LATE = "storage-connect (late)"  # the name such a thread takes


def check_deadline(seconds: float, name: str = "deadline_s") -> float:
    """`seconds` as a float; ValueError (naming `name`) unless it is a finite number > 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not 0 < seconds < float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


def current() -> float | None:
    """This thread's deadline (time.monotonic()), or None."""
    return getattr(_local, "until", None)


@contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Calls to the store made by this thread in the block end within `seconds` from now
    (or by an enclosing block's deadline, if sooner); None: no deadline of its own."""
    outer = current()
    until = outer if seconds is None else time.monotonic() + seconds
    if outer is not None and until is not None:
        until = min(until, outer)
    _local.until = until
    try:
        yield
    finally:
        _local.until = outer


def carried(call: Callable[..., T]) -> Callable[..., T]:
    """`call`, run under the deadline of the thread that wraps it (for a worker thread)."""
    until = current()

    def run(*args: Any) -> T:
        outer = current()
        _local.until = until
        try:
            return call(*args)
        finally:
            _local.until = outer
    return run


class _BoundedSocket:
    """A connection's socket whose every blocking operation waits at most until the
    connection's deadline; everything else is the socket's own."""

    def __init__(self, sock: Any, left: Callable[[], float | None]) -> None:
        self._sock = sock
        self._left = left
        self._timeout: float | None = sock.gettimeout()  # what redis-py asked for

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)

    def _arm(self) -> None:
        if self._timeout == 0:
            return  # a non-blocking poll never waits
        left = self._left()
        if left is None:
            self._sock.settimeout(self._timeout)
            return
        if left <= 0:
            raise TimeoutError("the storage call's deadline has passed")  # socket.timeout
        self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))

    def recv(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> Any:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> Any:
        self._arm()  # a timeout bounds the whole sendall (Python >= 3.5), not each send
        return self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@functools.cache
def connection_class(budget_s: float, tls: bool = False) -> type:
    """A redis-py connection class (TCP, or TLS for rediss://) whose every call, from
    checkout to its last reply, ends within `budget_s` (see the module docstring)."""
    import redis

    base: Any = redis.SSLConnection if tls else redis.Connection
    budget = check_deadline(budget_s)

    class Bounded(base):
        _until: float | None = None
        socket_connect_timeout: float | None  # the base's properties (for mypy only)
        socket_timeout: float | None

        def connect(self, *args: Any, **kwargs: Any) -> None:
            # The pool calls this on every checkout, connected or not: a call starts here.
            until = time.monotonic() + budget
            outer = current()
            self._until = until if outer is None else min(until, outer)
            super().connect(*args, **kwargs)

        def time_left(self) -> float | None:
            return None if self._until is None else self._until - time.monotonic()

        def _connect(self) -> Any:
            left = self.time_left()
            if left is not None and left <= 0:
                raise TimeoutError("the storage call's deadline has passed")  # socket.timeout
            if left is None or _is_address(self.host):
                sock = self._connect_within(left)
            else:  # a name to look up: on a copy of this connection (see `_connect_by`)
                worker = copy.copy(self)
                sock = _connect_by(lambda: worker._connect_within(left), left, self.host)
            sock.settimeout(self.socket_timeout)  # redis-py's; _BoundedSocket clamps it
            return _BoundedSocket(sock, self.time_left)

        def _connect_within(self, left: float | None) -> Any:
            # The TCP connect waits socket_connect_timeout; a TLS handshake (done inside
            # the base's _connect, before the socket is ours to wrap) waits socket_timeout,
            # over the whole handshake (CPython's do_handshake keeps a deadline): both at
            # most what is left, or a stalled TLS server (or a URL's ?socket_timeout=30)
            # would hold the call past its deadline.
            configured = self.socket_connect_timeout
            reading: float | None = self.socket_timeout
            if left is not None:
                self.socket_connect_timeout = left if configured is None else min(
                    left, configured)
                self.socket_timeout = left if reading is None else min(left, reading)
            try:
                return super()._connect()
            finally:
                self.socket_connect_timeout = configured
                self.socket_timeout = reading

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


@functools.lru_cache(maxsize=64)
def _is_address(host: str) -> bool:
    """Whether `host` is an IP address (no lookup to connect to it)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _connect_by(connect: Callable[[], Any], seconds: float, host: str) -> Any:
    """`connect()` (a socket) run on a thread of its own and waited on at most `seconds`:
    its name lookup, which takes no timeout, costs at most the call's deadline. A socket
    it makes after that is closed; a fault it raises in time is raised here. Raises
    TimeoutError (socket.timeout) when late, or at once while `MAX_LATE` connects that
    outlived their deadline still wait on the resolver (those in time count none; the
    cap is checked, not reserved, so connects begun together may pass it by their
    number). No lock is held: which side is first, the waiter giving up or the thread
    ending, is one atomic `setdefault`, and a late thread counts by its name while it
    lives, so an interrupt anywhere leaves nothing held or miscounted."""
    if sum(t.name == _LATE for t in threading.enumerate()) >= MAX_LATE:
        raise TimeoutError(f"{MAX_LATE} connects to {host!r} still wait on the name "
                           f"resolver past their deadline")
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["sock"] = connect()
        except BaseException as err:  # (the waiter raises it, if still waiting)
            box["err"] = err
        if box.setdefault("state", "done") == "late":
            _close(box)  # nobody waits for it any more
        done.set()

    thread = threading.Thread(target=run, name="storage-connect", daemon=True)
    waited = False
    try:
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: in place, the lookup unbounded as before
            box["state"] = "in place"
        else:
            done.wait(seconds)
            waited = True
    finally:
        if box.setdefault("state", "late") == "late":
            thread.name = _LATE  # counted while it lives; it closes what it makes
        elif not waited:  # it came in time, and nobody takes it
            _close(box)
    if box["state"] == "in place":
        return connect()
    try:
        if box["state"] == "late":
            raise TimeoutError(f"connecting to {host!r} (its name lookup included) took "
                               f"longer than the call's deadline")
        done.wait()  # (set just after its state: at once)
        if "err" in box:
            raise box.pop("err")
        return box.pop("sock")
    finally:  # (an interrupt before the return: nobody takes it)
        _close(box)


def _close(box: dict[str, Any]) -> None:
    """Close the socket in `box`, if any: whoever pops it first (one atomic pop) closes it."""
    sock = box.pop("sock", None)
    if sock is not None:
        sock.close()
