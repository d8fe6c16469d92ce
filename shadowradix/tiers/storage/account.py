"""The bytes a `file://` store's objects take, shared by every process using it.

A per-process count lets two engines sharing a directory each fill it to the cap, so
the account lives in a small file next to the objects, read and rewritten under an
exclusive `flock`. Every change to the store's objects (write, replace, delete) is made
while holding it, so the count stays exact; a crash between a change and its account
update is repaired by the rescan a store does on open, and by `rescan` when it runs
out of objects it knows while the account still says the store is over its cap.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ACCOUNT_FILE = ".shadowradix-bytes"
_WIDTH = 20  # the count, ASCII, space padded: rewritten in place, never truncated


@dataclass
class Tally:
    """The store's byte count while the account is locked; changes are written back."""

    total: int


class SizeAccount:
    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, ACCOUNT_FILE)

    @contextmanager
    def locked(self) -> Iterator[Tally]:
        """Hold the account exclusively (blocks while another process holds it) and
        yield its count; whatever the body leaves in `total` is written back, even if
        the body raises. Raises OSError if the account cannot be opened."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, _WIDTH, 0).strip()
            tally = Tally(int(raw) if raw.isdigit() else 0)
            start = tally.total
            try:
                yield tally
            finally:
                if tally.total != start:
                    os.pwrite(fd, str(max(tally.total, 0)).encode().ljust(_WIDTH), 0)
        finally:
            os.close(fd)  # releases the lock
