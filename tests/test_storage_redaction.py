"""No form of storage credential the parsers accept reaches a log, /server_info, /metrics,
a repr or an error message (#20). Each form is fed to a real engine (or server) whose
store does not answer, so every warning path runs, and every output is searched."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from redis_server import RedisServer, free_port
from server_util import ServerProcess
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.server.info_api import engine_settings
from shadowradix.tiers.storage import open_storage
from shadowradix.tiers.storage.urls import redact

# Every secret below contains "Zq"; nothing else printed does.
FORMS = [
    "redis://:Zq1secret@127.0.0.1:{port}/0",
    "redis://alice:Zq2secret@127.0.0.1:{port}/0",
    "redis://alice:Zq3/se?cr#et@127.0.0.1:{port}/0",  # unencoded: urllib splits it oddly
    "redis://127.0.0.1:{port}/0?password=Zq4secret",
    "redis://127.0.0.1:{port}/0?username=aliceZq&password=Zq5secret",
    "redis://127.0.0.1:{port}/0?password=Zq6@secret",
    "redis://127.0.0.1:{port}/0#Zq7secret",
    "rediss://:Zq8secret@127.0.0.1:{port}/0",
    "redis-cluster://:Zq9secret@127.0.0.1:{port}",
    "redis-cluster://bob:Zq10/se?cr#et@127.0.0.1:{port},127.0.0.1:{port}",
    "redis-cluster://:Zq11secret@127.0.0.1:{port}/0",
]


@pytest.fixture(params=FORMS, ids=[f"form{i}" for i in range(1, len(FORMS) + 1)])
def url(request):  # type: ignore[no-untyped-def]
    """Each form, at a port nothing listens on (made per test, not at collection: xdist's
    workers must collect the same test names)."""
    return request.param.format(port=free_port())


def test_redact_hides_every_credential_form(url):
    shown = redact(url)
    assert "Zq" not in shown
    assert "127.0.0.1" in shown or shown.endswith("***")  # still says where, mostly


def test_file_urls_and_plain_urls_are_left_alone():
    for url in ("file:///data/kv@1", "file:///tmp/a?b#c", "redis://127.0.0.1:6379/0",
                "redis-cluster://127.0.0.1:7000,127.0.0.1:7001"):
        assert redact(url) == url
    assert redact("redis://h:1/0?db=1") == "redis://h:1/0?db=***"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_no_output_of_an_engine_shows_a_credential(model, url, caplog):
    caplog.set_level(logging.DEBUG)
    shown: list[str] = []
    try:
        cfg = CacheConfig(page_size=16, device_tokens=1024, storage=url)
        shown.append(repr(cfg))
        eng = Engine.from_hf(model, cfg)
    except ValueError as e:  # a form refused: its message must hide it too
        shown.append(str(e))
    else:
        try:
            eng.generate([list(range(1, 60))], SamplingParams(max_new_tokens=2))
            shown += [json.dumps(engine_settings(eng)), json.dumps(eng.stats(), default=str),
                      repr(eng.storage.error_counts if eng.storage else None)]
        finally:
            eng.close()
    shown.append(caplog.text)
    for text in shown:
        assert "Zq" not in text, text


def test_a_backend_refusing_a_form_does_not_echo_it(url):
    try:
        open_storage(url).close()
    except ValueError as e:
        assert "Zq" not in str(e)


def test_a_wrong_password_in_the_query_is_not_echoed(tmp_path):
    server = RedisServer(tmp_path, password="right-password")
    try:
        url = f"redis://127.0.0.1:{server.port}/0?password=Zqwrong"
        with pytest.raises(ValueError, match="credentials|password") as e:
            open_storage(url)
        assert "Zq" not in str(e.value)
        good = open_storage(f"redis://127.0.0.1:{server.port}/0?password=right-password")
        key = f"ns/pool/{'ab' * 16}"
        assert good.batch_set([(key, b"x")]) == [True] and good.batch_get([key]) == [b"x"]
        good.close()
    finally:
        server.stop()


@pytest.mark.parametrize("url", [FORMS[5], FORMS[9]])
def test_a_server_shows_no_credential_anywhere(url):
    """A real `shadowradix serve`: its log, /server_info and /metrics."""
    url = url.format(port=free_port())
    with ServerProcess("--model", "tiny", "--storage", url) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            http.post("/v1/completions", json={"model": "tiny", "prompt": "hello " * 30,
                                               "max_tokens": 2})
            info = http.get("/server_info").text
            metrics = http.get("/metrics").text
        assert "Zq" not in info and "Zq" not in metrics
        assert json.loads(info)["storage"].startswith(url.split("://")[0])
    assert "Zq" not in "".join(server.log)
