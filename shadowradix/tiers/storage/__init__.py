"""L3 storage: keys, self-checking objects, and backends behind one batched interface."""

from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.codec import CorruptObject, WrongKey, decode, encode
from shadowradix.tiers.storage.file import FileBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes
from shadowradix.tiers.storage.redis import RedisBackend

__all__ = ["CorruptObject", "FileBackend", "RedisBackend", "StorageBackend",
           "StorageUnavailable", "WrongKey", "decode", "encode", "namespace", "object_key",
           "open_storage", "page_hashes"]


def open_storage(url: str, cap_bytes: int | None = None) -> StorageBackend:
    """A backend from a URL: `file:///dir` or `redis://[:password@]host:port/db` (Redis or
    Valkey). Raises ValueError for a URL it cannot use: another scheme, a file:// path
    that is an existing regular file, a server that refuses the password. A server that
    does not answer yet is only logged and counted (it may come up later)."""
    if not isinstance(url, str):
        raise ValueError(f"storage URL must be a str such as 'file:///var/cache/kv' or "
                         f"'redis://HOST:PORT/DB', got {type(url).__name__} {url!r}")
    if url.startswith("file://"):
        path = url.removeprefix("file://")
        if not path:
            raise ValueError(f"{url!r}: file:// needs a directory, e.g. file:///var/cache/kv")
        return FileBackend(path, cap_bytes)
    if url.startswith(("redis://", "rediss://")):
        if cap_bytes is not None:
            raise ValueError("cap_bytes applies to file:// storage only; cap Redis with "
                             "its maxmemory setting")
        return RedisBackend(url)
    raise ValueError(f"unsupported storage URL {url!r}; use file:///DIR or redis://HOST:PORT/DB")
