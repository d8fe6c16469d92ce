"""L3 storage: keys, self-checking objects, and backends behind one batched interface."""

from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.codec import CorruptObject, decode, encode
from shadowradix.tiers.storage.file import FileBackend
from shadowradix.tiers.storage.keys import namespace, object_key, page_hashes
from shadowradix.tiers.storage.redis import RedisBackend

__all__ = ["CorruptObject", "FileBackend", "RedisBackend", "StorageBackend", "decode",
           "encode", "namespace", "object_key", "open_storage", "page_hashes"]


def open_storage(url: str, cap_bytes: int | None = None) -> StorageBackend:
    """A backend from a URL: `file:///dir` or `redis://host:port/db` (Redis or Valkey)."""
    if url.startswith("file://"):
        path = url.removeprefix("file://")
        if not path:
            raise ValueError(f"{url!r}: file:// needs a directory, e.g. file:///var/cache/kv")
        return FileBackend(path, cap_bytes)
    if url.startswith(("redis://", "rediss://")):
        return RedisBackend(url)
    raise ValueError(f"unsupported storage URL {url!r}; use file:///DIR or redis://HOST:PORT/DB")
