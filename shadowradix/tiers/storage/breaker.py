"""A circuit breaker: after a store times out or is unreachable, skip it for a while.

Without one, every storage call against a stalled server waits out its own timeout, one
after another on the storage thread, and a request queued behind them waits for all of
them. With one, the first failure costs one bounded wait; the calls after it answer at
once (misses, failed writes) until the back-off ends, when one call probes the store
again. Each failed probe doubles the back-off, up to `max_backoff_s`; a success resets it.
A call that fails while the breaker is already open (it began before another call opened
it: the storage tier's read and write threads call at once) leaves the back-off as it is.
Safe to use from several threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, backoff_s: float = 5.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s}, "
                             f"{max_backoff_s}")
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._wait = backoff_s
        self._open_until: float | None = None  # None: closed, calls go through
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may go to the store now (closed, or the back-off is over and
        this call is the probe). Does not change state."""
        return self._open_until is None or self._clock() >= self._open_until

    def failed(self) -> None:
        """The store timed out or was unreachable: skip it for the next back-off (a probe
        that failed: twice the last one; a call that failed while the breaker was open
        already: no change)."""
        with self._lock:
            now = self._clock()
            if self._open_until is not None:
                if now < self._open_until:
                    return  # another call opened it meanwhile: counted once
                self._wait = min(self._wait * 2, self.max_backoff_s)  # a failed probe
            self._open_until = now + self._wait

    def succeeded(self) -> None:
        """The store answered: close the breaker and reset the back-off."""
        with self._lock:
            self._open_until = None
            self._wait = self.backoff_s

    @property
    def wait_s(self) -> float:
        """The current back-off: how long the last failure shuts the store out."""
        return self._wait

    @property
    def is_open(self) -> bool:
        return self._open_until is not None
