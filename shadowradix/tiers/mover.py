"""Asynchronous page copies between the device and host pools, in submission order.

Every copy gets a ticket; tickets complete in order, so waiting for ticket t
waits for everything submitted before it. The caller never blocks on submit.

    ThreadMover  CPU pools: a worker thread runs the copies (torch releases the
                 GIL inside them, so they overlap the model's forward).
    StreamMover  CUDA pools: copies go on a dedicated stream after the work
                 already queued on the compute stream; `wait` makes the compute
                 stream wait on an event, and never blocks the CPU.

A copy is (pool, source tier, source pages, destination pages); the other tier
is the destination. `tensor(pool, tier)` resolves a pool's [layers, pages, ...]
tensor. A run of consecutive pages moves as one slice, no gather buffer: on CPU
one slice across the layers, the slices of a copy spread over a few threads (one
thread reaches about half of the memory bandwidth); on CUDA one slice per layer,
so that every host-device copy is contiguous and truly asynchronous.

A copy that fails (ThreadMover) never wedges the mover: it and everything queued behind
it until the owner collects it (`failures`) are void, since a later copy may read what
the failed one should have written. The owner (HostTier) knows what each ticket wrote and
forgets those pages; then the mover runs copies again.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

Copy = tuple[str, int, np.ndarray, np.ndarray]
Tensors = Callable[[str, int], torch.Tensor]
Failure = tuple[int, BaseException | None]  # (ticket, its error; None: voided behind one)


def page_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both page lists step by one."""
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def page_moves(tensor: Tensors, copies: Sequence[Copy],
               per_layer: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) slice pairs that together perform `copies`."""
    moves = []
    for pool, tier, src_pages, dst_pages in copies:
        src, dst = tensor(pool, tier), tensor(pool, 1 - tier)
        for s, d, n in page_runs(np.asarray(src_pages), np.asarray(dst_pages)):
            if per_layer:
                moves += [(dst[layer, d:d + n], src[layer, s:s + n])
                          for layer in range(src.shape[0])]
            else:
                moves.append((dst[:, d:d + n], src[:, s:s + n]))
    return moves


def copy_pages(tensor: Tensors, copies: Sequence[Copy], non_blocking: bool = False,
               pool: ThreadPoolExecutor | None = None, workers: int = 1) -> int:
    """Do the copies now (on the current stream, or spread over `pool`); returns the
    bytes moved."""
    moves = page_moves(tensor, copies, per_layer=non_blocking)

    def run(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in part:
            dst.copy_(src, non_blocking=non_blocking)

    if pool is None or workers < 2 or len(moves) < 2:
        run(moves)
    else:
        list(pool.map(run, [moves[i::workers] for i in range(workers)]))
    return sum(src.numel() * src.element_size() for _, src in moves)


class Mover:
    """Ordered asynchronous copies. `submit` returns a ticket; 0 is always done."""

    def __init__(self, tensor: Tensors) -> None:
        self.tensor = tensor
        self.last = 0  # the newest ticket handed out
        self.bytes_moved = 0

    def submit(self, copies: Sequence[Copy]) -> int:
        raise NotImplementedError

    def run(self, fn: Callable[[], None]) -> int:
        """Run `fn` (host-side work on pool tensors) after everything submitted so far."""
        raise NotImplementedError

    def done(self, ticket: int) -> bool:
        raise NotImplementedError

    def wait(self, ticket: int) -> None:
        """Make the compute that follows see the result of `ticket` and all before it.
        Never raises for a failed copy: `failures` reports it."""
        raise NotImplementedError

    def failures(self, ticket: int) -> list[Failure]:
        """Once `ticket` is done: the tickets whose work did not happen, each reported once
        (with nothing still queued behind them), after which copies run again. [] here:
        a mover whose copies cannot fail on their own thread (StreamMover: a CUDA fault
        surfaces as a CUDA error on the compute stream, not as a ticket)."""
        return []

    @property
    def idle(self) -> bool:
        return self.done(self.last)

    def close(self) -> None:
        """Finish what was submitted and release the worker."""


class ThreadMover(Mover):
    """Copies on a worker thread. A failed copy voids itself and the work queued behind it
    until `failures` collects them; nothing raises on the scheduler's side."""

    def __init__(self, tensor: Tensors, workers: int | None = None) -> None:
        super().__init__(tensor)
        self.workers = workers or min(4, os.cpu_count() or 1)
        self._pool = (ThreadPoolExecutor(self.workers, thread_name_prefix="shadowradix-copy")
                      if self.workers > 1 else None)
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._finished = 0
        self._cond = threading.Condition()
        self._failed: list[Failure] = []  # appended by the worker before `_finished` moves
        self._failing = False  # the worker voids work until `failures` collects
        self._thread = threading.Thread(target=self._work, name="shadowradix-mover", daemon=True)
        self._thread.start()

    def submit(self, copies: Sequence[Copy]) -> int:
        return self.run(lambda: self._count(
            copy_pages(self.tensor, copies, pool=self._pool, workers=self.workers)))

    def _count(self, moved: int) -> None:
        self.bytes_moved += moved

    def run(self, fn: Callable[[], None]) -> int:
        self.last += 1
        self._queue.put((self.last, fn))
        return self.last

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            ticket, fn = item
            if self._failing:  # it may read what a failed copy left unwritten: void
                self._failed.append((ticket, None))
            else:
                try:
                    fn()
                except BaseException as exc:  # reported by `failures`, never raised here
                    self._failing = True
                    self._failed.append((ticket, exc))
            with self._cond:
                self._finished = ticket
                self._cond.notify_all()

    def done(self, ticket: int) -> bool:
        return self._finished >= ticket

    def wait(self, ticket: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._finished >= ticket)

    def failures(self, ticket: int) -> list[Failure]:
        """Waits for `ticket`; after a failure, also for everything queued (voided, so
        quick), so that the failures come back whole and copies may run again."""
        self.wait(ticket)
        if not self._failed:
            return []
        self.wait(self.last)  # nothing is submitted meanwhile: this is the only submitter
        out, self._failed = self._failed, []
        self._failing = False
        return out

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown()


class StreamMover(Mover):
    def __init__(self, tensor: Tensors, device: torch.device) -> None:
        super().__init__(tensor)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._events: dict[int, torch.cuda.Event] = {}

    def submit(self, copies: Sequence[Copy]) -> int:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # see the KV written
        with torch.cuda.stream(self.stream):
            self.bytes_moved += copy_pages(self.tensor, copies, non_blocking=True)
            return self._record()

    def run(self, fn: Callable[[], None]) -> int:
        self.wait_host(self.last)
        fn()
        return self.last

    def _record(self) -> int:
        self.last += 1
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events[self.last] = event
        for old in [t for t in self._events if t < self.last and self._events[t].query()]:
            del self._events[old]
        return self.last

    def done(self, ticket: int) -> bool:
        event = self._events.get(ticket)  # the stream runs in order: the last one decides
        return event is None or event.query()

    def wait(self, ticket: int) -> None:
        event = self._events.get(ticket)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_host(self, ticket: int) -> None:
        event = self._events.get(ticket)
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


def mover_for(tensor: Tensors, device: torch.device) -> Mover:
    return StreamMover(tensor, device) if device.type == "cuda" else ThreadMover(tensor)
