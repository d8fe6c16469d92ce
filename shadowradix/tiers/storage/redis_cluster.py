"""`redis-cluster://[:password@]host:port[,host:port...]`: Redis Cluster or Valkey Cluster.

The seed nodes only bootstrap: redis-py's RedisCluster reads the slot map from the first
that answers, and this backend sends each batch straight to the masters that own its
keys, one pipeline per master, all masters at once:

    keys --slot--> {master: {slot: [keys]}} --> one pipeline per master, in parallel
                   reads: one MGET per slot; probes and writes: EXISTS / SET per key

So no command ever names keys of two slots (the server would refuse it, CROSSSLOT), and
a batch costs one round trip however many slots it touches.

Hash tags. An object's cluster key is `ns/pool/{page-hash}`: the page hash is the tag,
so every pool's object of one page lands in one slot, on one master. A page is useful
only with all its pools' objects, and with them together a dead master takes away the
pages it owns (a third of them, of three masters) instead of nearly every page (a page
of five pools spread over three masters keeps all five with probability (2/3)^5 = 13%).
Load still spreads: page hashes are uniform, so pages spread over all slots. The object
itself still carries the plain key (`ns/pool/hash`) in its header, which is what a read
checks: a blob copied to another key's place is a miss, as with every backend.

Faults. Every call has a deadline over the whole call (deadline.py; the workers of one
call run under its deadline; no retries inside redis-py) and each
master has its own circuit breaker (see breaker.py): a master that is down, stalled or
failing over costs one bounded wait, then its keys miss at once ("skipped") while the
other masters keep serving theirs. A refusal (MOVED, ASK, CLUSTERDOWN, TRYAGAIN) is a
miss too, counted; after a refusal or an unreachable master the slot map is re-read
(at most once per `refresh_s`, trying the failed master last), so a failover or a
resharding is followed within a call or two. A reply of the wrong shape or type is a miss
on the keys it answers, counted "bad_reply" (see replies.py).

Start-up. Any one seed that answers is enough, whichever masters are down: redis-py's
RedisCluster asks one node for COMMAND while it is built, its default node (the master
of the first slot range), and with that master down the whole constructor failed, so
the store missed everything until it was back. Here COMMAND goes to the first node that
answers, and a master down at open costs its own slots only, like one that dies later.
A cluster older than Redis 6 refuses RESP3's handshake (HELLO): it is spoken to in RESP2.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar
from urllib.parse import unquote

from shadowradix.tiers.storage import replies
from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.deadline import carried, check_deadline
from shadowradix.tiers.storage.redis_common import (
    Guard,
    client_options,
    log,
    redact,
    refused_credentials,
    refused_resp3,
    scan_delete,
    store_errors,
    unreachable_errors,
)

SCHEME = "redis-cluster://"
T = TypeVar("T")
# node name -> (the node, slot -> indices into the batch of the keys in that slot)
Routes = dict[str, tuple[Any, dict[int, list[int]]]]
# queues one slot's commands on a pipeline; returns, per command, the indices it answers
Queue = Callable[[Any, list[int]], list[list[int]]]


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(seed nodes as (host, port), username, password) of a redis-cluster:// URL.
    Does not connect. ValueError naming what is wrong for a malformed URL."""
    usage = "use redis-cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]"
    if not isinstance(url, str) or not url.startswith(SCHEME):
        shown = redact(url) if isinstance(url, str) else f"a {type(url).__name__}"
        raise ValueError(f"{shown!r} is not a redis-cluster:// URL; {usage}")
    auth, _, hosts = url.removeprefix(SCHEME).rpartition("@")
    if "?" in hosts:
        raise ValueError(f"{redact(url)}: a redis-cluster:// URL takes no ?option (keys and "
                         f"objects are raw bytes, calls are bounded by the backend); {usage}")
    hosts, _, db = hosts.partition("/")
    if db not in ("", "0"):
        raise ValueError(f"{redact(url)}: a cluster has only database 0, got /{db}; {usage}")
    seeds: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [::1]:7000
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{redact(url)}: seed node {part.strip()!r} is not HOST:PORT; "
                             f"{usage}")
        seeds.append((host, int(port)))
    username, password = None, None
    if auth:
        user, colon, pw = auth.partition(":")
        username, password = (unquote(user) or None, unquote(pw)) if colon else (None,
                                                                               unquote(user))
    return seeds, username, password


