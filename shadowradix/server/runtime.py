"""What the endpoints share once the model is loaded: the engine loop, the tokenizer,
the limits; and the small helpers every endpoint uses (SSE framing, disconnects)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from shadowradix.server.engine_loop import EngineLoop
from shadowradix.server.generation import Generation, Options
from shadowradix.server.metrics import ServerMetrics
from shadowradix.server.protocol import ApiError


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True
                    ) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError("this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # a template's own raise_exception (e.g. roles out of order)
            raise ApiError(f"messages: the chat template refused them: {e}",
                           param="messages") from None
        return self.encode(text, add_special_tokens=False)  # the template adds BOS itself

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
    finally:
        task.cancel()
        gen.close()
