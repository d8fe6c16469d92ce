"""What the endpoints share once the model is loaded: the engine loop, the tokenizer,
the limits; and the small helpers every endpoint uses (SSE framing, disconnects)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from shadowradix.server.engine_loop import EngineLoop
from shadowradix.server.generation import Generation, Options
from shadowradix.server.metrics import ServerMetrics
from shadowradix.server.protocol import MAX_CHOICES, ApiError, Body, parse
from shadowradix.server.tokenizer import TextBound, chat_ids

T = TypeVar("T")
B = TypeVar("B", bound=Body)
MIB = 1 << 20
TOKENIZER_THREADS = 4  # tokenizations at once: each may hold ~170 bytes per character
# A prompt of token ids as JSON takes <= 8 bytes a token ("129279, "), text typically 4-5
# (9 for escaped CJK): 16 leaves room. At least 1 MiB, for small models and batches.
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_BYTES = MIB


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server (serve's flags of the same names). Each is
    checked before anything is built for the request, so a refusal costs next to nothing."""

    max_choices: int = MAX_CHOICES  # prompts x n in one request (400 beyond)
    max_body_bytes: int | None = None  # None: derived from the model (body_bytes); 413 beyond
    read_timeout: float = 10.0  # seconds to send a request's head, or between body chunks
    keep_alive_timeout: float = 5.0  # an idle connection between requests is closed
    max_connections: int = 1000  # open at once; more are answered 503 and closed

    def body_bytes(self, max_len: int) -> int:
        """The body limit for a model holding `max_len` tokens per request: room for the
        longest prompt that could fit, BODY_BYTES_PER_TOKEN a token, >= MIN_BODY_BYTES."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_len)


@dataclass
class Runtime:
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    root: str  # where the model came from ("tiny" or the checkpoint directory)
    api_key: str | None
    tokenizer: Any = None  # set once the engine is built
    vocab_size: int = 0
    eos: frozenset[int] = frozenset()
    max_len: int = 0  # prompt + output tokens one request may hold
    settings: dict[str, Any] = field(default_factory=dict)  # the engine's, for /server_info
    # --allow-special-tokens-in-content: special-token text in chat content stays special
    specials_in_content: bool = False
    limits: Limits = field(default_factory=Limits)
    text_bound: TextBound | None = None  # refuses text too long to ever fit, untokenized
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="shadowradix-tokenize"), repr=False)

    def loaded(self) -> None:
        """Raise 503 while the model is still loading (or failed to)."""
        if not self.loop.ready.is_set():
            raise ApiError("the model is still loading", status=503, code="loading",
                           type="server_error", headers={"Retry-After": "1"})
        if self.loop.load_error is not None:
            raise ApiError(f"the model failed to load: {self.loop.load_error}", status=503,
                           code="load_failed", type="server_error")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", status=404, param="model",
                           code="model_not_found")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer threads: tokenizing a long text (or checking and
        decoding many ids) never stalls the event loop, and at most TOKENIZER_THREADS run
        at once, which bounds the memory they hold."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    async def parse(self, cls: type[B], request: Request) -> B:
        """The request's body as `cls` (ApiError 400 if it is not one, or asks for more than
        --max-choices choices), parsed on the tokenizer threads: checking a body of a
        million token ids takes a second, which the event loop must not spend."""
        return await self.off_loop(parse, cls, await request.body(), self.limits.max_choices)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt"
               ) -> list[int]:
        """Token ids; ApiError (context_length_exceeded) before tokenizing a text too long
        to ever fit."""
        if self.text_bound is not None:
            self.text_bound.check(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True
                    ) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt,
                        self.specials_in_content, self.text_bound)

    def body_limit(self) -> int:
        """Bytes a request body may have (derived from the model once it is loaded)."""
        return self.limits.body_bytes(self.max_len)

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(f"{param}: token ids must be in [0, {self.vocab_size}), got {bad[0]}",
                           param=param)
        return list(ids)

    def generation(self, prompts: list[list[int]], opts: Options) -> Generation:
        return Generation(self.loop, self.metrics, self.tokenizer, self.eos, self.max_len,
                          prompts, opts)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False,
                                  separators=(",", ":")).encode() + b"\n\n"


async def complete(request: Request, gen: Generation) -> None:
    """Run a whole (non-streamed) answer to its end; a client that goes away meanwhile
    aborts it. (Streams need no watcher: Starlette cancels their generator on disconnect.)"""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.disconnected()

    task = asyncio.create_task(watch())
    try:
        async for _ in gen.events():
            pass
        if not gen.gone:
            gen.delivered()
    finally:
        task.cancel()
        gen.close()
