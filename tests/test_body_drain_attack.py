"""Adversarial tests for the server's body drain (server/app.py BodyReader.read): a body over
--max-body-bytes is read and dropped up to twice the limit before the 413, and answered at
once past that. Boundaries, lies, chunked bodies, slowloris over the limit, Expect:
100-continue, memory, and many oversized uploads beside normal requests."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import httpx
import pytest
from server_util import ServerThread

from shadowradix.server.app import BODY_RATE

LIMIT = 100_000
READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    srv = ServerThread.from_args("--model", "tiny", "--max-body-bytes", str(LIMIT),
                                 "--read-timeout", str(READ_TIMEOUT),
                                 "--keep-alive-timeout", "1")
    yield srv
    srv.stop()


def _conn(server: ServerThread) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(10)
    return s


def _head(length: int | None, extra: str = "", path: str = "/v1/completions") -> bytes:
    framing = (f"Content-Length: {length}\r\n" if length is not None
               else "Transfer-Encoding: chunked\r\n")
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{framing}{extra}\r\n").encode()


def _read_all(s: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """What the server sent until it closed (True) or `seconds` passed (False); a reset
    counts as closed."""
    deadline = time.monotonic() + seconds
    got = b""
    s.settimeout(0.1)
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, True
        if not chunk:
            return got, True
        got += chunk
    return got, False


def _send_whole(server: ServerThread, head: bytes, body: bytes) -> bytes:
    """A client that sends its whole request, and only then reads (as httpx does)."""
    s = _conn(server)
    try:
        s.sendall(head)
        for i in range(0, len(body), 65536):
            s.sendall(body[i:i + 65536])
        got, _closed = _read_all(s, 10)
        return got
    finally:
        s.close()


def _body(n: int) -> bytes:
    """A JSON completion body of exactly n bytes (n >= 40)."""
    shell = b'{"prompt": "", "max_tokens": 1}'
    return shell[:12] + b"a" * (n - len(shell)) + shell[12:]


# ------------------------------------------------------------------ boundaries
def test_a_body_of_exactly_the_limit_is_served_not_413(server):
    got = _send_whole(server, _head(LIMIT), _body(LIMIT))
    assert not got.startswith(b"HTTP/1.1 413"), got[:200]
    assert got.startswith(b"HTTP/1.1 "), got[:200]


@pytest.mark.parametrize("size", [LIMIT + 1, 2 * LIMIT], ids=["limit+1", "2*limit"])
def test_a_declared_body_up_to_twice_the_limit_gets_its_whole_413(server, size):
    got = _send_whole(server, _head(size), b"a" * size)
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got, got[:200]
    assert b"connection: close" in got.lower()


@pytest.mark.parametrize("size", [LIMIT + 1, 2 * LIMIT], ids=["limit+1", "2*limit"])
def test_a_chunked_body_up_to_twice_the_limit_gets_its_whole_413(server, size):
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c)
                    for c in (b"a" * min(8192, size - i) for i in range(0, size, 8192)))
    got = _send_whole(server, _head(None), body + b"0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got, got[:200]


def test_a_declared_body_past_twice_the_limit_is_refused_before_it_is_read(server):
    s = _conn(server)
    try:
        s.sendall(_head(2 * LIMIT + 1))
        got, closed = _read_all(s, 3)  # nothing of the body sent: the answer comes anyway
        assert got.startswith(b"HTTP/1.1 413") and closed, got[:200]
    finally:
        s.close()


def test_a_huge_declared_length_is_refused_at_once(server):
    s = _conn(server)
    try:
        s.sendall(_head(10**30))
        got, closed = _read_all(s, 3)
        assert got.startswith(b"HTTP/1.1 413") or got.startswith(b"HTTP/1.1 400"), got[:200]
        assert closed
    finally:
        s.close()


def test_a_chunked_body_past_twice_the_limit_ends_with_a_413_or_a_reset_never_a_hang(server):
    s = _conn(server)
    s.sendall(_head(None))
    chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    sent, t0 = 0, time.monotonic()
    try:
        while sent < 3 * LIMIT + 65536 * 4 and time.monotonic() - t0 < 10:
            try:
                s.sendall(chunk)
            except OSError:
                break
            sent += 65536
        got, closed = _read_all(s, 5)
        assert closed and (got == b"" or got.startswith(b"HTTP/1.1 413")), got[:200]
    finally:
        s.close()


# ------------------------------------------------------------------ lies and stalls
def test_a_declared_length_over_the_limit_with_a_short_body_ends_within_the_read_timeout(
        server):
    """Declares limit+1000, sends limit+1 and then nothing: a stall past the limit."""
    s = _conn(server)
    try:
        s.sendall(_head(LIMIT + 1000) + b"a" * (LIMIT + 1))
        t0 = time.monotonic()
        got, closed = _read_all(s, READ_TIMEOUT + 3)
        assert closed, f"still open {time.monotonic() - t0:.1f} s after the stall"
        assert got.startswith(b"HTTP/1.1 413") or got.startswith(b"HTTP/1.1 408"), got[:200]
    finally:
        s.close()


def test_a_declared_length_under_the_limit_with_a_short_body_is_408(server):
    s = _conn(server)
    try:
        s.sendall(_head(LIMIT) + b'{"prompt": "')
        got, closed = _read_all(s, READ_TIMEOUT + 3)
        assert closed and got.startswith(b"HTTP/1.1 408"), got[:200]
    finally:
        s.close()


def test_a_slowloris_body_over_the_limit_ends_by_the_rate_rule(server):
    """Over the limit from its first chunk, then a trickle: the drain stops it by the same
    rule a body under the limit has (408 turned 413), not after twice the limit arrives."""
    s = _conn(server)
    try:
        s.sendall(_head(2 * LIMIT) + b"a" * (LIMIT + 10))
        t0 = time.monotonic()
        s.settimeout(0.05)
        got, closed = b"", False
        while time.monotonic() - t0 < 8:
            try:
                s.send(b"a" * 100)  # 100 bytes / 0.3 s: far under BODY_RATE
            except OSError:
                closed = True
                break
            try:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
                got += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
            time.sleep(0.3)
        elapsed = time.monotonic() - t0
        bound = READ_TIMEOUT + (2 * LIMIT) / BODY_RATE + 1.0
        assert closed and elapsed < bound, (elapsed, bound)
        assert got == b"" or got.startswith(b"HTTP/1.1 413"), got[:200]
    finally:
        s.close()


def test_an_over_limit_upload_at_the_body_rate_is_held_by_the_rate_rule_then_413(server):
    """Declared over the limit (under twice it), sent a little faster than BODY_RATE: it
    is drained to its end, so the connection is held up to read-timeout + 2 * limit /
    BODY_RATE for a body refused from its head on (a body under the limit: up to
    read-timeout + limit / BODY_RATE), then answered 413."""
    s = _conn(server)
    size = 2 * LIMIT
    try:
        s.sendall(_head(size))
        t0, sent, rate = time.monotonic(), 0, 1.3 * BODY_RATE
        while sent < size:
            n = min(4096, size - sent)
            s.sendall(b"a" * n)
            sent += n
            time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        got, closed = _read_all(s, 3)
        elapsed = time.monotonic() - t0
        assert closed and got.startswith(b"HTTP/1.1 413"), got[:200]
        assert elapsed <= READ_TIMEOUT + size / BODY_RATE + 1.0, elapsed
    finally:
        s.close()


def test_expect_100_continue_over_the_limit_is_refused_without_inviting_the_body(server):
    """A client that asks first (Expect: 100-continue; curl does for big uploads) should be
    told 413 before it sends a body the server will drop; the drain reads, and reading is
    what makes uvicorn send `100 Continue`, inviting up to twice the limit for nothing."""
    s = _conn(server)
    try:
        s.sendall(_head(LIMIT + 1, "Expect: 100-continue\r\n"))
        got = b""
        s.settimeout(0.1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and b"\r\n\r\n" not in got:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
        assert not got.startswith(b"HTTP/1.1 100"), (
            "the server invited a body it had already refused: " + repr(got[:60]))
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
    finally:
        s.close()


# ------------------------------------------------------------------ memory, fairness
def test_a_dropped_body_is_never_held_whole(server):
    """Memory held mid-drain (traced, this process) at 1.9 x the limit is no more than at
    1.1 x: past the limit nothing more of the body is kept."""
    size = 2 * LIMIT
    body = memoryview(b"a" * size)
    s = _conn(server)
    tracemalloc.start()
    try:
        s.sendall(_head(size))
        held = []
        sent = 0
        for upto in (int(1.1 * LIMIT), int(1.9 * LIMIT)):
            s.sendall(body[sent:upto])
            sent = upto
            time.sleep(0.4)  # let the server take it all
            held.append(tracemalloc.get_traced_memory()[0])
        s.sendall(body[sent:])
        got, _ = _read_all(s, 10)
    finally:
        tracemalloc.stop()
        s.close()
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert held[1] - held[0] < 0.4 * LIMIT, held


def test_many_oversized_uploads_do_not_starve_normal_requests(server):
    stop = threading.Event()
    socks: list[socket.socket] = []

    def trickle() -> None:
        s = _conn(server)
        socks.append(s)
        try:
            s.sendall(_head(2 * LIMIT) + b"a" * (LIMIT + 1))
            while not stop.is_set():
                s.sendall(b"a" * 4096)
                time.sleep(0.1)
        except OSError:
            pass

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(30)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        worst = 0.0
        for _ in range(5):
            t0 = time.monotonic()
            r = httpx.get(f"{server.url}/health", timeout=5)
            worst = max(worst, time.monotonic() - t0)
            assert r.status_code == 200
            r = httpx.post(f"{server.url}/v1/completions",
                           json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200, r.text
        assert worst < 1.0, worst
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for s in socks:
            s.close()
