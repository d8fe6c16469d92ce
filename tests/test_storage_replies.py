"""Replies of the wrong shape or type from a Redis-protocol server are counted misses.

A tiny RESP server (a thread on 127.0.0.1) answers the handshake correctly and every
data command (MGET, GETRANGE, EXISTS, SET) with a chosen raw reply: an integer where an
array is expected, a short or nested array, a simple string, RESP3 types, an error
inside an array, a malformed redirection, a hang-up mid-reply. Every call must answer
misses or failed writes, count the fault, and never raise, for redis:// and
redis-cluster:// alike. URL options that change what redis-py returns are refused.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from shadowradix.tiers.storage import RedisBackend, RedisClusterBackend, object_key, open_storage
from shadowradix.tiers.storage.redis_cluster import cluster_key

HANG_UP = b"<hang up>"  # a reply ending so: send what precedes it, then close
# A reply ending so is sent twice: now, and again ahead of the next command's reply, and
# so on: from then on that connection answers each command with the previous one's
# reply (out of step, as if it had answered one command twice), until it is closed.
ONE_BEHIND = b"<one behind>"


def _command(buf: bytes) -> tuple[list[bytes] | None, bytes]:
    """One RESP command array parsed off the front of `buf`, and the rest."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None, buf
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buf
        size, tail = rest.split(b"\r\n", 1)
        n = int(size[1:])
        if len(tail) < n + 2:
            return None, buf
        args.append(tail[:n])
        rest = tail[n + 2:]
    return args, rest


