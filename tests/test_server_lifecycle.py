"""The server's life: loading (503 until ready), overload (503 past --max-queue), an engine
fault (500 to those in flight, then serving on), and SIGTERM (streams in flight drain,
storage writes finish, exit 0), with a checkpoint directory the test makes itself
(`--model DIR`: tiny model + trained tokenizer + chat template)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from server_util import ServerProcess, ServerThread, metrics, serve_args, wait_for
from tiny_model import greedy_tokens

from shadowradix.demo import tiny_deepseek_v4
from shadowradix.server.engine_loop import EngineLoop
from shadowradix.server.serve import runtime_from_args
from shadowradix.server.tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hugging Face checkpoint directory: config.json, safetensors, tokenizer files."""
    path = tmp_path_factory.mktemp("ckpt")
    tiny_deepseek_v4(seed=3).save_pretrained(path)
    tiny_tokenizer(1024).save_pretrained(path)
    return path


def test_health_is_503_until_the_model_is_loaded():
    runtime = runtime_from_args(serve_args("--model", "tiny"))
    gate = threading.Event()
    build = runtime.loop.build
    runtime.loop = EngineLoop(lambda: gate.wait() and build(), runtime.metrics)
    server = ServerThread(runtime, wait_loaded=False)
    try:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert r.headers["retry-after"]
        gate.set()
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, what="load")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        gate.set()
        server.stop()


def test_a_model_that_fails_to_load_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4",
                                                      "vocab_size": -5}))
    server = ServerThread(runtime_from_args(serve_args("--model", str(tmp_path))))
    try:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    finally:
        server.stop()


def test_not_a_checkpoint_directory_is_refused_before_serving(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        runtime_from_args(serve_args("--model", str(tmp_path)))
    with pytest.raises(SystemExit):  # refused while parsing, before any model loads
        serve_args("--model", "tiny", "--max-queue", "0")


def test_overload_past_max_queue_is_503():
    """Long prompts and a small step budget admit about one request every few steps, so a
    burst of twelve overflows a queue of two: the rest get 503 at once, the others their
    whole answers."""
    server = ServerThread.from_args("--model", "tiny", "--max-queue", "2", "--step-tokens", "64")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json={
                "prompt": [7 + i] * 200, "max_tokens": 4, "ignore_eos": True})
                for i in range(12)])

    try:
        responses = asyncio.run(burst())
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert refused and served and len(refused) + len(served) == 12
        for r in refused:
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "max-queue" in err["message"]
            assert r.headers["retry-after"]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in served)
        wait_for(lambda: metrics(server.url)["shadowradix:num_requests_waiting"] == 0)
        # More answers at once than the queue ever holds: never servable, so 400, not 503.
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "max-queue" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_an_engine_fault_fails_the_requests_in_flight_and_serving_goes_on():
    """A step that keeps failing (STEP_RETRIES times in a row: a single failure is retried,
    the step being a transaction) fails the requests in flight; serving goes on."""
    from shadowradix.server.engine_loop import STEP_RETRIES

    server = ServerThread.from_args("--model", "tiny")
    try:
        def break_next_steps(engine) -> None:
            real, left = engine.step, [STEP_RETRIES]

            def step():
                left[0] -= 1
                if not left[0]:
                    engine.step = real
                raise RuntimeError("injected fault")
            engine.step = step

        server.on_engine(break_next_steps)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal_error"
        assert "injected fault" in r.json()["error"]["message"]
        server.on_engine(break_next_steps)
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 3, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert "injected fault" in events[-2] and events[-1] == "data: [DONE]"
        server.on_engine(lambda e: e.check_integrity())
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def test_checkpoint_directory_sigterm_drains_and_storage_survives(checkpoint, tmp_path):
    """`--model DIR` answers exactly transformers' greedy tokens for that checkpoint and its
    own tokenizer; SIGTERM mid-stream lets the stream finish, exits 0, and leaves every
    page written to storage: a fresh server on the same store serves the prompt from it."""
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    tok = AutoTokenizer.from_pretrained(checkpoint)
    hf = DeepseekV4ForCausalLM.from_pretrained(checkpoint).eval()
    messages = [{"role": "user", "content": "Tell me about the cache. " * 8}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    want = tok.decode(greedy_tokens(hf, ids, 120), skip_special_tokens=True)
    args = ("--model", str(checkpoint), "--page-size", "16", "--storage",
            f"file://{tmp_path / 'l3'}", "--served-model-name", "ckpt")
    server = ServerProcess(*args)
    try:
        body = {"model": "ckpt", "messages": messages, "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=120) as r:
            lines = (line for line in r.iter_lines() if line)
            events = [next(lines)]
            server.proc.send_signal(15)  # SIGTERM with the stream in flight
            events.append(next(lines))
            assert server.proc.poll() is None  # still serving it
            events += list(lines)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text == want
        assert chunks[-1]["usage"]["completion_tokens"] == 120
        assert server.proc.wait(60) == 0, "".join(server.log)
    finally:
        server.kill()
    again = ServerProcess(*args)
    try:
        r = httpx.post(f"{again.url}/v1/chat/completions", timeout=120, json={
            **body, "stream": False, "max_tokens": 2})
        details = r.json()["usage"]["prompt_tokens_details"]
        assert details["cached_tokens_by_tier"]["storage"] == len(ids) // 16 * 16 > 0
        assert again.terminate() == 0
    finally:
        again.kill()


def test_sigterm_aborts_what_outlasts_the_drain_timeout():
    server = ServerProcess("--model", "tiny", "--drain-timeout", "0.5")
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 30000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(15)
            with pytest.raises(httpx.RemoteProtocolError):  # cut off, no [DONE]
                for line in lines:
                    assert line != "data: [DONE]"
        assert server.proc.wait(30) == 0, "".join(server.log)
    finally:
        server.kill()


def test_sigterm_the_moment_serving_is_announced_exits_0():
    """Between `serving ... on` and uvicorn's own handlers, a SIGTERM met only a handler
    that logged it: the server then ran on until killed (#20, found through the fleet).
    The signal is sent in that window for sure: from uvicorn's run, before it starts."""
    import subprocess
    import sys

    code = ("import os, signal, sys, uvicorn\n"
            "from shadowradix.cli import main\n"
            "run = uvicorn.Server.run\n"
            "def early(self, *a, **kw):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return run(self, *a, **kw)\n"
            "uvicorn.Server.run = early\n"
            "sys.exit(main(['serve', '--model', 'tiny', '--port', '0']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopped by SIGTERM" in proc.stderr
