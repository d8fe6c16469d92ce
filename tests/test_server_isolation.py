"""One request never hurts another on a real server (127.0.0.1, ephemeral port, the
official `openai` client): parameters that used to make sampling raise inside a step, a
request whose own booking fails, and a step that fails once while eight clients wait."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_util import SMALL_TINY, ServerThread

import shadowradix.engine.engine as engine_module
from shadowradix.model.runner import DeepseekV4Runner

PROMPTS = [f"The cache keeps every form of a token #{i}" for i in range(6)]


@pytest.fixture(scope="module")
def server():
    with ServerThread.from_args(*SMALL_TINY) as srv:
        yield srv


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's greedy answer, asked alone."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS]


async def together(server, odd: dict) -> tuple[list, object]:
    """The six prompts greedy, concurrently with one more request made with `odd`."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                  max_retries=0) as client:
        def ask(prompt: str, **kw: object):  # type: ignore[no-untyped-def]
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                             extra_body={"ignore_eos": True, **kw.pop(
                                                 "extra", {})}, **kw)
        outs = await asyncio.gather(*[ask(p, temperature=0) for p in PROMPTS],
                                    ask(PROMPTS[0], **odd), return_exceptions=True)
    return list(outs[:-1]), outs[-1]


@pytest.mark.parametrize("odd", [
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 1e-6},
    {"temperature": 1.0, "extra": {"top_k": 1}},
    {"temperature": 1.0, "extra": {"min_p": 1.0}},
], ids=["top_p-1e-300", "top_p-denormal", "temperature-1e-6", "top_k-1", "min_p-1"])
def test_extreme_sampling_values_are_greedy_and_hurt_no_one(server, alone, odd):
    others, mine = asyncio.run(together(server, dict(odd)))
    assert [o.choices[0].text for o in others] == alone
    assert not isinstance(mine, BaseException), mine
    assert mine.choices[0].text == alone[0]  # every filter keeps the most likely token


def test_a_request_whose_own_booking_fails_fails_alone(server, alone, monkeypatch):
    """Sampling raises for one request (as a draw from non-finite logits does): its client
    gets a 500 in the OpenAI shape, the others their exact answers, and the pages go back."""
    original = engine_module.sample

    def failing(logits, params, generator, banned=()):  # type: ignore[no-untyped-def]
        if not params.greedy and params.seed == 4242:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return original(logits, params, generator, banned)

    monkeypatch.setattr(engine_module, "sample", failing)
    others, mine = asyncio.run(together(server, {"temperature": 0.7, "seed": 4242}))
    assert [o.choices[0].text for o in others] == alone
    assert isinstance(mine, openai.InternalServerError), mine
    assert mine.body["type"] == "server_error"
    server.on_engine(lambda eng: eng.check_integrity())
    assert server.on_engine(lambda eng: eng.stats()["failed"]) >= 1
    assert not server.on_engine(lambda eng: eng.manager.leases)


def test_a_step_that_fails_once_is_retried_exact(server, alone, monkeypatch):
    """The forward raises once (a transient fault such as a device out-of-memory error):
    the step is a transaction, so the loop retries it and every client gets its answer."""
    original, calls = DeepseekV4Runner.forward_batch, [0]

    def flaky(self, segments, store):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(self, segments, store)

    monkeypatch.setattr(DeepseekV4Runner, "forward_batch", flaky)
    others, mine = asyncio.run(together(server, {"temperature": 0}))
    assert calls[0] > 3
    assert [o.choices[0].text for o in others] == alone
    assert mine.choices[0].text == alone[0]
    server.on_engine(lambda eng: eng.check_integrity())