class FakeServer:
    """HELLO, PING, CLIENT, CLUSTER SLOTS (this server owns every slot) and COMMAND are answered
    as a real server would; every other command with `answer(args)`, raw RESP."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.answer: Callable[[list[bytes]], bytes] = lambda args: b"-ERR unknown\r\n"
        self.commands: list[bytes] = []  # data commands seen, upper-case names
        self.handshake: dict[bytes, bytes] = {}  # e.g. {b"HELLO": an error}: answers first
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms stalls
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _reply(self, args: list[bytes]) -> bytes:
        name = args[0].upper()
        if name in self.handshake:
            return self.handshake[name]
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"HELLO":  # redis-py 8 speaks RESP3 unless the URL says protocol=2
            return b"%1\r\n$5\r\nproto\r\n:3\r\n" if args[1:2] == [b"3"] else b"-ERR no\r\n"
        if name == b"CLIENT":
            return b"+OK\r\n"
        if name == b"COMMAND":
            return b"*0\r\n"
        if name == b"CLUSTER" and args[1].upper() == b"SLOTS":
            return (b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
                    b"$4\r\nfake\r\n" % self.port)
        self.commands.append(name)
        return self.answer(args)

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        behind: bytes | None = None  # the reply this connection owes (see ONE_BEHIND)
        with conn:
            while not self._stop:
                args, buf = _command(buf)
                if args is None:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                    continue
                reply = self._reply(args)
                if reply.endswith(ONE_BEHIND):
                    reply = behind = reply.removesuffix(ONE_BEHIND)
                elif behind is not None:
                    reply, behind = behind, reply
                try:
                    conn.sendall(reply.removesuffix(HANG_UP))
                except OSError:  # the client gave up on us (its timeout)
                    return
                if reply.endswith(HANG_UP):
                    return

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def cluster_url(self) -> str:
        return f"redis-cluster://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.stop()


# One page's three pools: one slot, so a cluster reads them with one MGET too.
KEYS = [object_key("ns", pool, (7).to_bytes(16, "little")) for pool in ("kv", "c4", "swa")]
NIL3 = b"*3\r\n$-1\r\n$-1\r\n$-1\r\n"
BAD = {  # none of these is a valid reply to MGET of three keys, GETRANGE, EXISTS or SET
    "integer": b":7\r\n",
    "short array": b"*1\r\n$-1\r\n",
    "long array": b"*5\r\n" + b"$-1\r\n" * 5,
    "empty array": b"*0\r\n",
    "nil array": b"*-1\r\n",
    "nested array": b"*3\r\n*1\r\n$1\r\nx\r\n$-1\r\n$-1\r\n",
    "array of integers": b"*3\r\n:1\r\n:2\r\n:3\r\n",
    "error inside an array": b"*3\r\n-ERR no\r\n$-1\r\n$-1\r\n",
    "simple string": b"+hello\r\n",
    "bulk string": b"$5\r\nhello\r\n",
    "RESP3 true": b"#t\r\n",
    "RESP3 double": b",1.5\r\n",
    "RESP3 map": b"%1\r\n+a\r\n:1\r\n",
    "RESP3 null": b"_\r\n",
    "error": b"-ERR nope\r\n",
    "malformed MOVED": b"-MOVED nonsense\r\n",
    "malformed ASK": b"-ASK 12 no-port-here\r\n",
    "hang-up mid-reply": b"$100\r\nabc" + HANG_UP,
    "hang-up before a reply": HANG_UP,
    "huge bulk length": b"$99999999999\r\n",
}


KINDS = ["redis", "redis-resp2", "cluster"]


def open_backend(kind: str, server: FakeServer) -> RedisBackend | RedisClusterBackend:
    if kind.startswith("redis"):
        url = server.url + ("?protocol=2" if kind == "redis-resp2" else "")
        return RedisBackend(url, timeout_s=0.3, backoff_s=0.01)
    return RedisClusterBackend(server.cluster_url, timeout_s=0.3, backoff_s=0.01,
                               refresh_s=0.0)


def calls(store: RedisBackend | RedisClusterBackend) -> dict[str, Callable[[], object]]:
    """Each batch call, with what it must answer when every reply is wrong."""
    return {
        "MGET": lambda: store.batch_get(KEYS) == [None] * 3,
        "GETRANGE": lambda: store.batch_get(KEYS, sizes=[10, 10, 10]) == [None] * 3,
        "EXISTS": lambda: store.batch_exists(KEYS) == [False] * 3,
        "SET": lambda: store.batch_set([(k, b"payload") for k in KEYS]) == [False] * 3,
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(BAD))
def test_a_wrong_reply_is_a_counted_miss_never_an_exception(fake, kind, name):
    fake.answer = lambda args: BAD[name]
    store = open_backend(kind, fake)
    try:
        for command, call in calls(store).items():
            time.sleep(0.02)  # past the back-off of a fault that opened a breaker
            before = sum(store.errors.values())
            assert call() is True, (command, dict(store.errors))
            assert sum(store.errors.values()) > before, (command, dict(store.errors))
    finally:
        store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_types_are_counted_as_bad_replies_and_good_replies_still_hit(fake, kind):
    """An integer for MGET, an array for EXISTS, an integer for SET: "bad_reply". The same
    store then serves well-formed replies as usual (nothing stuck)."""
    store = open_backend(kind, fake)
    fake.answer = lambda args: b":1\r\n" if args[0].upper() in (b"MGET", b"SET") else NIL3
    assert store.batch_get(KEYS) == [None] * 3
    assert store.batch_exists(KEYS) == [False] * 3
    assert store.batch_set([(KEYS[0], b"x")]) == [False]
    assert store.errors["bad_reply"] >= 3, dict(store.errors)
    blob = store.codec.encode(KEYS[1], b"page one")
    bulk = b"$%d\r\n%s\r\n" % (len(blob), blob)
    good = {b"MGET": b"*3\r\n$-1\r\n" + bulk + b"$-1\r\n", b"GETRANGE": bulk,
            b"EXISTS": b":1\r\n", b"SET": b"+OK\r\n"}
    fake.answer = lambda args: good[args[0].upper()]
    assert store.batch_get(KEYS) == [None, b"page one", None]
    assert store.batch_get(KEYS[1:2], sizes=[8]) == [b"page one"]
    assert store.batch_exists(KEYS) == [True] * 3
    assert store.batch_set([(KEYS[0], b"x")]) == [True]
    store.close()


def bulk(blob: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(blob), blob)


def test_one_bad_value_costs_the_reply_it_is_in(fake):
    """One server: an MGET array of the right length with one value of the wrong type is
    refused whole (the server is not answering as Redis does), counted once. A cluster
    pipeline: a bad GETRANGE reply misses its own key only, the others hit."""
    store = open_backend("redis", fake)
    blobs = {k: store.codec.encode(k, f"page {i}".encode()) for i, k in enumerate(KEYS)}
    fake.answer = lambda args: b"*3\r\n" + bulk(blobs[KEYS[0]]) + b":5\r\n$-1\r\n"
    assert store.batch_get(KEYS) == [None] * 3
    assert dict(store.errors) == {"bad_reply": 1}
    store.close()
    cluster = open_backend("cluster", fake)
    by_key = {cluster_key(k).encode(): bulk(blobs[k]) for k in KEYS}
    by_key[cluster_key(KEYS[1]).encode()] = b":5\r\n"
    fake.answer = lambda args: by_key[args[1]]
    assert cluster.batch_get(KEYS, sizes=[6] * 3) == [b"page 0", None, b"page 2"]
    assert dict(cluster.errors) == {"bad_reply": 1}
    cluster.close()


def test_a_cluster_redirection_is_a_miss_and_the_map_is_reread(fake):
    store = open_backend("cluster", fake)
    fake.answer = lambda args: b"-MOVED 3 127.0.0.1:%d\r\n" % fake.port
    assert store.batch_get(KEYS) == [None] * 3
    assert store.batch_set([(KEYS[0], b"x")]) == [False]
    assert store.errors["moved"] >= 2
    store.close()


@pytest.mark.parametrize("option", ["decode_responses=True", "decode_responses=false",
                                    "encoding=latin-1", "encoding_errors=ignore"])
def test_url_options_that_change_reply_types_are_refused(fake, option):
    """decode_responses turns every value into str (and "false" is a non-empty string,
    so it decodes too); encoding and encoding_errors change the bytes of every key."""
    name = option.partition("=")[0]
    with pytest.raises(ValueError, match=name):
        open_storage(f"{fake.url}?{option}")
    with pytest.raises(ValueError, match="option"):
        open_storage(f"{fake.cluster_url}?{option}")
    assert fake.commands == []


@pytest.mark.parametrize("options", ["protocol=2", "protocol=3&legacy_responses=false",
                                     "client_name=sr&health_check_interval=30"])
def test_url_options_that_keep_reply_types_are_accepted(fake, options):
    """The wire protocol does not change the replies this backend reads (MGET, GETRANGE,
    EXISTS, SET, SCAN, DEL); protocol=2 is what a server older than Redis 6 needs."""
    store = open_storage(f"{fake.url}?{options}")
    fake.answer = lambda args: NIL3
    assert store.batch_get(KEYS) == [None] * 3 and not store.errors
    store.close()


NO_RESP3 = {"no HELLO": b"-ERR unknown command 'HELLO'\r\n",
            "no protocol 3": b"-NOPROTO sorry, this protocol version is not supported\r\n"}


@pytest.mark.parametrize("refusal", list(NO_RESP3))
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_server_without_resp3_is_spoken_to_in_resp2(fake, kind, refusal):
    """redis-py 8 opens every connection with HELLO 3; a server older than Redis 6 answers
    that it knows no such command. redis-py 8.0 and 8.1 raise that out of the open (the
    backend reopens with protocol=2); 8.2 falls back to RESP2 by itself. Either way the
    store serves, and a connection dropped after a bad reply does not ask again."""
    fake.handshake[b"HELLO"] = NO_RESP3[refusal]
    hellos = []
    fake.handshake = _Counting(fake.handshake, hellos)
    store = open_backend(kind, fake)
    fake.answer = lambda args: NIL3
    opened = len(hellos)
    assert store.batch_get(KEYS) == [None] * 3 and not store.errors
    for _ in range(3):  # a bad reply drops the connections: the next call opens one
        fake.answer = lambda args: b":7\r\n"
        assert store.batch_get(KEYS) == [None] * 3
        fake.answer = lambda args: NIL3
        assert store.batch_get(KEYS) == [None] * 3
    assert len(hellos) == opened, "a connection after the open sent HELLO 3 again"
    store.close()


@pytest.mark.parametrize("refusal", list(NO_RESP3))
def test_a_url_that_asks_for_resp3_gets_the_refusal(fake, refusal):
    fake.handshake[b"HELLO"] = NO_RESP3[refusal]
    with pytest.raises(ValueError, match="protocol=2"):
        RedisBackend(fake.url + "?protocol=3", timeout_s=0.3)


class _Counting(dict):  # type: ignore[type-arg]
    """The handshake answers, noting each HELLO asked for."""

    def __init__(self, answers: dict[bytes, bytes], seen: list[bytes]) -> None:
        super().__init__(answers)
        self._seen = seen

    def __contains__(self, name: object) -> bool:
        if name == b"HELLO":
            self._seen.append(name)
        return super().__contains__(name)


def test_a_cluster_whose_acl_refuses_command_still_serves(fake):
    """redis-py's constructor reads the COMMAND table, which this backend never uses."""
    fake.handshake[b"COMMAND"] = b"-NOPERM this user has no permissions to run COMMAND\r\n"
    store = open_backend("cluster", fake)
    fake.answer = lambda args: b"+OK\r\n"
    assert store.batch_set([(KEYS[0], b"x")]) == [True] and not store.errors
    store.close()


