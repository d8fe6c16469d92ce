"""HTTP connections under limits: uvicorn's protocol, with a deadline for a request's head
and a cap on open connections, and the uvicorn config the server runs with.

uvicorn closes an idle connection only after a response (`timeout_keep_alive`); one that
connects and sends nothing, or half a request head (slowloris), is kept forever, so one
client could hold every file descriptor. Here a connection must send a whole request head
within `read_timeout` of opening, or of its last response; past it, it is closed. (A body
that stalls is the app's to time out: see app.BodyReader.) Past `max_connections` open at
once, a new connection is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn

    from shadowradix.server.runtime import Limits


MAX_HEAD_BYTES = 16 * 1024  # what a head still arriving may buffer (h11's default); 400 beyond


def _overloaded_response() -> bytes:
    body = json.dumps({"error": {
        "message": "too many open connections (--max-connections); retry later",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def http_protocol(limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' if installed, else h11's) under `limits`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol
    refusal = _overloaded_response()

    class LimitedProtocol(base):
        # Armed while the connection owes a request head; None while a request runs.
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(refusal)  # type: ignore[attr-defined]
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a whole head arrived: a request runs
                self._disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle:  # no pipelined request started: the next head is owed
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.read_timeout, self._head_overdue)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return LimitedProtocol


def uvicorn_config(app: Any, limits: Limits, drain_timeout: float) -> uvicorn.Config:
    """The config `shadowradix serve` (and the tests' server) runs uvicorn with."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False,
                          http=http_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=drain_timeout,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES)
