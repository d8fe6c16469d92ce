"""The bytes a `file://` store's objects take, shared by every process using it.

A per-process count lets two engines sharing a directory each fill it to the cap, so
the account lives in a small file next to the objects, read and rewritten under an
exclusive `flock`. Every change to the store's objects (write, replace, delete) is made
while holding it, so the count stays exact; a crash between a change and its account
update is repaired by the rescan a store does on open, and by the rescan it does when
the count says the store is further over its cap than the objects it knows.

The count is trusted only as a store wrote it. It is *stale* (`Tally.stale`: its holder
recounts the objects on disk) when it is empty or not in the store's own format
(rewritten, or never written), when the file is not the one this process held last
(deleted, replaced), and after a holder found the file moved while it held it (its
changes were made under a lock the new file's holder did not see). A count that cannot
be written (a full disk) empties the file, so the next holder recounts; it is never
left claiming what the disk does not hold.

The account is opened without following a symlink and must be a regular file of one
name: a symlink, a hard link, a FIFO or a folder there is `Refused`, and the store must
not be used (no count is written through a link).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

ACCOUNT_FILE = ".shadowradix-bytes"
_WIDTH = 20  # the count, ASCII, space padded: rewritten in place
_FORMAT = re.compile(rb"[0-9]{1,20} *")
_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TRIES = 16  # the file replaced this many times while waiting for its lock: give up


class Refused(OSError):
    """The account is a symlink, or not a regular file of its own (a hard link, a FIFO,
    a folder): the store must not be used. `kind`: "symlink" or "account"."""

    def __init__(self, path: str, kind: str) -> None:
        what = "a symlink" if kind == "symlink" else "not a regular file of its own"
        super().__init__(errno.EPERM, f"the size account is {what}; refusing the store", path)
        self.kind = kind


@dataclass
class Tally:
    """The store's byte count while the account is locked; changes are written back.
    `stale`: the count cannot be trusted; recount, then clear it. If it is still set at
    the end, the file is emptied so that the next holder recounts."""

    total: int
    stale: bool = False


class SizeAccount:
    """`errors`: where faults are counted ("account": a count that could not be written;
    "symlink" and "account" for a refusal)."""

    def __init__(self, root: str, errors: Counter[str]) -> None:
        self.path = os.path.join(root, ACCOUNT_FILE)
        self._errors = errors
        self._held: tuple[int, int] | None = None  # (device, inode) this process last held

    @contextmanager
    def locked(self) -> Iterator[Tally]:
        """Hold the account exclusively (blocks while another process holds it) and
        yield its count; whatever the body leaves in `total` is written back, even if
        the body raises. Raises OSError (Refused: not a regular file) if the account
        cannot be opened or read; never once the body has run."""
        fd, ident = self._lock()
        moved = False
        try:
            tally = self._read(fd, ident)
            start = tally.total
            try:
                yield tally
            finally:
                if tally.stale or tally.total < 0:  # not recounted, or counted wrong
                    self._forget(fd, ident)
                elif tally.total != start:
                    self._write(fd, ident, tally.total)
                self._held = ident
                moved = _ident_at(self.path) != ident
        finally:
            os.close(fd)  # releases the lock
            if moved:  # only now: the file at the path may be this one (a failed lstat),
                self._invalidate()  # whose lock a second fd of ours would wait for forever

    def _lock(self) -> tuple[int, tuple[int, int]]:
        """An fd of the file now at the path, locked, and its identity. A file deleted or
        replaced while we waited for its lock is left for the one now there."""
        for _ in range(_TRIES):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            ident = (st.st_dev, st.st_ino)
            if _ident_at(self.path) == ident:
                return fd, ident
            os.close(fd)
        raise OSError(errno.EAGAIN, "the size account keeps being replaced", self.path)

    def _open(self) -> int:
        """The account's fd, never through a symlink and only of a regular file (a FIFO
        opens without blocking, then is refused)."""
        try:
            fd = os.open(self.path, _OPEN, 0o600)
        except OSError:
            st = _lstat(self.path)  # a symlink (ELOOP) or a folder (EISDIR) there: refused
            if st is not None:
                self._refuse_unless_regular(st.st_mode)
            raise
        try:
            st = os.fstat(fd)
            self._refuse_unless_regular(st.st_mode, st.st_nlink)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _refuse_unless_regular(self, mode: int, links: int = 1) -> None:
        """Raise Refused (counted) unless a regular file of one name (not a hard link to
        a file elsewhere, which writing the count would overwrite; 0 links: just deleted,
        which `_lock` sees)."""
        if not stat.S_ISREG(mode) or links > 1:
            kind = "symlink" if stat.S_ISLNK(mode) else "account"
            self._errors[kind] += 1
            raise Refused(self.path, kind)

    def _read(self, fd: int, ident: tuple[int, int]) -> Tally:
        raw = os.pread(fd, _WIDTH + 1, 0)
        if len(raw) != _WIDTH or not _FORMAT.fullmatch(raw):
            return Tally(0, stale=True)
        return Tally(int(raw), stale=self._held is not None and self._held != ident)

    def _write(self, fd: int, ident: tuple[int, int], total: int) -> None:
        try:
            os.pwrite(fd, str(total).encode().ljust(_WIDTH), 0)
            if os.fstat(fd).st_size != _WIDTH:  # junk after it would make it stale forever
                os.ftruncate(fd, _WIDTH)
        except OSError:
            self._errors["account"] += 1
            self._forget(fd, ident)

    def _forget(self, fd: int, ident: tuple[int, int]) -> None:
        """Leave the file for the next holder to recount: empty it, or failing that,
        delete it (a new one is made empty)."""
        try:
            os.ftruncate(fd, 0)
        except OSError:
            if _ident_at(self.path) == ident:
                with suppress(OSError):
                    os.unlink(self.path)

    def _invalidate(self) -> None:
        """The file at the path is not the one held: empty it, under its own lock."""
        with suppress(OSError):
            fd, _ = self._lock()
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:  # nothing there (or nothing this process can see)
        return None


def _ident_at(path: str) -> tuple[int, int] | None:
    """(device, inode) of what is at `path` (a symlink's own), None if nothing is."""
    st = _lstat(path)
    return None if st is None else (st.st_dev, st.st_ino)