@functools.cache
def client_class() -> Any:
    """redis-py's RedisCluster, built from any seed that answers (see the module
    docstring): its constructor's COMMAND goes to the default node, then to each other
    node in turn while they are unreachable, and the first that answers becomes the
    default node. Nothing else changes. Where every node that answered refused COMMAND
    (an ACL without it), the table is empty: this backend routes keys itself and sends
    commands to one node's client, so it never reads the table."""
    from redis.cluster import RedisCluster
    from redis.exceptions import ResponseError

    class Cluster(RedisCluster):
        def command(self, **kwargs: Any) -> Any:
            default = self.get_default_node()
            error: BaseException | None = None
            refused = False
            for node in [default, *(n for n in self.get_nodes() if n is not default)]:
                if node is None or node.redis_connection is None:
                    continue
                try:
                    table = node.redis_connection.command(**kwargs)
                except unreachable_errors() as e:
                    error = e
                    continue
                except ResponseError as e:  # it answers, and does not let us ask that
                    log.info("storage: node %s refused COMMAND (%s)", node.name, e)
                    refused = True
                    continue
                if node is not default:
                    self.set_default_node(node)
                return table
            if refused:
                return {}
            if error is None:
                return super().command(**kwargs)
            raise error

    return Cluster


def cluster_key(key: str) -> str:
    """Where `key` (ns/pool/hash) lives in the cluster: the page hash is the hash tag, so
    the pools of one page share a slot (see the module docstring)."""
    head, _, tail = key.rpartition("/")
    return f"{head}/{{{tail}}}" if head else f"{{{tail}}}"


def slot_of(stored_key: str | bytes) -> int:
    from redis.crc import key_slot

    return int(key_slot(stored_key.encode() if isinstance(stored_key, str) else stored_key))


