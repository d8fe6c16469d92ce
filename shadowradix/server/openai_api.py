"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`, streamed or whole.

Prompts are tokenized on a worker thread, so a long one never stalls the event loop that
streams everyone else's tokens.

Streams are server-sent events, `data: {json}` per chunk and `data: [DONE]` at the end,
as OpenAI sends them: chat opens each choice with its role, a choice's last chunk carries
its finish_reason, and `stream_options.include_usage` adds a last chunk with `choices: []`
and the usage (every chunk before it has `"usage": null`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from shadowradix.server.generation import Generation, options
from shadowradix.server.protocol import ApiError, ChatRequest, CompletionRequest, Sampling
from shadowradix.server.runtime import Runtime, complete, sse


def _prompts(rt: Runtime, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [rt.encode(prompt)]
    if not prompt:
        raise ApiError("prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [rt.check_ids(prompt, "prompt")]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return [rt.encode(p) for p in prompt]  # type: ignore[arg-type]
    return [rt.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]


async def completions(request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    body = await rt.parse(CompletionRequest, request)
    rt.check_model(body.model)
    prompts = await rt.off_loop(_prompts, rt, body.prompt)
    gen = rt.generation(prompts, options(body, body.max_tokens, body.seed))
    return await _respond(request, rt, gen, body, chat=False)


async def chat_completions(request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    body = await rt.parse(ChatRequest, request)
    rt.check_model(body.model)
    prompt = await rt.off_loop(rt.chat_prompt, [m.as_dict() for m in body.messages])
    gen = rt.generation([prompt], options(body, body.limit, body.seed))
    return await _respond(request, rt, gen, body, chat=True)


async def _respond(request: Request, rt: Runtime, gen: Generation, body: Sampling,
                   chat: bool) -> Any:
    await gen.start()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": rt.model_name}
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(gen, head, chat, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await complete(request, gen)
    choices: list[dict[str, Any]] = []
    for c in gen.choices:
        out: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                               "stop_reason": c.matched, "logprobs": None}
        if chat:
            out["message"] = {"role": "assistant", "content": c.text.output}
        else:
            out["text"] = c.text.output
        choices.append(out)
    return JSONResponse({**head, "choices": choices, "usage": gen.usage()})


async def _stream(gen: Generation, head: dict[str, Any], chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, piece: str | None, finish: str | None, matched: Any = None,
              role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {} if piece is None else {"content": piece})
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None,
                      "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = matched
        return sse({**head, "choices": [choice], **extra})

    try:
        if chat:
            for c in gen.choices:
                yield chunk(c.index, None, None, role=True)
        async for c, piece in gen.events():
            if piece:
                yield chunk(c.index, piece, None)
            if c.finish_reason is not None:
                yield chunk(c.index, None, c.finish_reason, c.matched)
            gen.delivered()
        if include_usage:
            yield sse({**head, "choices": [], "usage": gen.usage()})
    except ApiError as e:  # the status line is long gone: the error is the last event
        yield sse(e.body())
    finally:  # a client that disconnects cancels this generator: its requests end here
        gen.close()
    yield b"data: [DONE]\n\n"
