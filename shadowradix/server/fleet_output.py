"""The fleet's stderr: its children's output forwarded line by line through a bounded
buffer and a writer thread of its own, so that a reader that stalls or goes away costs
lines (counted), never a child blocked on its own log."""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import IO

LINE_BYTES = 64 * 1024  # a longer line of a child's output is forwarded in pieces
OUTPUT_ROOM = 4 * 1024 * 1024  # bytes of the children's lines waiting for our stderr


@dataclass(slots=True)
class _Gap:
    """Where children's lines were dropped for want of room in the buffer: how many."""

    lines: int = 1


class Output:
    """The fleet's stderr, written by a thread of its own straight to the file descriptor,
    so that a reader that stalls or goes away (`| head`, a killed `tee`) never blocks the
    fleet or stops it reading a child: the children's lines wait in a bounded buffer, and
    those that do not fit or cannot be written are dropped and counted (`dropped`; where
    lines did not fit, a note in their place says how many). The fleet's own messages
    always wait their turn (they are few)."""

    def __init__(self, fd: int, room: int = OUTPUT_ROOM) -> None:
        self.fd = fd
        self.room = room
        self.dropped = 0
        self._queue: deque[tuple[bytes, bool] | _Gap] = deque()  # (line, from a child)
        self._waiting = 0  # bytes of children's lines queued
        self._writing = False
        self._changed = threading.Condition()
        threading.Thread(target=self._write_all, name="fleet-output", daemon=True).start()

    def child_line(self, line: bytes) -> None:
        """Queue one line of a child's output, or drop it if the buffer is full; never
        waits for the reader."""
        with self._changed:
            if self._waiting + len(line) <= self.room:
                self._waiting += len(line)
                self._queue.append((line, True))
            elif self._queue and isinstance(gap := self._queue[-1], _Gap):
                gap.lines += 1
                self.dropped += 1
            else:
                self._queue.append(_Gap())
                self.dropped += 1
            self._changed.notify_all()

    def say(self, message: str) -> None:
        """Queue one of the fleet's own lines, `shadowradix: MESSAGE`, whatever the room."""
        with self._changed:
            self._queue.append((f"shadowradix: {message}\n".encode(errors="replace"), False))
            self._changed.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until everything queued is written (or dropped);
        False if the reader still holds it up."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._writing,
                                          timeout)

    def _write_all(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue))
                entry = self._queue.popleft()
                self._writing = True
            if isinstance(entry, _Gap):
                line, from_child = (f"shadowradix: fleet: {entry.lines} lines of the "
                                    "children's output dropped here (stderr was not read)\n"
                                    ).encode(), False
            else:
                line, from_child = entry
            written = self._write(line)
            with self._changed:
                if from_child:
                    self._waiting -= len(line)
                    self.dropped += not written
                self._writing = False
                self._changed.notify_all()

    def _write(self, data: bytes) -> bool:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            return True
        except OSError:  # BrokenPipeError: nobody reads our stderr any more
            return False


def forward(stream: IO[bytes], prefix: bytes, output: Output,
            seen: Callable[[bytes], None]) -> None:
    """Read a child's output to its end, always (a child blocked on a full pipe would stop
    answering while it looks alive): `seen(line)`, then the line, `prefix` before it, to
    `output`."""
    for line in iter(partial(stream.readline, LINE_BYTES), b""):
        seen(line)
        output.child_line(prefix + line.rstrip(b"\n") + b"\n")


def stderr_fd() -> int:
    """The file descriptor of the fleet's stderr for `Output`."""
    if sys.stderr is None:  # started with fd 2 closed: it may be reused by any file since
        return os.open(os.devnull, os.O_WRONLY)
    try:
        return sys.stderr.fileno()
    except (OSError, ValueError):  # replaced by an object with no file (io.StringIO)
        return 2
