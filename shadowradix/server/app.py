"""The FastAPI app: routes, the API-key gate, X-Request-Id, body limits, and errors in
OpenAI's shape.

Every error a client can cause is an HTTP 4xx with `{"error": {"message", "type",
"param", "code"}}`; FastAPI's own 404/405 are reshaped the same way, and an unexpected
exception is a 500 in that shape (logged), never a bare traceback. Every response, 500s
included, carries X-Request-Id.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shadowradix.server import info_api, native_api, openai_api
from shadowradix.server.metrics import CONTENT_TYPE
from shadowradix.server.protocol import ApiError
from shadowradix.server.runtime import Runtime

log = logging.getLogger("shadowradix.server")
OPEN_PATHS = ("/health", "/metrics")  # no API key needed (probes and Prometheus)
CLOSE = {"Connection": "close"}  # after a refusal that leaves the body unread
BODY_RATE = 64 * 1024  # bytes/s a body must average once its first --read-timeout is over


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def bearer_token(value: bytes) -> bytes | None:
    """The token of `Authorization: Bearer TOKEN`; the scheme in any case (RFC 9110),
    whitespace around either part ignored. None for another scheme or no token."""
    parts = value.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


class Gate:
    """Pure ASGI (so streams and disconnects pass untouched), around everything else, the
    error middleware included: echoes or assigns X-Request-Id on every response, checks
    `Authorization: Bearer KEY`, and answers a request that the shutdown cut off (uvicorn
    cancels what outlasts --drain-timeout) with a 503 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id") or uuid.uuid4().hex.encode()
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        if not self.allows(scope["path"], headers.get(b"authorization", b"")):
            err = ApiError("invalid or missing API key (Authorization: Bearer KEY)",
                           status=401, code="invalid_api_key")
            await error_response(err)(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            if started:  # a stream: the status line is gone, the connection just ends
                raise
            # Only uvicorn's shutdown cancels a request; answering completes it.
            log.warning("%s %s: cut off by the shutdown", scope["method"], scope["path"])
            err = ApiError("the server is shutting down: this request outlasted its drain "
                           "timeout (--drain-timeout) and was aborted", status=503,
                           code="shutting_down", type="server_error", headers=CLOSE)
            await error_response(err)(scope, receive, send_with_id)

    def allows(self, path: str, authorization: bytes) -> bool:
        if self.key is None or path in OPEN_PATHS:
            return True
        token = bearer_token(authorization)
        return token is not None and hmac.compare_digest(token, self.key)


class BodyReader:
    """Pure ASGI: reads a request's whole body before the app runs, so a body over
    `limit()` bytes is refused with 413 as soon as it is declared or read that far (never
    held whole), and one that stalls for `timeout` seconds between chunks gets 408. The
    app then receives it as one message (and later messages, a disconnect, as they come)."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int], timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        try:
            body = await self.read(scope, receive, limit)
        except ApiError as e:
            await error_response(e)(scope, receive, send)
            return
        if body is None:  # the client left before its body arrived: no one to answer
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def read(self, scope: Scope, receive: Receive, limit: int) -> bytes | None:
        # A body over the limit is still read, and dropped, up to twice the limit: closing
        # a connection with its body unread resets it, and the client's kernel then throws
        # away the 413 it was about to read. Past twice the limit (declared or counted) the
        # answer goes at once, and such a client may see only the reset.
        # With `Expect: 100-continue` the client waits to be asked for its body: refusing
        # a declared length over the limit then costs no body at all (reading one would
        # ask for it).
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        over = declared.isdigit() and int(declared) > limit
        expects = headers.get(b"expect", b"").lower() == b"100-continue"
        if over and (int(declared) > 2 * limit or expects):
            raise self.too_large(limit)
        chunks: list[bytes] = []
        size, more = 0, True
        start = asyncio.get_running_loop().time()
        while more and size <= 2 * limit:
            try:
                message = await self.next_message(receive, start, size)
            except ApiError:
                if over:
                    raise self.too_large(limit) from None
                raise
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            over = over or size > limit
            if not over:
                chunks.append(chunk)
            more = message.get("more_body", False)
        if over:
            raise self.too_large(limit)
        return b"".join(chunks)

    async def next_message(self, receive: Receive, start: float, size: int) -> Message:
        # A stall of `timeout` between chunks, or a trickle slower than BODY_RATE past the
        # first `timeout` seconds, is a 408: no body holds its connection for long.
        left = start + self.timeout + size / BODY_RATE - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(receive(), max(min(self.timeout, left), 0))
        except TimeoutError:
            raise ApiError(f"the request body stalled or trickled (--read-timeout "
                           f"{self.timeout:g} s between chunks, {BODY_RATE // 1024} KiB/s "
                           f"after that)", status=408, code="request_timeout",
                           headers=CLOSE) from None

    @staticmethod
    def too_large(limit: int) -> ApiError:
        return ApiError(f"the request body is over {limit} bytes, the most this server takes "
                        f"(--max-body-bytes)", status=413, code="request_too_large",
                        headers=CLOSE)


class App(FastAPI):
    """FastAPI whose outermost layers are the Gate and the BodyReader: outside the error
    middleware, so its 500s get X-Request-Id too, and no route reads an unchecked body."""

    def __init__(self, runtime: Runtime, **kw: Any) -> None:
        super().__init__(**kw)
        self.state.runtime = runtime

    def build_middleware_stack(self) -> ASGIApp:
        rt: Runtime = self.state.runtime
        inner = BodyReader(super().build_middleware_stack(), rt.body_limit,
                           rt.limits.read_timeout)
        return Gate(inner, rt.api_key)


def build_app(runtime: Runtime) -> FastAPI:
    """The app over a runtime whose engine loop is not started yet: startup starts it
    (the model loads on the engine thread; /health says 503 until then), shutdown stops
    it (requests still in flight are aborted, copies and storage writes finish)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.loop.start()
        try:
            yield
        finally:
            runtime.loop.stop()

    app = App(runtime, title="shadowradix", lifespan=lifespan, docs_url=None, redoc_url=None,
              openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(f"{request.method} {request.url.path}: {e.detail}",
                                       status=e.status_code, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        # Starlette re-raises after this answer and uvicorn then drops the connection: say
        # so, so a client (or a router's pool) never sends its next request down it.
        return error_response(ApiError(f"internal error: {type(e).__name__}: {e}", status=500,
                                       code="internal_error", type="server_error",
                                       headers=CLOSE))

    def loaded(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Any:
            runtime.loaded()
            return await handler(request)

        run.__name__ = handler.__name__
        return run

    @app.get("/health")
    async def health() -> Response:
        if not runtime.loop.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if runtime.loop.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(runtime.loop.load_error)},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        runtime.loaded()
        return JSONResponse({"object": "list", "data": [{
            "id": runtime.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "shadowradix", "root": runtime.root, "max_model_len": runtime.max_len}]})

    for path, handler in (("/v1/completions", openai_api.completions),
                          ("/v1/chat/completions", openai_api.chat_completions),
                          ("/generate", native_api.generate),
                          ("/flush_cache", native_api.flush_cache),
                          ("/tokenize", native_api.tokenize),
                          ("/detokenize", native_api.detokenize)):
        app.add_api_route(path, loaded(handler), methods=["POST"])
    for path, get in info_api.ROUTES:  # what SGLang's router asks a worker
        app.add_api_route(path, loaded(get), methods=["GET"])
    return app