class RedisClusterBackend(StorageBackend):
    """Raises ValueError at construction for a malformed URL, credentials the cluster
    refuses, or a seed that is not in cluster mode; an unreachable cluster is only
    logged and counted (it may come up later)."""

    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None,
                 backoff_s: float = 5.0, refresh_s: float = 1.0,
                 secret: bytes | str | None = None, deadline_s: float | None = None) -> None:
        super().__init__(secret)
        seeds, username, password = parse_cluster_url(url)
        self.url = redact(url)
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self.refresh_s = refresh_s
        self._seeds = seeds
        self.deadline_s = check_deadline(timeout_s if deadline_s is None else deadline_s)
        self._options = {"username": username, "password": password,
                         "require_full_coverage": False,
                         **client_options(timeout_s, self.deadline_s, seed=seeds[0])}
        self._faults = store_errors()
        self._guards: dict[str, Guard] = {}  # node name -> its breaker and counting
        self._cluster: Any = None  # redis.cluster.RedisCluster once a seed has answered
        self._topology = CircuitBreaker(backoff_s)  # for (re)connecting when there is none
        self._stale: str | None = None  # a node that failed or refused: re-read the map
        self._refreshed_at = time.monotonic()
        self._pool: ThreadPoolExecutor | None = None
        # The storage tier reads and writes from two threads: the client, the slot map's
        # refresh, the guards and the workers are made under one lock.
        self._lock = threading.RLock()
        self._connecting = False  # a thread is building the client (outside the lock)
        self._refreshing = False  # a thread is re-reading the slot map (outside the lock)
        self._connect(at_open=True)

    # ------------------------------------------------------------ topology
    def _connect(self, at_open: bool = False) -> bool:
        """Build the client from the seeds (reads the slot map). Raises ValueError only
        at open and only for a caller's mistake; otherwise counts and backs off."""
        from redis.cluster import ClusterNode

        try:
            self._cluster = client_class()(
                startup_nodes=[ClusterNode(h, p) for h, p in self._seeds], **self._options)
        except Exception as e:  # a fault, or a slot map redis-py could not read
            if at_open and refused_credentials(e):
                raise ValueError(f"the cluster at {self.url} refused the credentials ({e}); "
                                 f"put the right password in the URL: "
                                 f"redis-cluster://:PASSWORD@HOST:PORT,...") from None
            if at_open and "protocol" not in self._options and refused_resp3(e):
                log.warning("storage %s: the cluster refused RESP3's handshake (older than "
                            "Redis 6); speaking RESP2 to it", self.url)
                self._options["protocol"] = 2
                return self._connect(at_open)
            if at_open and "Cluster mode is not enabled" in str(e):
                raise ValueError(f"{self.url}: the seed is not in cluster mode; for a single "
                                 f"server use redis://HOST:PORT/DB") from None
            self.errors["unreachable"] += 1
            self._topology.failed()
            log.warning("storage %s unreachable%s (%s); reads miss and writes fail until "
                        "it answers", self.url, " at open" if at_open else "", e)
            return False
        self._topology.succeeded()
        self._refreshed_at = time.monotonic()
        return True

    def _ready(self) -> Any:
        """The client with a current slot map, or None (counted "skipped") when no seed
        answered lately. Re-reads the map after a fault, at most once per refresh_s.

        The lock is held only to decide: the connect or the re-read itself (up to a
        deadline per node) runs outside it, so the other storage thread never waits on
        it with its own call's deadline running. While a first connect is in flight, the
        other thread's call is a miss; while the map is re-read, it uses the old map."""
        with self._lock:
            if self._cluster is None:
                if self._connecting or not self._topology.allow():
                    self.errors["skipped"] += 1
                    return None
                self._connecting = True
                failed = None
            else:
                cluster = self._cluster
                if (self._stale is None or self._refreshing
                        or time.monotonic() - self._refreshed_at < self.refresh_s):
                    return cluster
                self._refreshed_at = time.monotonic()
                failed, self._stale = self._stale, None
                self._refreshing = True
        if failed is None:  # connect
            try:
                if not self._connect():
                    self.errors["skipped"] += 1
                    return None
                return self._cluster
            finally:
                self._connecting = False
        try:
            cluster.nodes_manager.initialize(last_failed_node_name=failed or None)
        except Exception as e:  # whatever it was: keep the old map, try again later
            self.errors["topology"] += 1
            self._stale = failed
            log.warning("storage %s: could not re-read the slot map (%s)", self.url, e)
        finally:
            self._refreshing = False
        return cluster

    def _guard(self, name: str) -> Guard:
        with self._lock:
            if name not in self._guards:
                self._guards[name] = Guard(self.errors, CircuitBreaker(self.backoff_s), name,
                                           reset=partial(self._drop_connections, name))
            return self._guards[name]

    def _drop_connections(self, name: str) -> None:
        """Close node `name`'s idle connections (after a reply it could not read)."""
        node = self._cluster.get_node(node_name=name) if self._cluster is not None else None
        if node is not None and node.redis_connection is not None:
            node.redis_connection.connection_pool.disconnect(inuse_connections=False)

    def _route(self, cluster: Any, stored: Sequence[str]) -> Routes:
        """Group the keys by master and, within one, by slot. A slot no master owns is
        left out (a miss), counted "uncovered"."""
        routes: Routes = {}
        cache = cluster.nodes_manager.slots_cache
        uncovered = False
        for i, key in enumerate(stored):
            slot = slot_of(key)
            owners = cache.get(slot)
            if not owners:
                uncovered = True
                continue
            node = owners[0]
            routes.setdefault(node.name, (node, defaultdict(list)))[1][slot].append(i)
        if uncovered:
            self.errors["uncovered"] += 1
            self._mark_stale()
        return routes

    # ------------------------------------------------------------ batches
    def _run(self, keys: Sequence[str], queue: Queue, parse: Callable[[list[int], Any], None],
             ) -> None:
        """For each master owning some of `keys`, one pipeline: `queue(pipe, indices)` per
        slot queues commands and returns, per command, the indices its reply answers;
        then `parse(indices, reply)` per reply. Masters run in parallel; a master's fault
        leaves its keys untouched (misses) and is counted once; a refused command (MOVED,
        CLUSTERDOWN, ...) or a reply `parse` refuses (BadReply) leaves its own keys
        untouched and is counted."""
        cluster = self._ready()
        if cluster is None:
            return
        routes = self._route(cluster, [cluster_key(k) for k in keys])

        def pipeline(node: Any, slots: dict[int, list[int]]) -> list[tuple[list[int], Any]]:
            pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
            answers = [idx for indices in slots.values() for idx in queue(pipe, indices)]
            got = replies.values(pipe.execute(raise_on_error=False), len(answers))
            return list(zip(answers, got, strict=True))

        pending: dict[str, Future[list[tuple[list[int], Any]]] | None] = {}
        for name, (node, slots) in routes.items():
            if not self._guard(name).breaker.allow():
                pending[name] = None  # its breaker is open: a miss at once
            else:  # one master: no thread hop
                pending[name] = (_now(pipeline, node, slots) if len(routes) == 1
                                 else self._workers().submit(carried(pipeline), node, slots))
        for name, fut in pending.items():
            if fut is None:
                self.errors["skipped"] += 1
                continue
            guard = self._guard(name)
            answered = guard(fut.result, None)
            if answered is None:
                if guard.breaker.is_open:
                    self._stale = name  # down or failing over: re-read who owns its slots
                continue
            self._parse(guard, answered, parse)

    def _parse(self, guard: Guard, answered: list[tuple[list[int], Any]],
               parse: Callable[[list[int], Any], None]) -> None:
        import redis

        bad: list[Exception] = []
        for indices, reply in answered:
            if isinstance(reply, redis.exceptions.AskError | redis.exceptions.TryAgainError):
                self.errors["moved"] += 1  # MOVED (a subclass of ASK) or a migration
                self._mark_stale()
            elif isinstance(reply, redis.exceptions.ClusterDownError):
                self.errors["cluster_down"] += 1
                self._mark_stale()
            elif isinstance(reply, Exception):
                self.errors["server"] += 1
                log.warning("storage error: %s", reply)
            else:
                try:
                    parse(indices, reply)
                except replies.BadReply as e:
                    bad.append(e)
        if bad:
            guard.bad_reply(bad[0], len(bad))

    def _mark_stale(self) -> None:
        if self._stale is None:
            self._stale = ""

    def _workers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(8, thread_name_prefix="shadowradix-cluster")
            return self._pool

    def breakers(self) -> list[CircuitBreaker]:
        return [guard.breaker for guard in list(self._guards.values())]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)

        def queue(pipe: Any, indices: list[int]) -> list[list[int]]:
            for i in indices:
                pipe.exists(cluster_key(keys[i]))  # EXISTS of many keys only counts them
            return [[i] for i in indices]

        def parse(indices: list[int], reply: Any) -> None:
            out[indices[0]] = replies.flag(reply)
        if keys:
            self._run(keys, queue, parse)
        return out

    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        blobs: list[bytes | None] = [None] * len(keys)

        def queue(pipe: Any, indices: list[int]) -> list[list[int]]:
            if sizes is None:
                pipe.mget([cluster_key(keys[i]) for i in indices])  # one slot: no CROSSSLOT
                return [indices]
            for i in indices:  # at most one byte past each object's size leaves the server
                pipe.getrange(cluster_key(keys[i]), 0, self.codec.stored_size(keys[i],
                                                                            sizes[i]))
            return [[i] for i in indices]

        def parse(indices: list[int], reply: Any) -> None:
            got = (replies.blobs(reply, len(indices)) if sizes is None
                   else [replies.range_blob(reply)])
            for i, blob in zip(indices, got, strict=True):
                blobs[i] = blob
        if keys:
            self._run(keys, queue, parse)
        wrong = self.errors["wrong_key"]
        out = [None if blob is None else self.verified(k, blob, None if sizes is None
                                                       else sizes[i])
               for i, (k, blob) in enumerate(zip(keys, blobs, strict=True))]
        if self.errors["wrong_key"] > wrong:  # a swapped object, or a connection a reply
            for name in list(self._guards):   # behind (it would never catch up): drop them
                self._drop_connections(name)
        return out

    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """SET replaces a key atomically, so engines writing the same page at once leave
        one whole object (either is that prefix's KV): concurrent writes are safe."""
        out = [False] * len(items)

        def queue(pipe: Any, indices: list[int]) -> list[list[int]]:
            for i in indices:
                key, payload = items[i]
                pipe.set(cluster_key(key), self.codec.encode(key, payload), ex=self.ttl_s)
            return [[i] for i in indices]

        def parse(indices: list[int], reply: Any) -> None:
            out[indices[0]] = replies.stored(reply)
        if items:
            self._run([k for k, _ in items], queue, parse)
        return out

    # ------------------------------------------------------------ clear
    def clear(self, namespace: str) -> int:
        """SCAN every master for the namespace's keys and delete them, one DEL per slot.
        Tries even where a breaker is open (an explicit request deserves a real answer);
        raises StorageUnavailable, after trying every master, if one did not answer (or
        answered nonsense)."""
        if self._cluster is None and not self._connect():
            raise StorageUnavailable(f"the cluster at {self.url} did not answer; nothing of "
                                     f"{namespace} deleted")
        self._mark_stale()  # scan the masters of now, not of the last map
        self._refreshed_at = float("-inf")
        cluster = self._ready()
        gone, failed = 0, []
        for node in cluster.get_primaries():
            client = cluster.get_redis_connection(node)
            try:
                for n in scan_delete(client, namespace, partial(_delete, client)):
                    gone += n
            except Exception as e:
                if isinstance(e, self._faults):
                    self.errors["unreachable"] += 1
                    self._guard(node.name).breaker.failed()
                else:  # a reply of the wrong shape (BadReply, or one redis-py choked on)
                    self._guard(node.name).bad_reply(e)
                failed.append(f"{node.name} ({e})")
                continue
            self._guard(node.name).breaker.succeeded()
        if failed:
            raise StorageUnavailable(f"masters {', '.join(failed)} did not answer; {gone} "
                                     f"objects of {namespace} deleted, others may remain")
        return gone

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._cluster is not None:
            with contextlib.suppress(*self._faults):
                self._cluster.close()


def _now(call: Callable[..., T], *args: Any) -> Future[T]:
    """`call(*args)` run here, as a finished Future (its exception kept for the guard)."""
    done: Future[T] = Future()
    try:
        done.set_result(call(*args))
    except Exception as e:  # re-raised by result(), inside the guard
        done.set_exception(e)
    return done


def _delete(client: Any, keys: list[bytes]) -> int:
    """Delete `keys` (all on this node) with one DEL per slot, in one pipeline."""
    by_slot: dict[int, list[bytes]] = defaultdict(list)
    for k in keys:
        by_slot[slot_of(k)].append(k)
    pipe = client.pipeline(transaction=False)
    for group in by_slot.values():
        pipe.delete(*group)
    return sum(replies.count(n) for n in replies.values(pipe.execute(), len(by_slot)))
