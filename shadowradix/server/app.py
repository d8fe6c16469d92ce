"""The FastAPI app: routes, the API-key gate, X-Request-Id, and errors in OpenAI's shape.

Every error a client can cause is an HTTP 4xx with `{"error": {"message", "type",
"param", "code"}}`; FastAPI's own 404/405 are reshaped the same way, and an unexpected
exception is a 500 in that shape (logged), never a bare traceback.
"""

from __future__ import annotations

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


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Gate:
    """Pure ASGI (so streams and disconnects pass untouched): echoes or assigns
    X-Request-Id on every response, and checks `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        if self.key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                err = ApiError("invalid or missing API key (Authorization: Bearer KEY)",
                               status=401, code="invalid_api_key")
                await error_response(err)(scope, receive, send_with_id)
                return
        await self.app(scope, receive, send_with_id)


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

    app = FastAPI(title="shadowradix", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.runtime = runtime

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
        return error_response(ApiError(f"internal error: {type(e).__name__}: {e}", status=500,
                                       code="internal_error", type="server_error"))

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
    app.add_middleware(Gate, api_key=runtime.api_key)
    return app
