"""A slow store (a real Valkey behind a proxy that trickles its bytes, or stalls) costs at
most one call deadline: the call is a counted miss, the breaker opens, no request waits
on another's read, and reads never queue behind writes."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import numpy as np
import pytest
from test_engine import rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.model.fingerprint import model_fingerprint
from shadowradix.tiers.storage import RedisBackend, RedisClusterBackend, object_key
from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.redis_cluster import cluster_key, slot_of
from shadowradix.tiers.storage_tier import StorageTier

P = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0)
DEADLINE = 0.5  # the backends' timeout_s here: the deadline of one whole call
SLACK = 1.0  # scheduling on a loaded 2-core machine
ENGINE_DEADLINE = 1.0  # what open_storage's backends use (timeout_s)
GIVE_UP = 4.0  # the proxy resets its connections then: code without deadlines waits this


class TrickleProxy:
    """127.0.0.1:<ephemeral port> -> 127.0.0.1:`target`, one thread per direction of each
    connection. `down` (server -> client) and `up` (client -> server) are "fast", "trickle"
    (`chunk` bytes every `interval` seconds) or "stall" (nothing passes); switch them at any
    time. `close()` drops every connection."""

    def __init__(self, target: int, chunk: int = 256, interval: float = 0.2) -> None:
        self.target = target
        self.chunk, self.interval = chunk, interval
        self.down = self.up = "fast"
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=1)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pipe, args=(src, dst, way), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        next_at = 0.0
        try:
            while not self._closed.is_set():
                if not select.select([src], [], [], 0.02)[0]:
                    continue
                mode = getattr(self, way)  # read once bytes wait: a switch applies at once
                if mode == "stall" or (mode == "trickle" and time.monotonic() < next_at):
                    time.sleep(0.005)
                    continue
                data = src.recv(self.chunk if mode == "trickle" else 1 << 16)
                if not data:
                    break
                dst.sendall(data)
                if mode == "trickle":
                    next_at = time.monotonic() + self.interval
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close_after(self, seconds: float) -> threading.Timer:
        """Bound a test against code without deadlines: the trickle ends in a reset."""
        timer = threading.Timer(seconds, self.close)
        timer.daemon = True
        timer.start()
        return timer

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def proxies():
    made: list[TrickleProxy] = []

    def make(target: int, **kw) -> TrickleProxy:
        made.append(TrickleProxy(target, **kw))
        return made[-1]
    yield make
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def key(i: int, pool: str = "c4") -> str:
    return object_key("ns", pool, i.to_bytes(16, "little"))


def timed(call, *args):
    t0 = time.monotonic()
    out = call(*args)
    return out, time.monotonic() - t0


# ------------------------------------------------------------------ (a) one backend call
@pytest.mark.parametrize("op", ["get", "set", "exists"])
def test_a_trickling_server_costs_one_deadline_then_answers_at_once(redis_server, proxies,
                                                                    op):
    """The server answers, 256 bytes every 0.2 s: each recv returns in time, so only a
    deadline over the whole call bounds it (before: the call lasted until the reply was
    through, here until the proxy gave up)."""
    n, size = (8, 8192) if op == "get" else (2000, 16)
    keys = [key(i) for i in range(n)]
    direct = RedisBackend(redis_server.url)
    assert all(direct.batch_set([(k, bytes([i % 251]) * size) for i, k in enumerate(keys)]))
    proxy = proxies(redis_server.port)
    store = RedisBackend(proxy.url, timeout_s=DEADLINE, backoff_s=60)
    proxy.down = "trickle"
    proxy.close_after(GIVE_UP)
    calls = {"get": lambda: store.batch_get(keys, [size] * n),
             "set": lambda: store.batch_set([(k, b"x" * size) for k in keys]),
             "exists": lambda: store.batch_exists(keys)}
    out, spent = timed(calls[op])
    assert spent < DEADLINE + SLACK, spent
    assert not any(out)  # misses and failed writes, never a wrong answer
    assert store.errors["unreachable"] == 1, store.errors
    assert store.breaker.is_open
    out, spent = timed(calls[op])  # the breaker: at once
    assert spent < 0.1 and not any(out) and store.errors["skipped"] == 1
    store.close()
    direct.close()


def _announce(cluster, i: int, port: int) -> None:
    """Node i tells clients to reach it on `port` (0: its own); waits until every node
    says so."""
    from valkey_cluster import _command

    _command(cluster.ports[i], "CONFIG", "SET", "cluster-announce-port", str(port))
    shown = f"127.0.0.1:{port or cluster.ports[i]}@".encode()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(shown in _command(p, "CLUSTER", "NODES", timeout=1) for p in cluster.ports):
            return
        time.sleep(0.05)
    raise RuntimeError("the cluster did not learn the announced port")


def _slots(cluster, i: int) -> list[tuple[int, int]]:
    from valkey_cluster import _command

    line = next(ln for ln in _command(cluster.ports[i], "CLUSTER", "NODES", timeout=1)
                .decode().splitlines() if "myself" in ln)
    return [(int(a), int(b)) for a, _, b in (r.partition("-") for r in line.split()[8:])]


def test_a_trickling_cluster_master_costs_one_deadline(valkey_cluster, proxies):
    """One master reached through the trickling proxy (it announces the proxy's port): its
    keys miss within the deadline, its breaker opens, the other masters' keys hit."""
    proxy = proxies(valkey_cluster.ports[0])
    _announce(valkey_cluster, 0, proxy.port)
    try:
        store = RedisClusterBackend(f"redis-cluster://127.0.0.1:{valkey_cluster.ports[1]}",
                                    timeout_s=DEADLINE, backoff_s=60)
        keys = [key(i) for i in range(30)]
        payloads = [bytes([i]) * 4096 for i in range(30)]
        assert all(store.batch_set(list(zip(keys, payloads, strict=True))))
        ranges = _slots(valkey_cluster, 0)
        proxied = [any(a <= slot_of(cluster_key(k)) <= b for a, b in ranges) for k in keys]
        assert 0 < sum(proxied) < len(keys)
        proxy.down = "trickle"
        proxy.close_after(GIVE_UP)
        got, spent = timed(store.batch_get, keys, [4096] * len(keys))
        assert spent < DEADLINE + SLACK, spent
        assert got == [None if p else payload for p, payload in zip(proxied, payloads,
                                                                     strict=True)]
        assert store.errors["unreachable"] == 1, store.errors
        got, spent = timed(store.batch_get, keys, [4096] * len(keys))  # its breaker: at once
        assert spent < 0.2 and store.errors["skipped"] == 1, (spent, store.errors)
        assert sum(b is not None for b in got) == len(keys) - sum(proxied)
        store.close()
    finally:
        _announce(valkey_cluster, 0, 0)


# ------------------------------------------------------------------ (b), (c) the engine
@pytest.fixture(scope="module")
def case(model):
    """(a prompt, its second turn, an unrelated 12-token prompt, the tokens an engine
    without storage answers the last two with)."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048))
    prompt = rand_tokens(75, 40)
    turn2 = prompt + eng.generate([prompt], P)[0].output_ids + rand_tokens(9, 99)
    other = rand_tokens(12, 98)
    eng.cache.flush(tiers=("device",))
    want = [r.output_ids for r in eng.generate([turn2, other], P)]
    eng.close()
    return prompt, turn2, other, want


def _store(model, url: str, prompt: list[int]) -> None:
    """An engine writes the prompt's pages through to `url`."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, storage=url))
    eng.generate([prompt], P)
    eng.close()


def _engine(model, url: str) -> Engine:
    """An engine on `url`, warmed up by a request too short to read anything (its first
    forward is slow)."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, storage=url))
    eng.generate([rand_tokens(8, 97)], P)
    return eng


def _run(eng: Engine, ids: list[str], t0: float) -> dict[str, tuple[float, list[int]]]:
    """Step until every id finished: its finish time (since t0) and its tokens."""
    done: dict[str, tuple[float, list[int]]] = {}
    while len(done) < len(ids):
        for out in eng.step():
            if out.finished:
                assert out.result is not None
                done[out.request_id] = (time.monotonic() - t0, out.result.output_ids)
    return done


def test_an_engine_behind_a_trickling_store_stays_prompt_and_exact(model, case, redis_server,
                                                                    proxies):
    """The reported defect: a request with a stored prefix and an unrelated 12-token one
    each took 53.5 s behind a trickling proxy, with storage_errors 0."""
    prompt, turn2, other, want = case
    _store(model, redis_server.url, prompt)
    proxy = proxies(redis_server.port)
    eng = _engine(model, proxy.url)
    proxy.down = "trickle"  # the stored pages (~52 KB) would take 40 s to come through
    proxy.close_after(15.0)
    t0 = time.monotonic()
    ids = [eng.add_request(turn2, P), eng.add_request(other, P)]
    done = _run(eng, ids, t0)
    assert [done[i][1] for i in ids] == want  # every token as without storage
    # Seconds of compute at most (the machine may be busy), not the 15 s of the trickle:
    assert done[ids[1]][0] < 5.0, done  # it needs no read: it never waits for one
    assert done[ids[0]][0] < ENGINE_DEADLINE + 5.0, done  # its own read: one deadline
    assert eng.stats()["storage_errors"] > 0
    eng.check_integrity()
    eng.close()


def test_an_unrelated_request_never_waits_for_another_ones_read(model, case, redis_server,
                                                                 proxies):
    """The store stalls completely while a request's read is in flight and nothing else
    runs: a request that needs no read is admitted and finishes meanwhile (before: the
    scheduler waited on the read whenever nothing ran)."""
    prompt, turn2, other, want = case
    _store(model, redis_server.url, prompt)
    proxy = proxies(redis_server.port)
    eng = _engine(model, proxy.url)
    proxy.down = "stall"
    t0 = time.monotonic()
    slow = eng.add_request(turn2, P)
    waiting = eng.scheduler.waiting[0]
    eng.step()  # its read starts and hangs (before: this step waited for the read)
    read = waiting.prefetch
    assert read is not None and not read.done()
    fast = eng.add_request(other, P)
    t_fast = time.monotonic()
    assert not read.done()
    first = eng.step()  # it is admitted and prefilled; the other still waits for its read
    assert [o.request_id for o in first] == [fast], (first, time.monotonic() - t0)
    done = _run(eng, [fast], t_fast)
    assert done[fast][0] < 5.0, done
    done.update(_run(eng, [slow], t0))
    assert [done[slow][1], done[fast][1]] == want
    assert done[slow][0] < ENGINE_DEADLINE + 5.0, done
    assert eng.stats()["storage_errors"] > 0
    eng.close()


# ------------------------------------------------------------------ (d) reads and writes
def test_a_read_does_not_queue_behind_a_slow_write(model, redis_server, proxies):
    """A write whose bytes trickle up to the server is in flight; a read submitted now
    comes back at once, with the stored pages (before: it waited for the write)."""
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=redis_server.url)
    eng = Engine.from_hf(model, cfg)
    stored = rand_tokens(75, 50)
    eng.generate([stored], P)
    eng.storage.drain()
    proxy = proxies(redis_server.port, chunk=4096, interval=0.2)
    tier = StorageTier(RedisBackend(proxy.url, timeout_s=5.0), eng._prefix,
                       model_fingerprint(model))
    names = eng.layout.pool_names
    proxy.up = "trickle"  # 4 pages of ~13 KB: about 2.6 s to get up there
    tier.save(np.asarray(rand_tokens(64, 51), dtype=np.int32), 0, 4,
              {n: np.arange(4) for n in names}, eng._prefix.tensor)
    time.sleep(0.1)  # the write is on the wire
    t0 = time.monotonic()
    fetched = tier.prefetch(np.asarray(stored, dtype=np.int32),
                            np.zeros((len(names), 0), dtype=np.int32), 4).result()
    spent = time.monotonic() - t0
    assert fetched.pages == 4
    assert tier.bytes_written == 0, spent  # the write is still trickling up
    assert spent < 2.0, spent
    proxy.up = "fast"
    tier.drain()  # waits for the write too
    assert tier.errors == 0 and tier.bytes_written > 0
    tier.close()
    eng.close()


# ------------------------------------------------------------------ attacks
def test_close_while_a_read_is_stalled_is_bounded(model, case, redis_server, proxies):
    """A request whose read hangs is aborted; closing the engine then waits for that read
    no longer than its deadline."""
    prompt, turn2, _, _ = case
    _store(model, redis_server.url, prompt)
    proxy = proxies(redis_server.port)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                            storage=proxy.url))
    proxy.down = "stall"
    rid = eng.add_request(turn2, P)
    eng.step()
    assert eng.scheduler.waiting[0].prefetch is not None
    eng.abort(rid)  # its read still hangs: the abort does not wait for it
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < ENGINE_DEADLINE + SLACK


def test_a_call_failing_while_the_breaker_is_open_does_not_lengthen_the_back_off():
    """The read and the write thread call at once: the second failure of one outage is
    not a failed probe (before: it doubled the back-off)."""
    now = [0.0]
    b = CircuitBreaker(backoff_s=2.0, max_backoff_s=8.0, clock=lambda: now[0])
    b.failed()  # the read's call opens it
    now[0] = 0.5
    b.failed()  # the write's, in flight since before
    assert b.wait_s == 2.0 and not b.allow()
    now[0] = 2.0
    assert b.allow()  # the probe, which fails: twice the wait
    b.failed()
    assert b.wait_s == 4.0 and not b.allow()
    now[0] = 6.0
    assert b.allow()
