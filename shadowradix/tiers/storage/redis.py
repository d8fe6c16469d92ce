"""`redis://host:port/db`: Redis or Valkey through redis-py (hiredis parser when present).

Batches are pipelined (one round trip per call). Short socket timeouts keep a dead or
slow server from stalling the engine: a timeout is a miss, counted in `errors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.codec import CorruptObject, decode, encode


class RedisBackend(StorageBackend):
    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: int | None = None) -> None:
        super().__init__()
        import redis

        self._errors_types: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.ttl_s = ttl_s
        self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                 socket_connect_timeout=timeout_s)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        except self._errors_types:
            self.errors["unreachable"] += 1
            return [False] * len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            blobs = self._client.mget(list(keys))
        except self._errors_types:
            self.errors["unreachable"] += 1
            return [None] * len(keys)
        out: list[bytes | None] = []
        for blob in blobs:
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(decode(blob))
            except CorruptObject:
                self.errors["corrupt"] += 1
                out.append(None)
        return out

    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, payload in items:
                pipe.set(k, encode(payload), ex=self.ttl_s)
            return [bool(ok) for ok in pipe.execute()]
        except self._errors_types:
            self.errors["unreachable"] += 1
            return [False] * len(items)

    def clear(self, namespace: str) -> int:
        """SCAN for the namespace's keys and delete them in pipelined batches."""
        gone = 0
        try:
            batch: list[Any] = []
            for key in self._client.scan_iter(match=f"{namespace}/*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    gone += int(self._client.delete(*batch))
                    batch = []
            if batch:
                gone += int(self._client.delete(*batch))
        except self._errors_types:
            self.errors["unreachable"] += 1
        return gone

    def close(self) -> None:
        with contextlib.suppress(*self._errors_types):
            self._client.close()
