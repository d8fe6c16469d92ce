"""`redis://host:port/db`: Redis or Valkey through redis-py (hiredis parser when present).

Batches are pipelined (one round trip per call). A deadline bounds each whole call
(deadline.py: however slowly a server trickles its reply), and a circuit breaker keeps a
dead or stalled server from costing one deadline per call: after one, every call answers
at once (misses, failed writes, counted as "skipped") until the back-off ends and one
call probes the server again.

Replies are checked against what each command answers (replies.py): one of the wrong
shape or type is a counted miss ("bad_reply"), never an exception. URL options that
change what redis-py returns are refused at construction (REPLY_OPTIONS): every key and
value this backend handles is raw bytes. The wire protocol is left to redis-py (RESP3 in
redis-py 8, RESP2 before): it does not change the replies read here. A server older
than Redis 6 refuses RESP3's handshake (HELLO): redis-py 8.2 then falls back to RESP2
by itself, and where redis-py 8.0 and 8.1 raise the refusal, the backend reopens with
`protocol=2`. Only a URL that asks for a protocol itself gets the refusal, as a
ValueError.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from shadowradix.tiers.storage import replies
from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.deadline import check_deadline
from shadowradix.tiers.storage.redis_common import (
    Guard,
    client_options,
    log,
    redact,
    refused_resp3,
    scan_delete,
    store_errors,
    unreachable_errors,
)

# redis-py options that change what a reply decodes to: str instead of the stored bytes
# (decode_responses: any value, as redis-py takes "false" for a true string), or other
# bytes for every key (encoding, encoding_errors), so other engines' objects are missed.
REPLY_OPTIONS = ("decode_responses", "encoding", "encoding_errors")


# Error replies of a server that may answer later (a replica cut off from its master, a
# busy script, a cluster still forming): at open, the server counts as unreachable.
TRANSIENT_REPLIES = frozenset({"MASTERDOWN", "LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN"})


def transient_reply(e: BaseException) -> bool:
    """Whether `e` is an error reply of a server that may answer later (TRANSIENT_REPLIES:
    redis-py names some by class and drops their code from the message)."""
    import redis.exceptions as errors

    return isinstance(e, errors.ClusterDownError | errors.TryAgainError) or (
        str(e).split(" ", 1)[0] in TRANSIENT_REPLIES)

# Options in seconds: redis-py takes any float and fails on each call with one it cannot
# use (inf, -1), which would read as a server's bad replies.
SECONDS_OPTIONS = ("socket_timeout", "socket_connect_timeout")
MAX_SECONDS = 86400  # a day: past ~9.2e9 s a socket cannot take it (time_t)


def check_url_options(url: str) -> None:
    """ValueError naming each query option of `url` that REPLY_OPTIONS refuses, or one in
    seconds (SECONDS_OPTIONS) that is not a number > 0 and at most MAX_SECONDS."""
    query = parse_qs(urlsplit(url).query)
    refused = [name for name in query if name in REPLY_OPTIONS]
    if refused:
        raise ValueError(f"{redact(url)}: the URL option {', '.join(refused)} changes what "
                         f"redis-py returns (storage keys and objects are raw bytes); "
                         f"remove it from the URL")
    for name in SECONDS_OPTIONS:
        for value in query.get(name, ()):
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds <= MAX_SECONDS:  # (nan compares False)
                raise ValueError(f"{redact(url)}: the URL option {name} must be a number of "
                                 f"seconds > 0 and at most {MAX_SECONDS}, got {value!r}")


class _NoResp3(Exception):
    """The server refused HELLO 3 on a URL that leaves the protocol to redis-py."""


class RedisBackend(StorageBackend):
    """Raises ValueError at construction for a URL option that changes the replies'
    types (REPLY_OPTIONS) or one redis-py does not know, or if the server refuses our
    credentials, or RESP3's handshake where the URL asks for a protocol; an unreachable
    server, or one whose replies make no sense, is only logged and counted (it may come
    up later)."""

    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None,
                 backoff_s: float = 5.0, secret: bytes | str | None = None,
                 deadline_s: float | None = None) -> None:
        super().__init__(secret)
        import redis

        check_url_options(url)
        self._errors_types = store_errors()
        self.ttl_s = ttl_s
        self.deadline_s = check_deadline(timeout_s if deadline_s is None else deadline_s)
        self.breaker = CircuitBreaker(backoff_s)
        self._guarded = Guard(self.errors, self.breaker, reset=self._drop_connections)
        self._open(url, timeout_s)
        try:
            self._ping(url, redis)
        except _NoResp3:
            log.warning("storage %s: the server refused RESP3's handshake (older than "
                        "Redis 6); speaking RESP2 to it", redact(url))
            self._open(url, timeout_s, protocol=2)
            self._ping(url, redis)

    def _open(self, url: str, timeout_s: float, **extra: Any) -> None:
        import redis

        try:
            self._client: Any = redis.Redis.from_url(url, **client_options(
                timeout_s, self.deadline_s, tls=url.startswith("rediss://")), **extra)
        except ValueError:  # its message may quote a part of the password
            raise ValueError(f"{redact(url)}: redis-py cannot read this URL; percent-encode "
                             f"'/', '?', '#', '@' and ':' in a user or password "
                             f"(redis://:PASSWORD@HOST:PORT/DB)") from None

    def _ping(self, url: str, redis: Any) -> None:
        """Raises _NoResp3 when the server refused the RESP3 handshake and the URL left
        the protocol to redis-py (the caller reopens with RESP2)."""
        try:
            self._client.ping()
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            self._client.close()
            raise ValueError(f"the server at {redact(url)} refused the credentials ({e}); "
                             f"put the right password in the URL: "
                             f"redis://:PASSWORD@HOST:PORT/DB") from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                self._client.close()
                raise ValueError(f"the server at {redact(url)} needs a password ({e}); use "
                                 f"redis://:PASSWORD@HOST:PORT/DB") from None
            if refused_resp3(e):
                self._client.close()
                if "protocol" not in parse_qs(urlsplit(url).query):
                    raise _NoResp3 from None
                raise ValueError(f"the server at {redact(url)} refused the RESP3 handshake "
                                 f"({e}); a server older than Redis 6 needs ?protocol=2 in "
                                 f"the URL") from None
            if transient_reply(e):  # it may answer later
                self._unreachable_at_open(url, e)
                return
            # It refused what the URL sets up (a DB index it does not have, a client name
            # with a space): retrying would never do better.
            self._client.close()
            raise ValueError(f"the server at {redact(url)} refused this URL's connection "
                             f"setup ({e}); check the DB index and the options") from None
        except unreachable_errors() as e:
            self._unreachable_at_open(url, e)
        except TypeError as e:
            if "unexpected keyword argument" not in str(e):
                raise
            self._client.close()
            raise ValueError(f"{redact(url)}: redis-py does not know an option of this URL "
                             f"({e})") from None
        except Exception as e:  # it answered, with nothing redis-py could read
            self._guarded.bad_reply(e)

    def breakers(self) -> list[CircuitBreaker]:
        return [self.breaker]

    def _unreachable_at_open(self, url: str, e: BaseException) -> None:
        self.errors["unreachable"] += 1
        self.breaker.failed()
        log.warning("storage %s unreachable at open (%s); reads miss and writes fail "
                    "until it answers", redact(url), e)

    def _drop_connections(self) -> None:
        """Close the idle connections (the one that read a bad reply is among them: its
        call has returned it); the next call opens a fresh one."""
        self._client.connection_pool.disconnect(inuse_connections=False)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def call() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [replies.flag(n) for n in replies.values(pipe.execute(), len(keys))]
        return self._guarded(call, [False] * len(keys))

    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        if not keys:
            return []
        if sizes is None:
            def call() -> list[bytes | None]:
                return replies.blobs(self._client.mget(list(keys)), len(keys))
        else:  # GETRANGE: at most one byte past each object's size leaves the server
            def call() -> list[bytes | None]:
                pipe = self._client.pipeline(transaction=False)
                for k, size in zip(keys, sizes, strict=True):
                    pipe.getrange(k, 0, self.codec.stored_size(k, size))
                return [replies.range_blob(r)
                        for r in replies.values(pipe.execute(), len(keys))]
        miss: list[bytes | None] = [None] * len(keys)
        blobs = self._guarded(call, miss)
        wrong = self.errors["wrong_key"]
        out = [None if blob is None else self.verified(k, blob, None if sizes is None
                                                       else sizes[i])
               for i, (k, blob) in enumerate(zip(keys, blobs, strict=True))]
        if self.errors["wrong_key"] > wrong:  # a swapped object, or a connection a reply
            self._drop_connections()          # behind (it would never catch up)
        return out

    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []

        def call() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k, payload in items:
                pipe.set(k, self.codec.encode(k, payload), ex=self.ttl_s)
            return [replies.stored(ok) for ok in replies.values(pipe.execute(), len(items))]
        return self._guarded(call, [False] * len(items))

    def clear(self, namespace: str) -> int:
        """SCAN for the namespace's keys and delete them in pipelined batches. Tries even
        while the breaker is open (an explicit request deserves a real answer); raises
        StorageUnavailable if the server did not answer (or answered nonsense)."""
        gone = 0
        try:
            for n in scan_delete(self._client, namespace,
                                 lambda batch: replies.count(self._client.delete(*batch))):
                gone += n
        except Exception as e:
            if isinstance(e, self._errors_types):
                self.errors["unreachable"] += 1
                self.breaker.failed()
            else:  # a reply of the wrong shape (BadReply, or one redis-py choked on)
                self._guarded.bad_reply(e)
            raise StorageUnavailable(f"the store did not answer ({e}); {gone} objects of "
                                     f"{namespace} deleted, others may remain") from None
        self.breaker.succeeded()
        return gone

    def close(self) -> None:
        with contextlib.suppress(*self._errors_types):
            self._client.close()
