"""`file://DIR`: the embedded L3 default. One file per object, atomic writes, a size cap.

The directory may hold other things: the store only ever creates, reads and deletes
its own files, which are the objects `NS/POOL/XX/<32 hex digits>` (XX: the digest's
first two digits), their temporary files `<digest>.<random>.srtmp` beside them, and
the shared size account `.shadowradix-bytes` (see account.py).

Writes go to a temporary file and are renamed into place, so a reader never sees half
an object; a crash leaves a temporary file, swept on a later open once it is older
than STALE_TMP_S (a younger one may be another process's write in flight).

The cap holds across processes sharing the directory: every change is counted in the
shared account under its lock, and a write that takes the store past the cap deletes
objects, least recently used first in this process's view (seeded from file mtimes on
open, then its own reads and writes), until it fits.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from shadowradix.tiers.storage.account import SizeAccount, Tally
from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.keys import DIGEST, NAME, split_key

TMP_SUFFIX = ".srtmp"
STALE_TMP_S = 600.0
_FAN = re.compile(r"[0-9a-f]{2}")
_TMP = re.compile(r"[0-9a-f]{32}\.[A-Za-z0-9_]+" + re.escape(TMP_SUFFIX))


class FileBackend(StorageBackend):
    """Paths are plain strings on the hot path: building pathlib objects cost more than
    reading a 64 KiB object from the page cache.

    Raises ValueError if `root` is an existing regular file or `cap_bytes` < 1; any
    other trouble with the directory is counted and answered with misses."""

    def __init__(self, root: str | Path, cap_bytes: int | None = None,
                 secret: bytes | str | None = None) -> None:
        super().__init__(secret)
        if cap_bytes is not None and (not isinstance(cap_bytes, int) or cap_bytes < 1):
            raise ValueError(f"cap_bytes must be an int >= 1 or None, got {cap_bytes!r}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"file:// storage {str(root)!r} is an existing file, not a "
                             f"directory; name a directory (it is created if missing)")
        self._root = str(self.root)
        self.cap_bytes = cap_bytes
        self._account = SizeAccount(self._root)
        self._lru: OrderedDict[str, int] = OrderedDict()  # path -> size, oldest first
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._account.locked() as tally:
                self._rescan(tally, sweep=True)
        except OSError:
            self.errors["open"] += 1  # unusable now; every call below answers with misses

    def _path(self, key: str) -> str:
        ns, pool, digest = split_key(key)
        return os.path.join(self._root, ns, pool, digest[:2], digest)

    # -------------------------------------------------------------- reads
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.isfile(self._path(k)) for k in keys]

    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i, key in enumerate(keys):
            path = self._path(key)
            size = None if sizes is None else sizes[i]
            limit = -1 if size is None else self.codec.stored_size(key, size) + 1
            try:
                with open(path, "rb") as f:
                    blob = f.read(limit)  # at most one byte past the object's size
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError:
                self.errors["read"] += 1
                out.append(None)
                continue
            payload = self.verified(key, blob, size)
            if payload is None:
                self._drop(path)
            else:
                self._lru[path] = len(blob)  # another process's object joins our view
                self._lru.move_to_end(path)
            out.append(payload)
        return out

    # ------------------------------------------------------------- writes
    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        staged = [self._stage(key, payload) for key, payload in items]
        done = [False] * len(items)
        try:
            with self._account.locked() as tally:
                for i, (tmp, (key, _)) in enumerate(zip(staged, items, strict=True)):
                    if tmp is not None:
                        done[i] = self._commit(tmp, self._path(key), tally)
                if self.cap_bytes is not None and tally.total > self.cap_bytes:
                    self._shrink(tally, self.cap_bytes)
        except OSError:  # the account (so the directory) is unusable
            self.errors["write"] += sum(tmp is not None for tmp in staged)
            for tmp in staged:
                if tmp is not None:
                    _unlink_quietly(tmp)
            return [False] * len(items)
        return done

    def _stage(self, key: str, payload: bytes) -> str | None:
        """The object written to a temporary file beside its place; None if that failed."""
        path = self._path(key)
        parent, digest = os.path.split(path)
        tmp = None
        try:
            os.makedirs(parent, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=digest + ".", suffix=TMP_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(self.codec.encode(key, payload))
            return tmp
        except OSError:
            self.errors["write"] += 1
            if tmp is not None:
                _unlink_quietly(tmp)
            return None

    def _commit(self, tmp: str, path: str, tally: Tally) -> bool:
        """Rename into place (account locked), counting the bytes it adds."""
        try:
            size = os.stat(tmp).st_size
            old = _size_or_zero(path)
            os.replace(tmp, path)
        except OSError:
            self.errors["write"] += 1
            _unlink_quietly(tmp)
            return False
        tally.total += size - old
        self._lru.pop(path, None)
        self._lru[path] = size
        return True

    # ------------------------------------------------------------ deletes
    def clear(self, namespace: str) -> int:
        if not NAME.fullmatch(namespace):
            raise ValueError(f"{namespace!r} is not a storage namespace")
        gone, failed = 0, 0
        try:
            with self._account.locked() as tally:
                for path in self._own_files(os.path.join(self._root, namespace), temps=False):
                    self._lru.pop(path, None)
                    try:
                        size = _size_or_zero(path)
                        os.unlink(path)
                        tally.total -= size
                        gone += 1
                    except FileNotFoundError:
                        pass
                    except OSError:
                        failed += 1
        except OSError as e:
            raise StorageUnavailable(f"cannot clear {self._root!r}: {e}") from None
        if failed:
            self.errors["cleanup"] += failed
            raise StorageUnavailable(f"{failed} objects of {namespace} in {self._root!r} "
                                     f"could not be deleted; {gone} were")
        return gone

    def _shrink(self, tally: Tally, cap: int) -> None:
        """Delete least recently used objects until the store fits in `cap`; if this
        process knows too few, rescan the directory once for the others' objects."""
        rescanned = False
        while tally.total > cap:
            if not self._lru:
                if rescanned:
                    return
                self._rescan(tally, sweep=False)
                rescanned = True
                continue
            path, _ = self._lru.popitem(last=False)
            tally.total -= _unlink_counted(path, self.errors)

    def _drop(self, path: str) -> None:
        """Delete one bad object, keeping the account right."""
        self._lru.pop(path, None)
        try:
            with self._account.locked() as tally:
                tally.total -= _unlink_counted(path, self.errors)
        except OSError:
            self.errors["cleanup"] += 1

    # ------------------------------------------------------------ listing
    def _rescan(self, tally: Tally, sweep: bool) -> None:
        """Set the LRU (by mtime) and the account from the objects on disk; with `sweep`,
        delete temporary files older than STALE_TMP_S (left by a crashed writer)."""
        found = []
        stale = time.time() - STALE_TMP_S
        for path in self._own_files(self._root, temps=sweep):
            try:
                st = os.stat(path)
            except FileNotFoundError:  # a failed write's temporary file, just removed
                continue
            if path.endswith(TMP_SUFFIX):
                if st.st_mtime < stale:
                    _unlink_quietly(path)
            else:
                found.append((st.st_mtime_ns, path, st.st_size))
        self._lru = OrderedDict((path, size) for _, path, size in sorted(found))
        tally.total = sum(self._lru.values())

    def _own_files(self, top: str, temps: bool) -> Iterator[str]:
        """This store's files under `top` (the root, or one namespace directory): only
        paths shaped NS/POOL/XX/<digest> (and, with `temps`, its temporary files)."""
        levels = [NAME, NAME, _FAN] if top == self._root else [NAME, _FAN]
        dirs = [top]
        for pattern in levels:
            dirs = [d for parent in dirs for d in _subdirs(parent, pattern)]
        for fan in dirs:
            prefix = os.path.basename(fan)
            with contextlib.suppress(FileNotFoundError), os.scandir(fan) as it:
                for entry in it:
                    name = entry.name
                    ours = (DIGEST.fullmatch(name) and name.startswith(prefix)) or (
                        temps and _TMP.fullmatch(name))
                    if ours and entry.is_file(follow_symlinks=False):
                        yield entry.path

    @property
    def bytes_stored(self) -> int:
        """The store's bytes, every process's objects counted (from the shared account)."""
        with self._account.locked() as tally:
            return tally.total


def _subdirs(parent: str, pattern: re.Pattern[str]) -> list[str]:
    """Subdirectories of `parent` whose names fit `pattern` (symlinks not followed)."""
    try:
        with os.scandir(parent) as it:
            return [e.path for e in it
                    if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _unlink_counted(path: str, errors: dict[str, int]) -> int:
    """Delete `path`; the bytes freed (0 if another process deleted it first)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0
    except OSError:
        errors["cleanup"] += 1
        return 0


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
