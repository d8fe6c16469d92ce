"""`redis://host:port/db`: Redis or Valkey through redis-py (hiredis parser when present).

Batches are pipelined (one round trip per call). A short socket timeout bounds each
call, and a circuit breaker keeps a dead or stalled server from costing one timeout per
call: after a timeout every call answers at once (misses, failed writes, counted as
"skipped") until the back-off ends and one call probes the server again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.breaker import CircuitBreaker
from shadowradix.tiers.storage.redis_common import (
    Guard,
    client_options,
    log,
    redact,
    scan_delete,
    store_errors,
    unreachable_errors,
)


class RedisBackend(StorageBackend):
    """Raises ValueError at construction if the server refuses our credentials; an
    unreachable server is only logged and counted (it may come up later)."""

    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None,
                 backoff_s: float = 5.0, secret: bytes | str | None = None) -> None:
        super().__init__(secret)
        import redis

        self._errors_types = store_errors()
        self.ttl_s = ttl_s
        self.breaker = CircuitBreaker(backoff_s)
        self._guarded = Guard(self.errors, self.breaker)
        try:
            self._client: Any = redis.Redis.from_url(url, **client_options(timeout_s))
        except ValueError:  # its message may quote a part of the password
            raise ValueError(f"{redact(url)}: redis-py cannot read this URL; percent-encode "
                             f"'/', '?', '#', '@' and ':' in a user or password "
                             f"(redis://:PASSWORD@HOST:PORT/DB)") from None
        self._ping(url, redis)

    def _ping(self, url: str, redis: Any) -> None:
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
            raise
        except unreachable_errors() as e:
            self.errors["unreachable"] += 1
            self.breaker.failed()
            log.warning("storage %s unreachable at open (%s); reads miss and writes fail "
                        "until it answers", redact(url), e)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def call() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        return self._guarded(call, [False] * len(keys))

    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        if not keys:
            return []
        if sizes is None:
            blobs: list[Any] = self._guarded(lambda: self._client.mget(list(keys)),
                                             [None] * len(keys))
        else:  # GETRANGE: at most one byte past each object's size leaves the server
            def call() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for k, size in zip(keys, sizes, strict=True):
                    pipe.getrange(k, 0, self.codec.stored_size(k, size))
                return [blob or None for blob in pipe.execute()]  # b"": no such key
            blobs = self._guarded(call, [None] * len(keys))
        return [None if blob is None else self.verified(k, blob, None if sizes is None
                                                        else sizes[i])
                for i, (k, blob) in enumerate(zip(keys, blobs, strict=True))]

    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []

        def call() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k, payload in items:
                pipe.set(k, self.codec.encode(k, payload), ex=self.ttl_s)
            return [bool(ok) for ok in pipe.execute()]
        return self._guarded(call, [False] * len(items))

    def clear(self, namespace: str) -> int:
        """SCAN for the namespace's keys and delete them in pipelined batches. Tries even
        while the breaker is open (an explicit request deserves a real answer); raises
        StorageUnavailable if the server did not answer."""
        gone = 0
        try:
            for n in scan_delete(self._client, namespace,
                                 lambda batch: int(self._client.delete(*batch))):
                gone += n
        except self._errors_types as e:
            self.errors["unreachable"] += 1
            self.breaker.failed()
            raise StorageUnavailable(f"the store did not answer ({e}); {gone} objects of "
                                     f"{namespace} deleted, others may remain") from None
        self.breaker.succeeded()
        return gone

    def close(self) -> None:
        with contextlib.suppress(*self._errors_types):
            self._client.close()
