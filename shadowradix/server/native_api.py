"""SGLang's native endpoints: `/generate` (so SGLang's bench_serving can drive the server),
`/flush_cache`, and vLLM-style `/tokenize` and `/detokenize`.

`/generate` answers `{"text", "output_ids", "meta_info"}` (a list for a batch); streamed,
each event carries the text and ids so far (cumulative, as SGLang sends them) and
`meta_info.completion_tokens`, ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from shadowradix.engine.cache_control import TIERS
from shadowradix.server.generation import Choice, Generation, options
from shadowradix.server.protocol import (
    ApiError,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from shadowradix.server.runtime import Runtime, complete, sse


def _prompts(rt: Runtime, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts as ids, and whether the request was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("give exactly one of text and input_ids", param="text")
    if isinstance(body.text, str):
        return [rt.encode(body.text, param="text")], False
    if body.text is not None:
        return [rt.encode(t, param="text") for t in body.text], True
    ids = body.input_ids
    assert ids is not None
    if ids and isinstance(ids[0], list):
        return [rt.check_ids(p, f"input_ids[{i}]") for i, p in enumerate(ids)], True
    return [rt.check_ids(ids, "input_ids")], False  # type: ignore[arg-type]


def _meta(gen: Generation, c: Choice) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if c.finish_reason == "length":
        reason = {"type": "length", "length": len(c.token_ids)}
    elif c.finish_reason is not None:
        reason = {"type": c.finish_reason, "matched": c.matched}
    by_tier = c.cached_by_tier or dict.fromkeys(TIERS, 0)
    return {"id": c.request_id, "finish_reason": reason, "prompt_tokens": c.prompt_len,
            "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
            "cached_tokens_by_tier": by_tier,
            "e2e_latency": (c.last_token or time.monotonic()) - gen.arrival}


async def generate(request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    body = await rt.parse(GenerateRequest, request)
    prompts, batch = await rt.off_loop(_prompts, rt, body)
    sp = body.sampling_params
    gen = rt.generation(prompts, options(sp, sp.max_new_tokens, sp.sampling_seed,
                                         sp.least_tokens))
    await gen.start()
    if body.stream:
        return StreamingResponse(_stream(gen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await complete(request, gen)
    outs = [{"text": c.text.output, "output_ids": c.token_ids, "meta_info": _meta(gen, c)}
            for c in gen.choices]
    return JSONResponse(outs if batch or len(outs) > 1 else outs[0])


async def _stream(gen: Generation) -> AsyncIterator[bytes]:
    try:
        async for c, _ in gen.events():
            yield sse({"index": c.index, "text": c.text.output, "output_ids": c.token_ids,
                       "meta_info": _meta(gen, c)})
            gen.delivered()
    except ApiError as e:  # the status line is long gone: the error is the last event
        yield sse(e.body())
    finally:
        gen.close()
    yield b"data: [DONE]\n\n"


async def flush_cache(request: Request) -> Any:
    """Drop unlocked pages from the named tiers: `?tiers=device,host` (default: the device
    and, if there is one, the host). "storage" also deletes this model's objects from the
    shared store, those other engines wrote included."""
    rt: Runtime = request.app.state.runtime
    given = request.query_params.get("tiers")

    def flush(engine: Any) -> list[str]:
        tiers = [t for t in given.split(",") if t] if given else (
            ["device", "host"] if engine.config.host_tokens else ["device"])
        engine.cache.flush(tuple(tiers))
        return tiers

    try:
        flushed = await asyncio.wrap_future(rt.loop.call(flush))
    except ValueError as e:
        raise ApiError(str(e), param="tiers") from None
    except RuntimeError as e:  # the store did not answer
        raise ApiError(str(e), status=503, code="storage_unavailable",
                       type="server_error") from None
    return JSONResponse({"flushed": flushed})


def _tokens(rt: Runtime, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        return rt.chat_prompt([m.as_dict() for m in body.messages], body.add_generation_prompt)
    assert body.prompt is not None
    return rt.encode(body.prompt, body.add_special_tokens)


async def tokenize(request: Request) -> Any:
    """Tokenized on the tokenizer threads, as prompts are: a long text never stalls the
    event loop (nor /health)."""
    rt: Runtime = request.app.state.runtime
    body = await rt.parse(TokenizeRequest, request)
    ids = await rt.off_loop(_tokens, rt, body)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": rt.max_len})


def _text(rt: Runtime, tokens: list[int]) -> str:
    return str(rt.tokenizer.decode(rt.check_ids(tokens, "tokens")))


async def detokenize(request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    body = await rt.parse(DetokenizeRequest, request)
    return JSONResponse({"prompt": await rt.off_loop(_text, rt, body.tokens)})
