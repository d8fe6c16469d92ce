"""The OpenAI-compatible server, end to end: a real uvicorn on 127.0.0.1 (ephemeral port),
the official `openai` client, real HTTP (httpx) for what the client does not cover.
Greedy answers are checked against transformers' own greedy tokens."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import openai
import pytest
from server_util import ServerThread, metrics, wait_for
from tiny_model import greedy_tokens

from shadowradix.demo import tiny_deepseek_v4
from shadowradix.server.tokenizer import tiny_tokenizer

KEY = "test-key"
TIERS = ("device", "host", "storage")


@pytest.fixture(scope="module")
def server():
    srv = ServerThread.from_args("--model", "tiny", "--api-key", KEY, "--device-tokens", "4096",
                                 "--host-tokens", "8192", "--step-tokens", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """The same model and tokenizer the server builds for `--model tiny`."""
    return tiny_deepseek_v4(), tiny_tokenizer(1024)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


PROMPTS = ["The cache keeps every form of a token", "你好，世界！今天天气", "😀🚀 emoji ∑ and π",
           "def forward(self, input_ids):"]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_completion_is_transformers_greedy(client, reference, prompt):
    model, tok = reference
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = tok.encode(prompt)
    want = tok.decode(greedy_tokens(model, ids, 10), skip_special_tokens=True)
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10


def test_greedy_chat_is_transformers_greedy(client, reference):
    model, tok = reference
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    assert out.choices[0].message.content == tok.decode(greedy_tokens(model, ids, 8),
                                                        skip_special_tokens=True)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_joins_to_the_whole_text(client, chat):
    """Streamed deltas (incremental, multi-byte UTF-8 split across tokens) join into exactly
    the non-streamed text; include_usage adds a last chunk with no choices and the usage."""
    for prompt in PROMPTS:
        kw = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        if chat:
            kw["messages"] = [{"role": "user", "content": prompt}]
            whole = client.chat.completions.create(**kw)
            text = whole.choices[0].message.content
        else:
            kw["prompt"] = prompt
            whole = client.completions.create(**kw)
            text = whole.choices[0].text
        create = client.chat.completions.create if chat else client.completions.create
        chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
        if chat:
            assert chunks[0].choices[0].delta.role == "assistant"
            pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        else:
            pieces = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(pieces) == text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 24
        assert all(c.usage is None for c in chunks[:-1])
        assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                            temperature=0, stream=True))
    assert all(c.choices for c in chunks)


def test_second_chat_turn_is_served_from_cache(server, client):
    """The second turn re-sends the first (prompt and answer): its prompt hits the cache,
    and the hit shows in usage (with the per-tier split) and in the metrics."""
    system = "You answer questions about the cache. " * 6
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "How is a prefix shared between requests?"}]
    first = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=6,
                                           temperature=0)
    details = first.usage.prompt_tokens_details
    assert details.cached_tokens == 0 or details.cached_tokens < first.usage.prompt_tokens
    before = metrics(server.url)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the window pages?"}]
    second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=6,
                                            temperature=0)
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens >= first.usage.prompt_tokens - 16  # whole pages of turn 1
    by_tier = details.model_extra["cached_tokens_by_tier"]
    assert set(by_tier) == set(TIERS) and sum(by_tier.values()) == details.cached_tokens
    after = metrics(server.url)
    gained = sum(after[f"shadowradix:cached_tokens_total{{tier={t}}}"]
                 - before[f"shadowradix:cached_tokens_total{{tier={t}}}"] for t in TIERS)
    assert gained == details.cached_tokens


def test_concurrent_clients_get_their_own_answers(server, client):
    """Eight clients at once (batched by the engine) get what each gets alone."""
    prompts = [f"{p} #{i}" for i, p in enumerate(PROMPTS * 2)]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY,
                                      max_retries=0) as aclient:
            outs = await asyncio.gather(*[
                aclient.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}) for p in prompts])
        return [o.choices[0].text for o in outs]

    assert asyncio.run(together()) == alone


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=0.9, top_p=0.9,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=7).choices[0].text
    assert client.completions.create(**kw, seed=7).choices[0].text == a
    assert len({client.completions.create(**kw, seed=s).choices[0].text for s in range(4)}) > 1


def test_n_choices_and_batched_prompts(client):
    out = client.completions.create(model="tiny", prompt=["Hello", "World"], n=2, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
    assert out.usage.completion_tokens == 20


def test_stop_strings_and_stop_tokens(server, client, reference):
    _, tok = reference
    base = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[5:8]
    assert stop and stop not in text[:5]
    out = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=24,
                                    temperature=0, stop=[stop, "never-there"],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=24, temperature=0, stop=stop,
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == out.choices[0].text
    ids = tok.encode("The quick brown")
    gen = httpx.post(f"{server.url}/generate", headers=auth(), json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                              "ignore_eos": True}}).json()
    cut = gen["output_ids"][3]
    first = gen["output_ids"].index(cut)
    gen2 = httpx.post(f"{server.url}/generate", headers=auth(), json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                              "ignore_eos": True, "stop_token_ids": [cut]}}
                      ).json()
    assert gen2["output_ids"] == gen["output_ids"][:first + 1]  # the stop token counts, as EOS
    assert gen2["text"] == tok.decode(gen["output_ids"][:first], skip_special_tokens=True)
    assert gen2["meta_info"]["finish_reason"] == {"type": "stop", "matched": cut}


def test_stream_disconnect_aborts_and_frees_pages(server):
    """A client that leaves mid-stream: its request is aborted at once (the running gauge
    returns to 0 long before 3000 tokens), counted as an abort, and its pages are free:
    after a flush no page of any pool is in use, and the books are sound."""
    before = metrics(server.url)
    with httpx.Client(base_url=server.url, headers=auth(), timeout=30) as http, http.stream(
            "POST", "/v1/completions", json={"prompt": "x" * 200, "max_tokens": 3000,
                                             "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    wait_for(lambda: metrics(server.url)["shadowradix:num_requests_running"] == 0,
             what="the running gauge to return to 0")
    after = metrics(server.url)
    assert after["shadowradix:requests_total{finished_reason=abort}"] == \
        before["shadowradix:requests_total{finished_reason=abort}"] + 1
    assert after["shadowradix:generation_tokens_total"] \
        - before["shadowradix:generation_tokens_total"] < 3000
    server.on_engine(lambda e: e.check_integrity())
    httpx.post(f"{server.url}/flush_cache", headers=auth()).raise_for_status()
    server.on_engine(lambda e: e.check_integrity())
    used = {k: v for k, v in metrics(server.url).items() if k.startswith("shadowradix:pages_used")}
    assert used and not any(used.values()), used


def test_whole_answer_disconnect_aborts(server):
    """A non-streaming client that gives up (its timeout) aborts its request too."""
    before = metrics(server.url)["shadowradix:requests_total{finished_reason=abort}"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=auth(), timeout=1.0,
                   json={"prompt": "y" * 100, "max_tokens": 3000, "ignore_eos": True})
    wait_for(lambda: metrics(server.url)["shadowradix:requests_total{finished_reason=abort}"]
             == before + 1, what="the abort")
    # The engine drops it between steps, moments after the HTTP side counted the abort.
    wait_for(lambda: metrics(server.url)["shadowradix:num_requests_running"] == 0,
             timeout=5, what="the running gauge to return to 0")


BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", b'{"prompt": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": []}', "prompt"),
    ("/v1/completions", b'{"prompt": [1, 99999]}', "prompt"),
    ("/v1/completions", b'{"prompt": ""}', "prompt"),
    ("/v1/completions", b'{"max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
    ("/v1/completions", b'{"prompt": "x", "stop": [1]}', "stop"),
    ("/v1/completions", b'{"prompt": "x", "seed": -3}', "seed"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', "echo"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 2}', "logprobs"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "frequency_penalty": 0.5}', "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
    ("/v1/completions", b'{"prompt": "x",', None),
    ("/v1/completions", b'["prompt"]', None),
    ("/v1/completions", b'', None),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}',
     "messages.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}',
     "messages.content"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens"),
    ("/generate", b'{"sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/generate", b'{"text": "x", "input_ids": [1]}', "text"),
    ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}',
     "sampling_params.max_new_tokens"),
    ("/generate", b'{"input_ids": [-1]}', "input_ids"),
    ("/tokenize", b'{}', "prompt"),
    ("/detokenize", b'{"tokens": ["a"]}', "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_requests_get_400_in_openai_shape(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", headers={**auth(), "Content-Type": "application/json"},
                   content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    # The server goes on serving.
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_prompt_longer_than_the_cache_says_so(server, client):
    longest = server.runtime.max_len
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * (longest + 1), max_tokens=1)
    assert e.value.code == "context_length_exceeded" and f"{longest}" in e.value.message


def test_unknown_fields_are_ignored_and_unknown_models_are_404(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0,
                                    extra_body={"no_such_field": {"x": 1}, "user": "u1"})
    assert out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-99", prompt="Hello", max_tokens=2)
    assert e.value.code == "model_not_found"


def test_api_key(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert httpx.post(f"{server.url}/generate", json={"text": "x"}).status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_request_id_is_echoed(server):
    r = httpx.get(f"{server.url}/v1/models", headers={**auth(), "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(f"{server.url}/v1/completions", headers={**auth(), "X-Request-Id": "r-9"},
                   json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.headers["x-request-id"] == "r-9"
    assert httpx.get(f"{server.url}/health").headers["x-request-id"]  # one is made up


def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    # the longest sequence the device arena holds (4096 tokens of every pool: a sequence
    # keeps only its window's pages, so it holds far more tokens of the compressed ones)
    longest = server.runtime.max_len
    assert models[0].model_extra["max_model_len"] == longest > 4097


def test_native_generate(server, reference):
    model, tok = reference
    ids = tok.encode("Hello 你好")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, "temperature": 0,
                                                   "ignore_eos": True}}
    out = httpx.post(f"{server.url}/generate", headers=auth(), json=body).json()
    want = greedy_tokens(model, ids, 9)
    assert out["output_ids"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 9
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["cached_tokens"] == sum(meta["cached_tokens_by_tier"].values())
    # Streamed as SGLang does: cumulative text and ids, then [DONE].
    with httpx.stream("POST", f"{server.url}/generate", headers=auth(),
                      json={**body, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == out["text"] and chunks[-1]["output_ids"] == want
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 10))
    assert all(a["text"] == b["text"][:len(a["text"])] for a, b in itertools.pairwise(chunks))
    # A batch of texts answers a list.
    batch = httpx.post(f"{server.url}/generate", headers=auth(), json={
        "text": ["Hello", "World"], "sampling_params": {"max_new_tokens": 3}}).json()
    assert [len(b["output_ids"]) for b in batch] == [3, 3]


def test_tokenize_and_detokenize(server, reference):
    _, tok = reference
    r = httpx.post(f"{server.url}/tokenize", headers=auth(), json={"prompt": "Hello 你好"}).json()
    assert r["tokens"] == tok.encode("Hello 你好") and r["count"] == len(r["tokens"])
    back = httpx.post(f"{server.url}/detokenize", headers=auth(),
                      json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello 你好"
    chat = httpx.post(f"{server.url}/tokenize", headers=auth(),
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == tok.bos_token_id


def test_metrics_count_what_was_served(server, client):
    before = metrics(server.url)
    out = client.completions.create(model="tiny", prompt="Counting tokens for metrics",
                                    max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    after = metrics(server.url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("shadowradix:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("shadowradix:generation_tokens_total") == 7
    assert delta("shadowradix:requests_total{finished_reason=length}") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert delta(f"shadowradix:{h}_count") == 1
    assert delta("shadowradix:inter_token_latency_seconds_count") == 6
    assert after["shadowradix:num_requests_running"] == 0
    assert after["shadowradix:num_requests_waiting"] == 0
    pools = {k for k in after if k.startswith("shadowradix:pages_used")}
    assert {k.split("tier=")[1].rstrip("}") for k in pools} == {"device", "host"}
    for name in ("preemptions_total", "storage_errors_total",
                 "load_back_bytes_total{source=host}", "backup_bytes_total{target=host}"):
        assert f"shadowradix:{name}" in after
    # The buckets are vLLM's.
    assert "shadowradix:time_to_first_token_seconds_bucket{le=2560.0}" in after
    assert "shadowradix:inter_token_latency_seconds_bucket{le=80.0}" in after


def test_defaults_follow_openai(client):
    """Completions default to 16 tokens; `developer` is the system prompt."""
    out = client.completions.create(model="tiny", prompt="Hello", temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    dev = client.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    sys_ = client.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens
