"""One HTTP request's run on the engine: its choices (prompts x n), as a stream of text.

Every endpoint (completions, chat, /generate) is this plus a response format. A choice
ends when the engine finishes it (EOS or a stop token id: "stop"; max tokens: "length"),
or when a stop string appears (then the engine request is aborted at once), or when the
client goes away (all are aborted, so their pages are freed before the next step).

Tokens are counted (usage, and the generation_tokens metric) where they are handed to
the client, so the two always agree: an EOS or stop token id counts (it is the last of
the output ids, as in vLLM, though never in the text), and tokens the engine made after
a stop string, before our abort reached it, do not, nor do those after it in the same
step (speculative decoding releases several tokens a step): an answer ends at the same
token, with the same text and count, whether its tokens came one or several at a time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shadowradix.engine import SamplingParams
from shadowradix.engine.cache_control import TIERS
from shadowradix.engine.request import StepOutput
from shadowradix.server.engine_loop import Delivery, EngineLoop, NeverQueued, Overloaded, Submission
from shadowradix.server.metrics import ServerMetrics
from shadowradix.server.protocol import ApiError, Decoding
from shadowradix.server.text_stream import TextStream


@dataclass(frozen=True)
class Options:
    """Sampling as the HTTP request gave it (before it becomes SamplingParams)."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt_len: int
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched: str | int | None = None  # the stop string or token that ended it
    cached_by_tier: dict[str, int] | None = None
    request_id: str = ""
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return sum((self.cached_by_tier or {}).values())


def options(body: Decoding, max_tokens: int | None, seed: int | None,
            min_tokens: int | None = None) -> Options:
    """A request body's decoding fields (its own names for the limits and the seed)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Options(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                   top_k=body.top_k_or_off, min_p=body.min_p,
                   min_tokens=body.min_tokens if min_tokens is None else min_tokens,
                   seed=seed, stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                   ignore_eos=body.ignore_eos, n=body.n,
                   skip_special_tokens=body.skip_special_tokens)


def sampling_params(opts: Options, limit: int, seed: int) -> SamplingParams:
    """The engine's parameters for one choice. A temperature below the engine's
    MIN_TEMPERATURE is greedy by the engine's own rule (`SamplingParams.sampling`), so the
    two cannot disagree; anything the engine still refuses is the client's 400, not a 500."""
    if opts.min_tokens > limit:
        raise ApiError(f"min_tokens {opts.min_tokens} exceeds the {limit} tokens this answer "
                       f"may have (max_tokens, or the room the prompt leaves)",
                       param="min_tokens")
    try:
        return SamplingParams(
            max_new_tokens=limit, greedy=opts.temperature == 0,
            temperature=opts.temperature, top_p=opts.top_p,
            top_k=opts.top_k, min_p=opts.min_p, min_tokens=opts.min_tokens,
            stop_token_ids=tuple(opts.stop_token_ids), seed=seed, ignore_eos=opts.ignore_eos)
    except ValueError as e:
        raise ApiError(f"the engine refused the sampling parameters: {e}") from None


