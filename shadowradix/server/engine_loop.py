"""The engine on a thread of its own: it steps while there is work and sleeps when not.

The engine is not thread-safe, so everything that touches it (adds, aborts, flushes,
the model load itself) runs here, as commands queued by the HTTP side and executed
between steps. Outputs go back through each submission's `deliver` callback, once per
step with everything that submission got, so an HTTP event loop is woken once per step
and never blocks a step. Tokenization, detokenization and HTTP stay off this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from shadowradix.engine import Engine, SamplingParams
from shadowradix.engine.request import StepOutput
from shadowradix.server.metrics import ServerMetrics

log = logging.getLogger("shadowradix.server")
STEP_RETRIES = 2  # a step that fails this many times in a row fails the requests in flight
T = TypeVar("T")
# What a submission receives each step: (its prompt index, the output or the step's error).
Delivery = list[tuple[int, StepOutput | BaseException]]


class Overloaded(Exception):
    """More requests wait for admission than the server's --max-queue allows."""


class NeverQueued(ValueError):
    """One submission asks for more answers (prompts x n) than --max-queue ever admits."""


@dataclass
class Submission:
    prompts: Sequence[list[int]]
    params: Sequence[SamplingParams]
    deliver: Callable[[Delivery], None]  # called on the engine thread; must not block
    arrival: float  # time.monotonic() when the HTTP request arrived


@dataclass
class _Live:
    sub: Submission
    index: int
    prompt_len: int


@dataclass(frozen=True)
class Load:
    """What the engine had in hand at its last step, for `/get_load` and a router: read
    from any thread without touching the engine (the loop swaps in a new snapshot)."""

    running: int = 0
    waiting: int = 0
    tokens: int = 0  # prompt tokens of the requests in flight


class EngineLoop:
    """Owns the engine. `build` makes it (on this thread, so /health can answer while the
    model loads); `max_queue` caps the requests waiting for admission (None: no cap)."""

    def __init__(self, build: Callable[[], Engine], metrics: ServerMetrics,
                 max_queue: int | None = None) -> None:
        self.build = build  # makes the engine, on the engine thread
        self.metrics = metrics
        self.max_queue = max_queue
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.ready = threading.Event()  # set once the engine is built (or failed to be)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self.load = Load()  # replaced whole, never mutated: safe to read from any thread
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="shadowradix-engine",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------ any thread
    def submit(self, sub: Submission) -> Future[list[str]]:
        """Queue the submission's prompts, all or none; the future holds their request ids,
        or ValueError (bad input, or a request that can never fit) or Overloaded."""
        fut: Future[list[str]] = Future()
        self._commands.put(lambda: self._add(sub, fut))
        return fut

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop these requests (unknown or finished ones are ignored); their pages are
        freed before the next step."""
        ids = list(request_ids)
        if ids:
            self._commands.put(lambda: self._abort(ids))

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run fn(engine) between steps; the future holds its result or exception."""
        fut: Future[T] = Future()

        def run() -> None:
            assert self.engine is not None
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

        self._commands.put(run)
        return fut

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, finish the host and storage copies (engine.close), and end
        the thread. Idempotent."""
        self._commands.put(self._stop)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self.engine = self.build()
        except BaseException as e:
            if isinstance(e, ValueError):  # the engine refused the model or the flags: say why
                log.error("the model failed to load: %s", e)
            else:
                log.exception("the model failed to load")
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        engine = self.engine
        self._publish(engine)
        failures = 0  # steps that failed in a row
        while not self._stopping:
            # Sleep on the queue when idle; between steps, only take what is there.
            changed = bool(self._run_commands(block=not engine.has_unfinished()))
            if not self._stopping and engine.has_unfinished():
                changed = True
                try:
                    outputs = engine.step()
                except Exception as e:  # the step as a whole: every request is pending
                    failures += 1
                    if failures < STEP_RETRIES:
                        log.exception("engine step failed; retrying it (the step is a "
                                      "transaction: the requests in flight stay exact)")
                        continue
                    log.exception("engine step failed %d times in a row; failing the "
                                  "requests in flight", failures)
                    self._fail_all(e)
                    failures = 0
                else:
                    failures = 0
                    if outputs:
                        self._dispatch(outputs)
                    else:
                        time.sleep(0.001)  # e.g. storage reads in flight: do not spin
            if changed:  # once per turn: commands (an abort freed pages), a step, a fault
                self._publish(engine)
        self._shutdown()

    def _publish(self, engine: Engine) -> None:
        """The metrics' gauges and the load snapshot, from one `Engine.status()`."""
        status = engine.status()
        self.metrics.engine_status(status)
        self.load = Load(status["running"], status["waiting"],
                         sum(live.prompt_len for live in self._live.values()))

    def _run_commands(self, block: bool) -> int:
        """Run the queued commands (waiting for one if `block`); returns how many ran."""
        ran = 0
        try:
            command = self._commands.get(block=block)
            while True:
                try:
                    command()
                except Exception:  # one command's fault never stops the loop
                    log.exception("an engine command failed")
                ran += 1
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        return ran

    def _add(self, sub: Submission, fut: Future[list[str]]) -> None:
        engine = self.engine
        assert engine is not None
        if not fut.set_running_or_notify_cancel():
            return
        waiting = len(engine.scheduler.waiting)
        if self.max_queue is not None and len(sub.prompts) > self.max_queue:
            fut.set_exception(NeverQueued(
                f"this request asks for {len(sub.prompts)} answers at once (prompts x n) and "
                f"--max-queue is {self.max_queue}: it can never be queued"))
            return
        if self.max_queue is not None and waiting + len(sub.prompts) > self.max_queue:
            fut.set_exception(Overloaded(
                f"the server is overloaded: {waiting} requests wait for admission and "
                f"--max-queue is {self.max_queue}; retry later"))
            return
        ids: list[str] = []
        try:
            for prompt, params in zip(sub.prompts, sub.params, strict=True):
                ids.append(engine.add_request(prompt, params))
        except Exception as e:
            for rid in ids:
                self._drop(rid)
            fut.set_exception(e)
            return
        for i, (rid, prompt) in enumerate(zip(ids, sub.prompts, strict=True)):
            self._live[rid] = _Live(sub, i, len(prompt))
        fut.set_result(ids)

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            if self._live.pop(rid, None) is not None:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        """Abort one request; a fault there is logged and the loop goes on (the engine
        releases what the request still held: `Engine.abort`)."""
        assert self.engine is not None
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("aborting request %s failed; what it held is released", rid)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        batches: dict[int, tuple[Submission, Delivery]] = {}
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.cached_by_tier is not None:
                queued = (out.admitted_at or live.sub.arrival) - live.sub.arrival
                self.metrics.admitted(live.prompt_len, out.cached_by_tier, queued)
            if out.finished:
                del self._live[out.request_id]
            item = out if out.error is None else out.error  # it failed alone
            batches.setdefault(id(live.sub), (live.sub, []))[1].append((live.index, item))
        for sub, items in batches.values():
            self._deliver(sub, items)

    def _fail_all(self, error: BaseException) -> None:
        assert self.engine is not None
        batches: dict[int, tuple[Submission, Delivery]] = {}
        for rid, live in self._live.items():
            self._drop(rid)
            batches.setdefault(id(live.sub), (live.sub, []))[1].append((live.index, error))
        self._live.clear()
        for sub, items in batches.values():
            self._deliver(sub, items)

    @staticmethod
    def _deliver(sub: Submission, items: Delivery) -> None:
        try:
            sub.deliver(items)
        except Exception:
            log.exception("could not deliver outputs")

    def _stop(self) -> None:
        self._stopping = True

    def _shutdown(self) -> None:
        engine = self.engine
        assert engine is not None
        if self._live:
            log.info("aborting %d requests still in flight", len(self._live))
            self._abort(list(self._live))
        engine.close()  # finishes the host copies and the storage writes
        while True:  # anything queued after the stop gets an answer, not a hang
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
            except Exception:
                log.exception("command after stop")
