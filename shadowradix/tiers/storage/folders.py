"""The `file://` store's folders and objects, reached by file descriptor below its root.

Guarantee: nothing below the store's root is reached through a symlink. Each folder is
opened from its parent's descriptor with O_NOFOLLOW, and each object from its folder's,
so a symlink where a folder or object belongs raises `Symlink` instead of being
followed, and nothing is read, written or deleted outside the root. The root itself may
be a symlink (the operator's choice). Folders made here are 0700 and objects 0600,
whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from typing import TypeVar

_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root may be a symlink
_DIR = _ROOT | os.O_NOFOLLOW
_OBJECT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO: no wait
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
T = TypeVar("T")


class Symlink(OSError):
    """A symlink below the root where the store keeps one of its folders or objects."""


class Folders:
    """The store's folders during one call: the root, and below it folders opened from
    their parent's fd without following a symlink (Symlink instead). Namespace and pool
    folders stay open until `close`; a fan folder is opened for each use (`at`)."""

    def __init__(self, root: str, create: bool = False) -> None:
        try:
            self.root = os.open(root, _ROOT)
        except FileNotFoundError:
            if not create:
                raise
            _make_root(root)
            self.root = os.open(root, _ROOT)
        self._open: dict[str, int] = {}  # "NS" or "NS/POOL" -> fd

    def at(self, rel: str, fn: Callable[[int, str], T], create: bool = False) -> T:
        """fn(fd of object `rel`'s fan folder, the object's name), the folder made (0700,
        with its parents) if missing and `create`. FileNotFoundError if missing, Symlink
        if one is in the way."""
        ns, pool, fan, name = rel.split("/")
        parent = self._open.get(ns + "/" + pool)
        if parent is None:
            parent = self._cached(ns + "/" + pool, self._cached(ns, self.root, create), create)
        fd = subdir(parent, fan, create)
        try:
            return fn(fd, name)
        finally:
            close_folder(fd)

    def _cached(self, rel: str, parent: int, create: bool) -> int:
        fd = self._open.get(rel)
        if fd is None:
            fd = self._open[rel] = subdir(parent, os.path.basename(rel), create)
        return fd

    def close(self) -> None:
        """Close every folder; idempotent."""
        fds, self._open = [self.root, *self._open.values()], {}
        self.root = -1
        for fd in fds:
            if fd >= 0:
                close_folder(fd)

    def __enter__(self) -> Folders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subdir(parent: int, name: str, create: bool) -> int:
    """Folder `name` of `parent`, opened without following a symlink; with `create`,
    made 0700 if missing. FileNotFoundError if missing; Symlink if a symlink is there."""
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent, name):
            raise Symlink(errno.ELOOP, "a symlink where the store keeps a folder",
                          name) from None
        raise
    with contextlib.suppress(FileExistsError):
        _mkdir(name, parent)
    return subdir(parent, name, create=False)


def close_folder(fd: int) -> None:
    """Close a folder's fd. An error there (EIO, EINTR) says nothing of what was done in
    it, and Linux releases the fd anyway: it must not turn a write that was renamed into
    place into a failure the account and the caller never see."""
    with contextlib.suppress(OSError):
        os.close(fd)


def _make_root(root: str) -> None:
    """Make the root and its missing parents, 0700."""
    missing = []
    path = os.path.abspath(root)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            _mkdir(path, None)


def _mkdir(name: str, parent: int | None) -> None:
    """Make folder `name` 0700 whatever the umask (its mask applies to mkdir's mode)."""
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
    finally:
        close_folder(fd)


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


# ---------------------------------------------- objects, by name in their fan folder's fd
def mode_at(fan: int, name: str) -> int:
    """The mode of what is at `name`, a symlink's own."""
    return os.stat(name, dir_fd=fan, follow_symlinks=False).st_mode


def open_object(fan: int, name: str) -> int:
    """An fd reading object `name`; Symlink if a symlink is there (a FIFO: no wait)."""
    try:
        return os.open(name, _OBJECT, dir_fd=fan)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Symlink(errno.ELOOP, "a symlink where the store keeps an object",
                          name) from None
        raise


def read_upto(fd: int, limit: int) -> bytes:
    """`fd`'s bytes, at most `limit` (to its end if limit < 0), however short each read."""
    if limit < 0:
        limit = os.fstat(fd).st_size + 1  # an object never grows in place
    parts = []
    while limit > 0:
        part = os.read(fd, limit)
        if not part:
            break
        parts.append(part)
        limit -= len(part)
    return b"".join(parts)


def write_new(fan: int, name: str, blob: bytes) -> None:
    """Write `blob` to a new file `name` (0600) of folder `fan`; nothing is left on failure."""
    fd = os.open(name, _NEW, 0o600, dir_fd=fan)
    try:
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError:
        unlink_quietly(fan, name)
        raise


def size_at(fan: int, name: str) -> int:
    """Bytes of the regular file `name` (what the account counts for it); 0 if none."""
    try:
        st = os.stat(name, dir_fd=fan, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def unlink_sized(fan: int, name: str) -> int:
    """Delete `name`; the bytes the account counted for it."""
    size = size_at(fan, name)
    os.unlink(name, dir_fd=fan)
    return size


def unlink_quietly(fan: int, name: str) -> None:
    """Delete `name` if it can be; never raises."""
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=fan)
