"""`file://DIR`: the embedded L3 default. One file per object, atomic writes, a size cap.

Writes go to a temporary file in the same directory and are renamed into place, so a
reader never sees half an object (a crash leaves only a `.tmp` file, swept on open).
An in-memory LRU index (seeded from file mtimes on open) decides what goes when the
directory grows past `cap_bytes`: least recently used objects first.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from shadowradix.tiers.storage.backend import StorageBackend
from shadowradix.tiers.storage.codec import CorruptObject, decode, encode


class FileBackend(StorageBackend):
    """Paths are plain strings on the hot path: building pathlib objects cost more than
    reading a 64 KiB object from the page cache."""

    def __init__(self, root: str | Path, cap_bytes: int | None = None) -> None:
        super().__init__()
        if cap_bytes is not None and cap_bytes < 1:
            raise ValueError(f"cap_bytes must be >= 1 or None, got {cap_bytes}")
        self.root = Path(root)
        self._root = str(self.root)
        self.cap_bytes = cap_bytes
        self._lru: OrderedDict[str, int] = OrderedDict()  # path -> size, oldest first
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            found = []
            for dirpath, _, files in os.walk(self._root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if name.endswith(".tmp"):
                        os.unlink(path)
                    else:
                        st = os.stat(path)
                        found.append((st.st_mtime_ns, path, st.st_size))
            for _, path, size in sorted(found):
                self._lru[path] = size
        except OSError:
            self.errors["open"] += 1  # unusable now; every call below answers with misses
        self._bytes = sum(self._lru.values())

    def _path(self, key: str) -> str:
        ns, pool, digest = key.split("/")
        return os.path.join(self._root, ns, pool, digest[:2], digest)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.isfile(self._path(k)) for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        lru = self._lru
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    blob = f.read()
                out.append(decode(blob))
                if path in lru:
                    lru.move_to_end(path)
            except FileNotFoundError:
                out.append(None)
            except CorruptObject:
                self.errors["corrupt"] += 1
                self._drop(path)
                out.append(None)
            except OSError:
                self.errors["read"] += 1
                out.append(None)
        return out

    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        done = []
        for key, payload in items:
            path = self._path(key)
            blob = encode(payload)
            try:
                parent = os.path.dirname(path)
                os.makedirs(parent, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=parent, suffix=".tmp")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(blob)
                    os.replace(tmp, path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                self._bytes += len(blob) - self._lru.pop(path, 0)
                self._lru[path] = len(blob)
                done.append(True)
            except OSError:
                self.errors["write"] += 1
                done.append(False)
        if self.cap_bytes is not None and self._bytes > self.cap_bytes:
            self._shrink(self.cap_bytes)
        return done

    def clear(self, namespace: str) -> int:
        base = os.path.join(self._root, namespace) + os.sep
        gone = [path for path in self._lru if path.startswith(base)]
        for path in gone:
            self._drop(path)
        for dirpath, _, files in os.walk(base):  # objects another process wrote meanwhile
            for name in files:
                try:
                    os.unlink(os.path.join(dirpath, name))
                    gone.append(name)
                except OSError:
                    self.errors["cleanup"] += 1
        return len(gone)

    def _shrink(self, cap: int) -> None:
        """Delete least recently used objects until the directory fits in `cap`."""
        while self._bytes > cap and self._lru:
            self._drop(next(iter(self._lru)))

    def _drop(self, path: str) -> None:
        self._bytes -= self._lru.pop(path, 0)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            self.errors["cleanup"] += 1

    @property
    def bytes_stored(self) -> int:
        return self._bytes