class Generation:
    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, tokenizer: Any,
                 eos: AbstractSet[int], max_len: int, prompts: list[list[int]],
                 opts: Options) -> None:
        self.loop = loop
        self.metrics = metrics
        self.eos = eos
        self.arrival = time.monotonic()
        self.prompts = prompts
        self.opts = opts
        self.choices: list[Choice] = []
        params: list[SamplingParams] = []
        seed = opts.seed if opts.seed is not None else random.getrandbits(62)
        for p, prompt in enumerate(prompts):
            if not prompt:
                raise ApiError("the prompt is empty", param="prompt")
            room = max_len - len(prompt)
            if room < 1:
                raise ApiError(f"the prompt is {len(prompt)} tokens; this server holds at most "
                               f"{max_len} tokens of prompt and output, so at most "
                               f"{max_len - 1} of prompt", param="prompt",
                               code="context_length_exceeded")
            limit = opts.max_tokens if opts.max_tokens is not None else room
            if limit > room:
                raise ApiError(f"max_tokens {limit} + the prompt's {len(prompt)} tokens exceed "
                               f"the {max_len} tokens this server holds per request",
                               param="max_tokens", code="context_length_exceeded")
            for _ in range(opts.n):
                self.choices.append(Choice(len(self.choices), p, len(prompt),
                                           TextStream(tokenizer, opts.stop,
                                                      opts.skip_special_tokens,
                                                      opts.min_tokens)))
                params.append(sampling_params(opts, limit, (seed + len(params)) % 2**63))
        self._params = params
        self._queue: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self._open = 0
        self._ended = False
        self.gone = False  # the client went away
        self._taken = self._counted = 0  # tokens taken from the engine / counted as received

    async def start(self) -> None:
        """Queue every choice on the engine (all or none). ApiError 400 for a request the
        engine refuses, 503 when overloaded."""
        aloop = asyncio.get_running_loop()
        queue = self._queue

        def deliver(items: Delivery) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, items)

        prompts = [self.prompts[c.prompt_index] for c in self.choices]
        sub = Submission(prompts, self._params, deliver, self.arrival)
        fut = self.loop.submit(sub)
        try:
            ids = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # e.g. a shutdown: whatever the engine took, it drops
            fut.add_done_callback(self._abort_if_added)
            raise
        except Overloaded as e:
            raise ApiError(str(e), status=503, code="overloaded", type="server_error",
                           headers={"Retry-After": "1"}) from None
        except NeverQueued as e:  # more answers than the queue can ever hold: no retry helps
            raise ApiError(str(e), param="n", code="integer_above_max_value") from None
        except ValueError as e:  # the engine's own checks: the vocabulary, or the length
            if str(e).startswith("stop_token_ids"):
                raise ApiError(str(e), param="stop_token_ids") from None
            raise ApiError(str(e), param="max_tokens", code="context_length_exceeded") from None
        except RuntimeError as e:  # the engine is closed: the server is shutting down
            raise ApiError(str(e), status=503, code="shutting_down",
                           type="server_error") from None
        for c, rid in zip(self.choices, ids, strict=True):
            c.request_id = rid
        self._open = len(ids)

    def _abort_if_added(self, fut: Future[list[str]]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.loop.abort(fut.result())

    async def events(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) as tokens arrive; a choice's last event has its
        finish_reason set. Ends when every choice has."""
        while self._open:
            items = await self._queue.get()
            if items is None:  # the client went away
                return
            now = time.monotonic()
            for index, out in items:
                choice = self.choices[index]
                if choice.finish_reason is not None:
                    continue  # tokens the engine made before it saw our abort
                if isinstance(out, BaseException):
                    raise ApiError(f"the engine failed: {out}", status=500,
                                   code="internal_error", type="server_error")
                yield choice, self._take(choice, out, now)

    def _take(self, c: Choice, out: StepOutput, now: float) -> str:
        if out.cached_by_tier is not None:
            c.cached_by_tier = dict(out.cached_by_tier)
        if c.first_token is None:
            c.first_token = now
        elif c.last_token is not None:
            c.gaps.append(now - c.last_token)
        c.last_token = now
        # One step may bring several tokens (speculative decoding: the accepted drafts and
        # the model's own). The engine cuts them at EOS, a stop id and max tokens; a stop
        # string inside them cuts here, at the token that completed it.
        new = list(out.new_token_ids)
        stop_id = out.finished and bool(new) and new[-1] in self.opts.stop_token_ids
        held = len(c.text.ids)
        piece = c.text.add(new[:-1] if stop_id else new)  # a stop id is never text
        if c.text.stopped is not None:
            new = new[:len(c.text.ids) - held]
        c.token_ids += new
        self._taken += len(new)
        if c.text.stopped is not None:
            c.matched = c.text.stopped
            self._end(c, "stop")
            if not out.finished:
                self.loop.abort([c.request_id])
        elif out.finished:
            eos = bool(new) and new[-1] in self.eos and not self.opts.ignore_eos
            if stop_id or eos:
                c.matched = new[-1]
            self._end(c, "stop" if stop_id or eos else "length")
        else:
            return piece
        return piece + c.text.finish()

    def _end(self, c: Choice, reason: str) -> None:
        c.finish_reason = reason
        self._open -= 1
        end = c.last_token or time.monotonic()
        self.metrics.request_ended(reason, end - self.arrival,
                                   None if c.first_token is None else c.first_token
                                   - self.arrival, c.gaps)

    def delivered(self) -> None:
        """What was taken so far reached the client (a stream's chunk was sent, a whole
        answer is being returned): `generation_tokens_total` counts it, as usage does. A
        whole answer that fails or whose client left counts nothing."""
        self.metrics.generated(self._taken - self._counted)
        self._counted = self._taken

    def disconnected(self) -> None:
        """The client went away: abort everything (events() ends)."""
        self.gone = True
        self._queue.put_nowait(None)
        self.close()

    def close(self) -> None:
        """Abort the choices still running (a client that left, an error). Idempotent."""
        if self._ended:
            return
        self._ended = True
        running = [c for c in self.choices if c.finish_reason is None and c.request_id]
        for c in running:
            self._end(c, "abort")
        self.loop.abort([c.request_id for c in running])

    # ------------------------------------------------------------ usage
    def usage(self) -> dict[str, Any]:
        """OpenAI usage; a prompt with n choices counts once (its first choice's hits),
        with the per-tier split of cached tokens as an extension."""
        firsts = [c for c in self.choices if c.index % self.opts.n == 0]
        prompt = sum(c.prompt_len for c in firsts)
        completion = sum(len(c.token_ids) for c in self.choices)
        by_tier = {t: sum((c.cached_by_tier or {}).get(t, 0) for c in firsts) for t in TIERS}
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(by_tier.values()),
                                          "cached_tokens_by_tier": by_tier}}
