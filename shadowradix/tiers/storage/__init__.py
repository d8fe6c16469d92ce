"""L3 storage: keys, self-checking objects, and backends behind one batched interface."""

from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.codec import Codec, CorruptObject, Forged, WrongKey, decode, encode
from shadowradix.tiers.storage.file import FileBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes
from shadowradix.tiers.storage.redis import RedisBackend
from shadowradix.tiers.storage.redis_cluster import RedisClusterBackend
from shadowradix.tiers.storage.urls import redact

__all__ = ["Codec", "CorruptObject", "FileBackend", "Forged", "RedisBackend",
           "RedisClusterBackend", "StorageBackend", "StorageUnavailable", "WrongKey", "decode",
           "encode", "namespace", "object_key", "open_storage", "page_hashes"]


def open_storage(url: str, cap_bytes: int | None = None,
                 secret: bytes | str | None = None) -> StorageBackend:
    """A backend from a URL: `file:///dir`, `redis://[:password@]host:port/db` (Redis or
    Valkey) or `redis-cluster://[:password@]host:port[,host:port...]` (seed nodes of a
    Redis or Valkey Cluster). Raises ValueError for a URL it cannot use: another scheme,
    a malformed one, a file:// path that is an existing regular file, a server that
    refuses the password, a cluster seed not in cluster mode. A store that does not
    answer yet is only logged and counted (it may come up later). `secret`: the store's
    shared secret, so every object is authenticated (see codec.py)."""
    if not isinstance(url, str):
        raise ValueError(f"storage URL must be a str such as 'file:///var/cache/kv' or "
                         f"'redis://HOST:PORT/DB', got a {type(url).__name__}")
    if url.startswith("file://"):
        path = url.removeprefix("file://")
        if not path:
            raise ValueError(f"{url!r}: file:// needs a directory, e.g. file:///var/cache/kv")
        return FileBackend(path, cap_bytes, secret=secret)
    if url.startswith(("redis://", "rediss://", "redis-cluster://")):
        if cap_bytes is not None:
            raise ValueError("cap_bytes applies to file:// storage only; cap Redis with "
                             "its maxmemory setting")
        if url.startswith("redis-cluster://"):
            return RedisClusterBackend(url, secret=secret)
        return RedisBackend(url, secret=secret)
    raise ValueError(f"unsupported storage URL {redact(url)!r}; use file:///DIR, "
                     f"redis://HOST:PORT/DB or redis-cluster://HOST:PORT[,HOST:PORT...]")
