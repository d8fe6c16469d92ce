"""What one client may ask of the server, end to end on a real uvicorn (127.0.0.1, an
ephemeral port): choices per request, body size, text that can never fit, tokenizing off
the event loop, connection deadlines and the connection cap, the API key's scheme, and
errors in OpenAI's shape with X-Request-Id (500s and a drain cut-off included)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from server_util import ROOT, ServerProcess, ServerThread, metrics, serve_args, wait_for

from shadowradix.server.tokenizer import text_bound, tiny_tokenizer

KEY = "limits-key"
MAX_CHOICES = 8
READ_TIMEOUT = 1.0
BODY_BYTES = 3_000_000


@pytest.fixture(scope="module")
def server():
    srv = ServerThread.from_args("--model", "tiny", "--api-key", KEY, "--device-tokens", "4096",
                                 "--max-choices", str(MAX_CHOICES),
                                 "--max-body-bytes", str(BODY_BYTES),
                                 "--read-timeout", str(READ_TIMEOUT),
                                 "--keep-alive-timeout", "1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def post(server: ServerThread, path: str, body: Any, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=auth(), timeout=timeout)


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] and err["message"]
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"]


# ------------------------------------------------------------------ choices per request
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "n": MAX_CHOICES + 1}, "n"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_CHOICES + 1)}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6]] * 3, "n": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "n": MAX_CHOICES + 1}, "n"),
    ("/generate", {"text": ["x"] * (MAX_CHOICES + 1)}, "text"),
    ("/generate", {"input_ids": [[5]] * 3, "sampling_params": {"n": 3}}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"n": MAX_CHOICES + 1}},
     "sampling_params.n"),
])
def test_more_choices_than_max_choices_are_400(server, path, body, param):
    assert_error(post(server, path, {**body, "max_tokens": 1}), 400,
                 "integer_above_max_value" if param.endswith("n") else
                 "array_above_max_length", param)


def test_a_huge_n_or_batch_is_refused_before_anything_is_built(server, client):
    """n=10**9 used to build a billion choices (the server stopped answering until the OOM
    killer came); a batch of 300k prompts, one object each. Both are refused at once, and
    the largest allowed request is served."""
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="max-choices"):
        client.completions.create(model="tiny", prompt="x", n=10**9, max_tokens=1)
    r = post(server, "/v1/completions", {"prompt": [[7]] * 300_000, "max_tokens": 1})
    assert_error(r, 400, "array_above_max_length", "prompt")
    r = post(server, "/generate", {"text": "x", "sampling_params": {"n": 10**9}})
    assert_error(r, 400, "integer_above_max_value", "sampling_params.n")
    assert time.monotonic() - start < 5
    out = client.completions.create(model="tiny", prompt=["a", "b"], n=MAX_CHOICES // 2,
                                    max_tokens=1)
    assert len(out.choices) == MAX_CHOICES


# ------------------------------------------------------------------ body size, text size
def test_a_body_over_max_body_bytes_is_413_as_it_is_read(server):
    big = {"prompt": "a" * BODY_BYTES, "max_tokens": 1}
    assert_error(post(server, "/v1/completions", big), 413, "request_too_large")

    def chunks():  # no Content-Length: refused once the count passes the limit
        yield b'{"prompt": "'
        for _ in range(BODY_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=auth(),
                   timeout=30)
    assert_error(r, 413, "request_too_large")
    assert r.headers["connection"] == "close"


def test_a_413_reaches_a_client_that_reads_only_after_sending_its_whole_body(server):
    """The server answered 413 at the declared Content-Length and closed with the body
    unread. A close with unread data resets the connection (RST, not FIN), and Linux then
    drops whatever of the answer was still queued to send: a client that reads only after
    sending its whole body (httpx does) got `peer closed connection without sending complete
    message body` in CI. A body up to twice the limit is now read and dropped first, so the
    client's sends all go through and the connection ends with the whole answer."""
    s = raw(server)
    size = BODY_BYTES + 100_000
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n")
    s.sendall(head.encode())
    time.sleep(0.3)  # the old server had answered and closed by now
    for _ in range(size // 65536):
        s.sendall(b"a" * 65536)  # BrokenPipeError on the old code: the server reset
    s.sendall(b"a" * (size % 65536))
    got = closed_within(s, 10)
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got, got[:200]
    s.close()


class TokenizerSpy:
    """The runtime's tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.encoded: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_text_that_can_never_fit_is_refused_without_tokenizing(server, monkeypatch):
    bound = server.runtime.text_bound
    assert bound is not None and bound.max_chars + 1000 < BODY_BYTES
    spy = TokenizerSpy(server.runtime.tokenizer)
    monkeypatch.setattr(server.runtime, "tokenizer", spy)
    text = "a" * (bound.max_chars + 1)
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert_error(r, 400, "context_length_exceeded", "prompt")
    assert "can never fit" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    assert_error(r, 400, "context_length_exceeded", "messages")
    r = post(server, "/generate", {"text": text})
    assert_error(r, 400, "context_length_exceeded", "text")
    assert_error(post(server, "/tokenize", {"prompt": text}), 400, "context_length_exceeded")
    assert max(spy.encoded, default=0) <= bound.max_chars
    r = post(server, "/v1/completions", {"prompt": "a short one", "max_tokens": 1})
    assert r.status_code == 200 and spy.encoded


def test_the_text_bound_is_sound():
    """No text of the tiny tokenizer's holds more characters than its tokens can stand
    for; a tokenizer whose normalizer may shrink text gets no bound."""
    from tokenizers import normalizers

    tok = tiny_tokenizer(1024)
    bound = text_bound(tok, 100)
    assert bound is not None and bound.token_chars >= 1
    from shadowradix.server.tokenizer import _CORPUS  # its longest merges come from here

    texts = [_CORPUS, _CORPUS * 3, "你好" * 500, "😀" * 300, " " * 1000, "\n" * 999,
             "<｜begin▁of▁sentence｜>" * 50, "aaaa" * 400]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(text) <= len(ids) * bound.token_chars
    tok.backend_tokenizer.normalizer = normalizers.NFKC()
    assert text_bound(tok, 100) is None


# ------------------------------------------------------------------ off the event loop
def health_gaps(server: ServerThread, busy: threading.Thread) -> list[float]:
    """How long each /health took while `busy` ran."""
    gaps = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        busy.start()
        while busy.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            gaps.append(time.monotonic() - start)
            time.sleep(0.02)
    busy.join()
    return gaps


def test_tokenize_and_detokenize_leave_the_event_loop_free(server):
    """A 1.5 MB /tokenize used to stall every other request (/health included) while it
    ran on the event loop; on the tokenizer threads /health answers at once."""
    text = "The quick brown fox jumps over the lazy dog 1234567890. " * 27_000
    out: dict[str, Any] = {}

    def tokenize() -> None:
        out["tok"] = post(server, "/tokenize", {"prompt": text}, timeout=120)

    gaps = health_gaps(server, threading.Thread(target=tokenize))
    r = out["tok"]
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert len(gaps) >= 3 and max(gaps) < 0.5, gaps
    tokens = r.json()["tokens"]

    def detokenize() -> None:
        out["detok"] = post(server, "/detokenize", {"tokens": tokens}, timeout=120)

    gaps = health_gaps(server, threading.Thread(target=detokenize))
    assert out["detok"].json()["prompt"] == text
    assert max(gaps) < 0.5, gaps


# ------------------------------------------------------------------ connections
def raw(server: ServerThread) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(10)
    return s


def closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> bytes:
    """What the server sent before closing `s`; fails if it is still open after
    `seconds`. `trickle`: one byte of it every 0.2 s meanwhile (slowloris)."""
    deadline = time.monotonic() + seconds
    got = b""
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        if trickle:
            try:
                s.send(trickle[:1])
            except OSError:  # reset: closed
                return got
            trickle = trickle[1:]
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"still open after {seconds} s (got {got[:80]!r})")


def test_idle_and_half_sent_connections_are_closed_within_the_read_timeout(server):
    limit = READ_TIMEOUT + 1.5
    idle = raw(server)
    assert closed_within(idle, limit) == b""
    half = raw(server)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
    assert closed_within(half, limit) == b""
    slow = raw(server)
    assert closed_within(slow, limit + 2, trickle=b"GET /health HTTP/1.1\r\nHost: x" * 4) == b""
    body = raw(server)  # a whole head, then a body that stalls: 408, and closed
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100"
                 b"\r\n\r\n{\"prompt\"")
    answer = closed_within(body, limit)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    kept = raw(server)  # a keep-alive connection: served, then closed once idle
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_within(kept, limit).startswith(b"HTTP/1.1 200")
    for s in (idle, half, slow, body, kept):
        s.close()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_connections_beyond_max_connections_get_503_and_are_closed():
    srv = ServerThread.from_args("--model", "tiny", "--max-connections", "3")
    try:
        held = [raw(srv) for _ in range(3)]
        extra = raw(srv)
        answer = closed_within(extra, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        json.loads(answer.split(b"\r\n\r\n", 1)[1])
        held.pop().close()
        wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200, what="a slot")
        for s in held:
            s.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------ the API key
@pytest.mark.parametrize("header", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}",
                                    f"BeArEr\t{KEY}"])
def test_the_bearer_scheme_is_case_insensitive(server, header):
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": header})
    assert r.status_code == 200, r.text


def test_whitespace_around_the_authorization_is_ignored(server):
    s = raw(server)  # httpx refuses to send such a header; a client may
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Authorization: \t bearer  " + KEY.encode() + b" \t\r\n\r\n")
    assert closed_within(s, 10).startswith(b"HTTP/1.1 200")
    s.close()


@pytest.mark.parametrize("header", [f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", KEY,
                                    f"Bearer{KEY}"])
def test_other_authorizations_are_401(server, header):
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": header})
    assert_error(r, 401, "invalid_api_key")


@pytest.mark.parametrize("key", ["", "   ", " key"])
def test_an_empty_api_key_is_refused_at_start_up(key):
    with pytest.raises(SystemExit) as e:
        serve_args("--model", "tiny", "--api-key", key)
    assert e.value.code == 2


def test_an_empty_api_key_stops_the_command_with_one_line():
    out = subprocess.run([sys.executable, "-m", "shadowradix", "serve", "--model", "tiny",
                          "--api-key", ""], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "--api-key" in last and "empty" in last and "Traceback" not in out.stderr


# ------------------------------------------------------------------ errors and request ids
def test_a_500_carries_the_request_id(server, monkeypatch):
    def boom(name: str | None) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(server.runtime, "check_model", boom)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"},
                   headers={**auth(), "X-Request-Id": "req-500"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"] == "req-500"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=auth())
    assert r.status_code == 500 and len(r.headers["x-request-id"]) == 32


def test_a_whole_answer_cut_off_by_the_drain_timeout_is_503_json():
    server = ServerProcess("--model", "tiny", "--drain-timeout", "0.5")
    try:
        out: dict[str, httpx.Response] = {}

        def ask() -> None:
            out["r"] = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 30000, "ignore_eos": True},
                headers={"X-Request-Id": "cut"})

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: metrics(server.url)["shadowradix:num_requests_running"] == 1,
                 what="the request to run")
        server.proc.send_signal(15)
        asker.join(60)
        r = out["r"]
        assert_error(r, 503, "shutting_down")
        assert r.headers["x-request-id"] == "cut"
        assert server.proc.wait(30) == 0, "".join(server.log)
    finally:
        server.kill()