def test_decode_responses_is_refused_before_it_can_break_a_read(redis_server):
    """With decode_responses, redis-py decodes every value as UTF-8: a stored object
    (binary) raised UnicodeDecodeError out of the read."""
    with pytest.raises(ValueError, match="decode_responses"):
        RedisBackend(redis_server.url + "?decode_responses=True")
    store = RedisBackend(redis_server.url)
    assert store.batch_set([(KEYS[0], bytes(range(256)))]) == [True]
    assert store.batch_get(KEYS[:1]) == [bytes(range(256))]
    store.close()


def test_an_engine_over_a_server_with_wrong_replies_stays_exact(fake):
    """Every probe says the page is stored, every read answers an integer: each request
    recomputes, exactly, and the faults are counted."""
    from test_engine import check, rand_tokens
    from tiny_model import tiny_model

    from shadowradix import CacheConfig, Engine, SamplingParams

    model = tiny_model()
    fake.answer = lambda args: {b"EXISTS": b":1\r\n", b"SET": b"+OK\r\n"}.get(
        args[0].upper(), b":7\r\n")
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                            storage=fake.url))
    prompt = rand_tokens(40, 140)
    r = eng.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True),
                     return_logits=True)[0]
    assert r.cached_by_tier["storage"] == 0
    check(model, prompt, r)
    eng.storage.drain()
    assert eng.stats()["storage_errors"] > 0
    eng.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_connection_left_a_reply_behind_is_dropped(fake, kind):
    """A server that answers one command twice leaves its connection out of step: each
    later call would read the one before's answer (a wrong key, every time). The backend
    drops a connection that read a wrong key or a bad reply, so the call after it is
    right. The extra reply comes with the next command's (ONE_BEHIND), so redis-py's own
    check for unread data when it hands a connection out cannot see it."""
    store = open_backend(kind, fake)
    keys = [object_key("ns", "p", bytes([i]) * 16) for i in range(3)]
    blobs = {cluster_key(k).encode() if kind == "cluster" else k.encode():
             bulk(store.codec.encode(k, b"page %d" % i)) for i, k in enumerate(keys)}
    sent = []

    def answer(args: list[bytes]) -> bytes:
        sent.append(args[1])
        reply = blobs[args[1]]
        return reply + ONE_BEHIND if len(sent) == 1 else reply  # the first one twice

    fake.answer = answer
    try:
        assert store.batch_get(keys[:1], [6]) == [b"page 0"]
        assert store.batch_get(keys[1:2], [6]) == [None]  # read the extra reply: wrong key
        assert store.errors["wrong_key"] == 1
        assert store.batch_get(keys[2:3], [6]) == [b"page 2"]  # a fresh connection
        assert store.batch_get(keys[1:2], [6]) == [b"page 1"]
        assert store.errors["wrong_key"] == 1
    finally:
        store.close()


def test_the_config_refuses_a_reply_changing_option_before_any_engine():
    from shadowradix import CacheConfig

    with pytest.raises(ValueError, match="decode_responses"):
        CacheConfig(storage="redis://127.0.0.1:1/0?decode_responses=True")
    CacheConfig(storage="redis://127.0.0.1:1/0?protocol=2")  # accepted
