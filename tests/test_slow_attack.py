"""Attacks on the slow-store guarantees (issue #20): a TLS server that never finishes its
handshake costs one call deadline, and a storage read that lands between admission and
the engine's look at the queue is not taken for a deadlock."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from test_engine import rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.storage import RedisBackend, object_key

DATA = Path(__file__).resolve().parent / "data"
P = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0)


class Listener:
    """127.0.0.1:<port>, each accepted connection handed to `took` (on its own thread)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.took(conn)

    def took(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class Silent(Listener):
    """Accepts TCP connections and never sends a byte (a stalled TLS server: the client's
    handshake waits for its ServerHello)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []
        super().__init__()

    def took(self, conn: socket.socket) -> None:
        self._held.append(conn)

    def close(self) -> None:
        super().close()
        for s in self._held:
            s.close()


@pytest.fixture
def silent():
    server = Silent()
    yield server
    server.close()


def timed(call):
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


@pytest.mark.parametrize("url_tail, timeout_s, deadline_s", [
    ("/0", 4.0, 0.3),                    # the deadline set apart, shorter than the timeout
    ("/0?socket_timeout=4", 0.3, None),  # the URL's socket timeout, longer than the deadline
])
def test_a_stalled_tls_handshake_costs_one_deadline(silent, url_tail, timeout_s, deadline_s):
    """The TLS handshake ran inside redis-py's connect, before the socket was wrapped, and
    waited the whole socket timeout (4 s here) whatever the deadline (0.3 s)."""
    url = f"rediss://127.0.0.1:{silent.port}{url_tail}"
    store, spent = timed(lambda: RedisBackend(url, timeout_s=timeout_s, deadline_s=deadline_s,
                                              backoff_s=0.01))
    assert spent < 2.0, spent
    assert store.errors["unreachable"] == 1, store.errors
    time.sleep(0.05)  # the back-off is over: the next call probes, and waits once more
    got, spent = timed(lambda: store.batch_get([object_key("ns", "c4", b"k" * 16)]))
    assert got == [None] and spent < 2.0, spent
    assert store.errors["unreachable"] == 2, store.errors
    store.close()


class TLSProxy(Listener):
    """TLS on 127.0.0.1:<port> in front of a plain server on `target`."""

    def __init__(self, target: int, cert: str, key: str) -> None:
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self.target = target
        super().__init__()

    def took(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            tls = self._ctx.wrap_socket(conn, server_side=True)
            with tls, socket.create_connection(("127.0.0.1", self.target)) as up:
                while True:
                    for src in select.select([tls, up], [], [], 1.0)[0]:
                        data = src.recv(1 << 16)
                        if not data:
                            return
                        (up if src is tls else tls).sendall(data)


def test_a_bounded_tls_connection_still_reads_and_writes(redis_server):
    """The handshake's bound leaves the connection's own socket timeout as redis-py set it:
    a TLS store answers every call. (tests/data: a self-signed certificate for 127.0.0.1,
    for tests only, valid until 2126, so no test needs openssl.)"""
    cert, key = DATA / "tls-test-cert.pem", DATA / "tls-test-key.pem"
    proxy = TLSProxy(redis_server.port, str(cert), str(key))
    try:
        store = RedisBackend(f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert}",
                             timeout_s=5.0)
        keys = [object_key("ns", "c4", bytes([i]) * 16) for i in range(3)]
        assert store.batch_set([(k, bytes([i]) * 5000) for i, k in enumerate(keys)]) == [True] * 3
        for _ in range(3):
            assert store.batch_get(keys, [5000] * 3) == [bytes([i]) * 5000 for i in range(3)]
        assert not store.errors, store.errors
        store.close()
    finally:
        proxy.close()


# ------------------------------------------------------------------ the scheduler
@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_a_read_that_lands_after_admission_passed_it_over_is_no_deadlock(model, tmp_path):
    """The only request's read is in flight when admission looks (it is passed over) and
    done when the engine asks whether reads are pending: `_step` raised "no request can
    run: the pools are pinned by locks" and `generate` failed. Now it is admitted next
    step, from storage, with the tokens of an engine without storage."""
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=f"file://{tmp_path}")
    prompt = rand_tokens(75, 1)
    writer = Engine.from_hf(model, cfg)
    writer.generate([prompt], P)
    writer.close()
    plain = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048))
    want = plain.generate([prompt + [1, 2, 3]], P)[0].output_ids
    plain.close()

    eng = Engine.from_hf(model, cfg)
    assert eng.storage is not None
    gate = threading.Event()
    fetch, plan = eng.storage.fetch, eng.scheduler.plan

    def held_fetch(*args):
        gate.wait(10)  # in flight while admission looks
        return fetch(*args)

    def plan_then_the_read_lands():
        chunks = plan()
        reads = [r.prefetch for r in eng.scheduler.waiting if r.prefetch is not None]
        gate.set()
        for read in reads:
            with contextlib.suppress(Exception):
                read.result(10)
        return chunks

    eng.storage.fetch = held_fetch  # type: ignore[method-assign]
    eng.scheduler.plan = plan_then_the_read_lands  # type: ignore[method-assign]
    result = eng.generate([prompt + [1, 2, 3]], P)[0]
    assert result.output_ids == want
    assert result.cached_by_tier["storage"] == 64, result.cached_by_tier
    eng.check_integrity()
    eng.close()
