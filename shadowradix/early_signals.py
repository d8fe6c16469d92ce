"""Signals that reach a long-running command while it starts, before it installs its own
handlers (its imports take a few hundred milliseconds): remembered instead of fatal, so
the command acts on them as on a later one (the fleet stops and exits 0).

Imports nothing heavy: `python -m shadowradix fleet` installs it first thing."""

from __future__ import annotations

import signal
from typing import Any

_received: list[int] = []


def catch(*signums: int) -> None:
    """Remember each of `signums` from now on, until a handler of the command's own."""
    def remember(signum: int, frame: Any) -> None:
        _received.append(signum)

    for s in signums:
        signal.signal(s, remember)


def received() -> list[int]:
    """The signals caught so far, in order."""
    return list(_received)
