"""`file://DIR`: the embedded L3 default. One file per object, atomic writes, a size cap.

The directory may hold other things: the store only ever creates, reads and deletes
its own files, which are the objects `NS/POOL/XX/<32 hex digits>` (XX: the digest's
first two digits), their temporary files `<digest>.<random>.srtmp` beside them, and
the shared size account `.shadowradix-bytes` (see account.py).

Nothing below the root is reached through a symlink (see folders.py), so a symlink
planted where a namespace, pool, fan folder or object belongs is a counted "symlink"
fault (a read misses, a write fails, a listing or delete passes it by) and nothing
lands, is read or is deleted outside the directory. The root itself may be a symlink
(the operator's choice). Folders the store creates are 0700 and objects 0600, whatever
the umask.

Writes go to a temporary file and are renamed into place, so a reader never sees half
an object; a crash leaves a temporary file, swept on a later open once it is older
than STALE_TMP_S (a younger one may be another process's write in flight).

The cap holds across processes sharing the directory: every change is counted in the
shared account under its lock, and a write that takes the store past the cap deletes
objects, least recently used first in this process's view (seeded from file mtimes on
open, then its own reads and writes), until it fits. An account that is stale (deleted,
rewritten, or left unwritten by a full disk) is recounted from the disk by its next
holder. A write's result is what a read finds: an object renamed into place is True
even if its count could not be written (the account is then left stale).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from shadowradix.tiers.storage.account import Refused, SizeAccount, Tally
from shadowradix.tiers.storage.backend import StorageBackend, StorageUnavailable
from shadowradix.tiers.storage.folders import (
    Folders,
    Symlink,
    close_folder,
    mode_at,
    open_object,
    read_upto,
    size_at,
    subdir,
    unlink_quietly,
    unlink_sized,
    write_new,
)
from shadowradix.tiers.storage.keys import DIGEST, NAME, split_key

TMP_SUFFIX = ".srtmp"
STALE_TMP_S = 600.0
_FAN = re.compile(r"[0-9a-f]{2}")
_TMP = re.compile(r"[0-9a-f]{32}\.[A-Za-z0-9_]+" + re.escape(TMP_SUFFIX))


class FileBackend(StorageBackend):
    """Paths are plain strings on the hot path: building pathlib objects cost more than
    reading a 64 KiB object from the page cache.

    Raises ValueError if `root` is an existing regular file or `cap_bytes` < 1; any
    other trouble with the directory is counted and answered with misses. A size
    account that is a symlink or not a regular file makes the store unusable until it
    is opened again: reads miss, writes fail, `clear` raises StorageUnavailable."""

    def __init__(self, root: str | Path, cap_bytes: int | None = None,
                 secret: bytes | str | None = None) -> None:
        super().__init__(secret)
        if cap_bytes is not None and (not isinstance(cap_bytes, int) or cap_bytes < 1):
            raise ValueError(f"cap_bytes must be an int >= 1 or None, got {cap_bytes!r}")
        self.root = Path(root)
        try:
            a_file = self.root.exists() and not self.root.is_dir()
        except OSError:  # trouble with the directory: counted below, not raised
            a_file = False
        if a_file:
            raise ValueError(f"file:// storage {str(root)!r} is an existing file, not a "
                             f"directory; name a directory (it is created if missing)")
        self._root = str(self.root)
        self.cap_bytes = cap_bytes
        self._account = SizeAccount(self._root, self.errors)
        self._lru = _Recency()  # this process's view of the objects, oldest first
        self._refused = False
        try:
            with (Folders(self._root, create=True) as dirs,
                  self._locked(dirs, recount=False) as tally):
                self._rescan(dirs, tally, sweep=True)
        except OSError:
            self.errors["open"] += 1  # calls below answer with misses while it stays so

    def _path(self, key: str) -> str:
        return os.path.join(self._root, _rel(key))

    # -------------------------------------------------------------- reads
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._dirs() as dirs:
            if dirs is None:
                return [False] * len(keys)
            return [self._is_object(dirs, _rel(k)) for k in keys]

    def batch_get(self, keys: Sequence[str],
                  sizes: Sequence[int] | None = None) -> list[bytes | None]:
        with self._dirs() as dirs:
            if dirs is None:
                return [None] * len(keys)
            out: list[bytes | None] = []
            for i, key in enumerate(keys):
                size = None if sizes is None else sizes[i]
                limit = -1 if size is None else self.codec.stored_size(key, size) + 1
                rel = _rel(key)
                blob = self._read(dirs, rel, limit)
                payload = None if blob is None else self.verified(key, blob, size)
                if blob is not None and payload is None:
                    self._drop(dirs, rel)
                elif blob is not None:
                    self._lru.touch(rel, len(blob))  # another process's object joins our view
                out.append(payload)
            return out

    def _is_object(self, dirs: Folders, rel: str) -> bool:
        try:
            mode = dirs.at(rel, mode_at)
        except OSError as e:
            self._count(e, None)
            return False
        if stat.S_ISLNK(mode):
            self.errors["symlink"] += 1
        return stat.S_ISREG(mode)

    def _read(self, dirs: Folders, rel: str, limit: int) -> bytes | None:
        """The object's bytes, at most `limit` (all if < 0); None if missing or unreadable."""
        try:
            fd = dirs.at(rel, open_object)
            try:
                return read_upto(fd, limit)
            finally:
                os.close(fd)
        except OSError as e:
            self._count(e, "read")
            return None

    # ------------------------------------------------------------- writes
    def batch_set(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        with self._dirs(create=True) as dirs:
            if dirs is None:
                self.errors["write"] += len(items)
                return [False] * len(items)
            staged = [self._stage(dirs, key, payload) for key, payload in items]
            return self._commit_all(dirs, staged)

    def _stage(self, dirs: Folders, key: str, payload: bytes) -> tuple[str, str, int] | None:
        """(object, temporary file, size): the object written beside its place; None if
        that failed."""
        rel = _rel(key)
        blob = self.codec.encode(key, payload)
        tmp = f"{rel[-32:]}.{os.urandom(6).hex()}{TMP_SUFFIX}"  # <digest>.<random>.srtmp
        try:
            dirs.at(rel, lambda fan, _: write_new(fan, tmp, blob), create=True)
        except OSError as e:
            self._count(e, "write")
            self._unstage(dirs, rel, tmp)
            return None
        return rel, tmp, len(blob)

    def _unstage(self, dirs: Folders, rel: str, tmp: str) -> None:
        """Delete a temporary file that will not be committed, if it is there: nothing
        the account does not count is left behind (a failure after it was written, or
        before its rename, would leave it until a sweep STALE_TMP_S later)."""
        with contextlib.suppress(OSError):
            dirs.at(rel, lambda fan, _: unlink_quietly(fan, tmp))

    def _commit_all(self, dirs: Folders, staged: list[tuple[str, str, int] | None]) -> list[bool]:
        """Rename the staged objects into place, counted, then keep the cap (account
        locked). True exactly where an object was renamed into place."""
        done = [False] * len(staged)
        try:
            with self._locked(dirs) as tally:
                for i, item in enumerate(staged):
                    if item is not None:
                        staged[i] = None
                        done[i] = self._commit(dirs, *item, tally)
                if self.cap_bytes is not None and tally.total > self.cap_bytes:
                    self._shrink(dirs, tally, self.cap_bytes)
        except OSError:  # the account is unusable: what is not renamed is not committed
            for item in staged:
                if item is not None:
                    self._discard(dirs, *item)
        return done

    def _discard(self, dirs: Folders, rel: str, tmp: str, _size: int) -> None:
        """A staged object not committed: its temporary file goes, counted "write"."""
        self.errors["write"] += 1
        self._unstage(dirs, rel, tmp)

    def _commit(self, dirs: Folders, rel: str, tmp: str, size: int, tally: Tally) -> bool:
        """Rename into place (account locked), counting the bytes it adds."""
        def rename(fan: int, name: str) -> int:
            try:
                old = size_at(fan, name)
                os.replace(tmp, name, src_dir_fd=fan, dst_dir_fd=fan)
            except OSError:
                unlink_quietly(fan, tmp)
                raise
            return old

        try:
            old = dirs.at(rel, rename)
        except OSError as e:  # not renamed (the fan folder failed to open, or the rename)
            self._count(e, "write")
            self._unstage(dirs, rel, tmp)
            return False
        tally.total += size - old
        self._lru.touch(rel, size)
        return True

    # ------------------------------------------------------------ deletes
    def clear(self, namespace: str) -> int:
        if not NAME.fullmatch(namespace):
            raise ValueError(f"{namespace!r} is not a storage namespace")
        gone, failed = 0, 0
        try:
            with Folders(self._root) as dirs, self._locked(dirs) as tally:
                for fan, folder, entry in self._entries(dirs, namespace, temps=False):
                    self._lru.forget(folder + entry.name)
                    try:
                        size = entry.stat(follow_symlinks=False).st_size
                        os.unlink(entry.name, dir_fd=fan)
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

    def _shrink(self, dirs: Folders, tally: Tally, cap: int) -> None:
        """Delete least recently used objects until the store fits in `cap`. If the
        account holds more over the cap than this process knows of, rescan first (once):
        the others' objects, or a wrong count, not a reason to delete all of ours."""
        rescanned = False
        while tally.total > cap:
            if not rescanned and tally.total - cap > self._lru.bytes:
                self._rescan(dirs, tally, sweep=False)
                rescanned = True
                continue
            rel = self._lru.oldest()
            if rel is None:
                return
            tally.total -= self._unlink(dirs, rel)

    def _drop(self, dirs: Folders, rel: str) -> None:
        """Delete one bad object, keeping the account right."""
        self._lru.forget(rel)
        try:
            with self._locked(dirs) as tally:
                tally.total -= self._unlink(dirs, rel)
        except OSError:
            self.errors["cleanup"] += 1

    def _unlink(self, dirs: Folders, rel: str) -> int:
        """Delete one object (account locked); the bytes freed (0 if already gone)."""
        try:
            return dirs.at(rel, unlink_sized)
        except OSError as e:
            self._count(e, "cleanup")
            return 0

    # ------------------------------------------------------------ listing
    def _rescan(self, dirs: Folders, tally: Tally, sweep: bool) -> None:
        """Set the LRU (by mtime) and the account from the objects on disk; with `sweep`,
        delete temporary files older than STALE_TMP_S (left by a crashed writer)."""
        found = []
        stale = time.time() - STALE_TMP_S
        for fan, folder, entry in self._entries(dirs, None, temps=sweep):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # a failed write's temporary file, just removed
                continue
            if entry.name.endswith(TMP_SUFFIX):
                if st.st_mtime < stale:
                    unlink_quietly(fan, entry.name)
            else:
                found.append((st.st_mtime_ns, folder + entry.name, st.st_size))
        self._lru = _Recency((rel, size) for _, rel, size in sorted(found))
        tally.total, tally.stale = self._lru.bytes, False

    def _entries(self, dirs: Folders, namespace: str | None,
                 temps: bool) -> Iterator[tuple[int, str, os.DirEntry[str]]]:
        """(fan folder fd, "NS/POOL/XX/", entry) of this store's files (of `namespace`
        only, if given): regular files named NS/POOL/XX/<digest> (and, with `temps`, its
        temporary files), reached without following a symlink."""
        top = NAME if namespace is None else re.compile(re.escape(namespace))
        for folder, fan in self._walk(dirs.root, "", [top, NAME, _FAN]):
            prefix = folder[-3:-1]
            with os.scandir(fan) as it:
                for entry in it:
                    name = entry.name
                    ours = (DIGEST.fullmatch(name) and name.startswith(prefix)) or (
                        temps and _TMP.fullmatch(name))
                    if ours and entry.is_file(follow_symlinks=False):
                        yield fan, folder, entry

    def _walk(self, parent: int, folder: str,
              levels: list[re.Pattern[str]]) -> Iterator[tuple[str, int]]:
        """("A/B/C/", fd) of each folder `len(levels)` below `parent` whose names fit the
        levels' patterns; a symlink fitting one below the root is counted, not followed."""
        if not levels:
            yield folder, parent
            return
        with os.scandir(parent) as it:
            names = [e.name for e in it if levels[0].fullmatch(e.name)
                     and (e.is_dir(follow_symlinks=False) or (folder and e.is_symlink()))]
        for name in names:
            try:
                fd = subdir(parent, name, create=False)
            except (FileNotFoundError, PermissionError):
                continue
            except Symlink:
                self.errors["symlink"] += 1
                continue
            try:
                yield from self._walk(fd, f"{folder}{name}/", levels[1:])
            finally:
                close_folder(fd)

    # ------------------------------------------------------------ the account
    @contextlib.contextmanager
    def _dirs(self, create: bool = False) -> Iterator[Folders | None]:
        """The store's folders for one call (closed after it); None if the store was
        refused or its root cannot be opened (the caller answers misses or failures)."""
        dirs = None
        if not self._refused:
            with contextlib.suppress(OSError):
                dirs = Folders(self._root, create)
        try:
            yield dirs
        finally:
            if dirs is not None:
                dirs.close()

    @contextlib.contextmanager
    def _locked(self, dirs: Folders, recount: bool = True) -> Iterator[Tally]:
        """The account held, recounted from the disk first if it is stale (unless not
        `recount`: the caller rescans). A refused account makes the store unusable."""
        if self._refused:
            raise OSError(errno.EPERM, "the store's size account was refused", self._root)
        try:
            with self._account.locked() as tally:
                if recount and tally.stale:
                    self._rescan(dirs, tally, sweep=False)
                yield tally
        except Refused:
            self._refused = True
            raise

    @property
    def bytes_stored(self) -> int:
        """The store's bytes, every process's objects counted (from the shared account,
        recounted if stale). Raises OSError if the account cannot be used."""
        with Folders(self._root) as dirs, self._locked(dirs) as tally:
            return tally.total

    def _count(self, e: OSError, kind: str | None) -> None:
        """Count a fault of `kind`, or "symlink". Something missing is no fault for a read
        (a miss) or a delete (already gone), but is one for a write."""
        if isinstance(e, Symlink):
            self.errors["symlink"] += 1
        elif kind == "write" or (kind is not None and not isinstance(e, FileNotFoundError)):
            self.errors[kind] += 1


class _Recency:
    """Objects ("NS/POOL/XX/<digest>") and their sizes, least recently used first, and
    their total bytes."""

    def __init__(self, items: Iterable[tuple[str, int]] = ()) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict(items)
        self.bytes = sum(self._sizes.values())

    def touch(self, rel: str, size: int) -> None:
        """Make `rel` the most recently used, `size` bytes."""
        self.bytes += size - self._sizes.pop(rel, 0)
        self._sizes[rel] = size

    def forget(self, rel: str) -> None:
        self.bytes -= self._sizes.pop(rel, 0)

    def oldest(self) -> str | None:
        """Remove and return the least recently used; None if empty."""
        if not self._sizes:
            return None
        rel, size = self._sizes.popitem(last=False)
        self.bytes -= size
        return rel


def _rel(key: str) -> str:
    """"NS/POOL/XX/<digest>": where key's object lives below the root."""
    ns, pool, digest = split_key(key)
    return f"{ns}/{pool}/{digest[:2]}/{digest}"
