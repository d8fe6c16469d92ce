"""A store given by host name, behind a name resolver that stalls: the lookup (redis-py's
`getaddrinfo`, which takes no timeout) costs at most the call's deadline, like every other
wait of the call (deadline.py). The resolver is the one part faked here: the test process's
`socket.getaddrinfo` answers for one made-up name, after `delay` seconds, with the real
Valkey's address; the server, the client and the sockets are real."""

from __future__ import annotations

import _thread
import contextlib
import socket
import threading
import time

import pytest
import redis

from shadowradix.tiers.storage import RedisBackend, object_key
from shadowradix.tiers.storage import deadline as deadline_mod

NAME = "slow-store.invalid"
DEADLINE = 0.5
SLACK = 1.0  # scheduling on a loaded 2-core machine


class SlowResolver:
    """`socket.getaddrinfo` for NAME: 127.0.0.1 after `delay` seconds (other names go to the
    real resolver). `lookups` counts the lookups of NAME; `finished` those that returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
        self.delay, self.lookups, self.finished = delay, 0, 0
        real = socket.getaddrinfo

        def lookup(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
            if host != NAME:
                return real(host, port, *args, **kwargs)
            self.lookups += 1
            time.sleep(self.delay)
            self.finished += 1
            return real("127.0.0.1", port, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", lookup)


def _late_threads() -> int:
    return sum(t.name == deadline_mod._LATE for t in threading.enumerate())


def clients(server) -> int:  # type: ignore[no-untyped-def]
    """Connections the server has open, this one included."""
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        return int(r.info("clients")["connected_clients"])


def wait_for(cond, seconds: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_stalled_lookup_costs_one_deadline_and_its_late_socket_is_closed(redis_server,
                                                                           monkeypatch):
    """Opening a store whose name takes 3 s to resolve: before, the open (and every call
    that connects) waited the 3 s; now the open gives up at the deadline, the breaker
    opens, the calls after it answer at once, and the connection the lookup made too late
    is closed (the server sees no connection left behind)."""
    base = clients(redis_server)
    resolver = SlowResolver(monkeypatch, delay=3.0)
    t0 = time.monotonic()
    store = RedisBackend(f"redis://{NAME}:{redis_server.port}/0", timeout_s=DEADLINE,
                         backoff_s=60)
    spent = time.monotonic() - t0
    assert spent < DEADLINE + SLACK, spent
    assert store.errors["unreachable"] == 1 and store.breaker.is_open, store.errors
    t0 = time.monotonic()
    assert store.batch_exists([object_key("ns", "c4", b"k" * 16)]) == [False]
    assert time.monotonic() - t0 < 0.1  # the breaker: at once
    assert wait_for(lambda: resolver.finished == resolver.lookups == 1)
    assert wait_for(lambda: clients(redis_server) == base), "the late connection stayed open"
    store.close()


def test_a_store_by_name_works_when_the_lookup_is_prompt(redis_server, monkeypatch):
    """The same name, resolved at once: the connection made on the lookup's thread is the
    one the calls use (writes and reads round-trip); an IP address needs no thread."""
    resolver = SlowResolver(monkeypatch, delay=0.0)
    store = RedisBackend(f"redis://{NAME}:{redis_server.port}/0", timeout_s=DEADLINE)
    keys = [object_key("ns", "c4", bytes([i]) * 16) for i in range(3)]
    assert all(store.batch_set([(k, bytes([i]) * 64) for i, k in enumerate(keys)]))
    assert store.batch_get(keys, [64] * 3) == [bytes([i]) * 64 for i in range(3)]
    assert resolver.lookups >= 1 and not store.errors, store.errors
    store.close()
    threads = threading.active_count()
    direct = RedisBackend(redis_server.url, timeout_s=DEADLINE)
    assert direct.batch_exists(keys) == [True] * 3
    assert threading.active_count() == threads  # (no connect thread for an address)
    direct.close()


def test_lookups_past_their_deadline_are_capped(monkeypatch):
    """At most MAX_LATE connects wait on a stalled resolver at once; past that a connect
    fails at once, and each slot comes back when its lookup ends."""
    release = threading.Event()

    def stalled() -> socket.socket:
        release.wait(30)
        return socket.socket()

    try:
        for _ in range(deadline_mod.MAX_LATE):
            with pytest.raises(TimeoutError, match="longer than the call's deadline"):
                deadline_mod._connect_by(stalled, 0.01, NAME)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still wait on the name resolver"):
            deadline_mod._connect_by(stalled, 5.0, NAME)
        assert time.monotonic() - t0 < 0.5
    finally:
        release.set()

    def free_again() -> bool:
        try:
            deadline_mod._connect_by(socket.socket, 1.0, NAME).close()
        except TimeoutError:
            return False
        return True
    assert wait_for(free_again)


def test_a_fault_of_the_connect_in_time_is_raised_to_the_caller():
    def refused() -> socket.socket:
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        deadline_mod._connect_by(refused, 1.0, NAME)


def test_an_interrupted_wait_leaves_no_socket_open():
    """The caller interrupted while it waits (a signal: SIGINT's KeyboardInterrupt): the
    socket the lookup's thread makes afterwards is closed, and its slot comes back."""
    made: list[socket.socket] = []
    go = threading.Event()

    def slow() -> socket.socket:
        go.wait(10)
        made.append(socket.socket())
        return made[-1]

    threading.Timer(0.2, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        deadline_mod._connect_by(slow, 5.0, NAME)
    go.set()
    assert wait_for(lambda: bool(made) and made[0].fileno() == -1), "left open"
    assert wait_for(lambda: _late_threads() == 0)


def test_connects_in_time_count_against_no_cap():
    """Many connects by name at once, each lookup well inside the deadline: all go
    through (only connects past their deadline count against MAX_LATE). Before, every
    connect in flight held a slot, so the ninth failed at once as unreachable and opened
    the breaker of a store that was up (found by an attack)."""
    n = 3 * deadline_mod.MAX_LATE
    start = threading.Barrier(n)
    got: list[object] = []

    def connect() -> socket.socket:
        time.sleep(0.1)  # a lookup on a busy resolver
        return socket.socket()

    def caller() -> None:
        start.wait()
        try:
            sock = deadline_mod._connect_by(connect, 5.0, NAME)
        except TimeoutError as e:
            got.append(e)
        else:
            got.append(sock)
            sock.close()

    threads = [threading.Thread(target=caller) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(g, socket.socket) for g in got) and len(got) == n, got
    assert _late_threads() == 0


@pytest.mark.parametrize("delay", [0.0, 0.3])  # in time; past the deadline
def test_an_interrupt_at_any_line_of_a_connect_by_name_holds_nothing(delay):
    """Whatever line of a connect by name (the waiter's or its thread's) an interrupt
    strikes, nothing is held: the next connect goes through at once, no late thread is
    left once lookups end, and no socket stays open but one the interrupt left to the
    garbage collector (which closes it). Before, a lock held across the waiter's
    bookkeeping stayed held when the interrupt struck at its exit, and every later
    connect hung (found by an attack)."""
    import gc
    import weakref

    from helpers import LineFault

    made: list[weakref.ref] = []

    def connect() -> socket.socket:
        time.sleep(delay)
        sock = socket.socket()
        made.append(weakref.ref(sock))
        return sock

    def open_sockets() -> int:
        gc.collect()
        return sum(1 for ref in made if (s := ref()) is not None and s.fileno() != -1)

    code = [deadline_mod._connect_by,
            *(c for c in deadline_mod._connect_by.__code__.co_consts if hasattr(c, "co_name"))]
    with LineFault(code) as count, contextlib.suppress(TimeoutError):
        deadline_mod._connect_by(connect, 0.15, NAME).close()
    for nth in range(1, count.lines + 1):
        got = None
        with LineFault(code, nth), contextlib.suppress(KeyboardInterrupt, TimeoutError):
            got = deadline_mod._connect_by(connect, 0.15, NAME)
        if got is not None:  # returned: the caller's
            got.close()
            del got
        assert wait_for(lambda: open_sockets() == 0, 5), nth
        assert wait_for(lambda: _late_threads() == 0, 5), nth
        t0 = time.monotonic()
        deadline_mod._connect_by(socket.socket, 1.0, NAME).close()
        assert time.monotonic() - t0 < 0.5, nth
