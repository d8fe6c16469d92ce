"""`shadowradix fleet`: two real servers behind SGLang's real router (sglang-router, cache
aware) on 127.0.0.1, sharing L3 through a file store; and the worker endpoints the router
reads (`/model_info`, `/server_info`, `/get_load`), checked on one in-process server."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_util import ROOT, FleetProcess, ServerThread, alive, metrics, wait_for

from shadowradix.server.fleet import _check, add_arguments, instance_argv, router_argv
from shadowradix.tiers.storage.redis_common import redact as _redact

KEY = "fleet-key"
MAX_TOKENS = 6
# Distinct openings (no shared prefix between conversations), each over two 16-token pages.
OPENINGS = [
    "Explain how a radix tree over token pages lets two requests share their prompt.",
    "你好！请详细介绍一下分层缓存：显存、主机内存和共享存储之间如何移动页面。",
    "Why does a sliding window of 128 tokens need its own pool, apart from the compressed KV?",
    "def forward(self, input_ids, positions): # walk me through what this computes, line by line",
]
FOLLOW_UPS = ["Go on, and give an example.", "Now summarise it in one sentence."]
FORCED = "Storage test: a conversation whose second turn lands on the other instance, on purpose."



def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ worker endpoints
def test_worker_endpoints_in_sglang_shapes(tmp_path):
    server = ServerThread.from_args("--model", "tiny", "--api-key", KEY, "--device-tokens",
                                    "2048", "--storage", f"file://{tmp_path}",
                                    "--step-tokens", "32")
    try:
        get = lambda path: httpx.get(f"{server.url}{path}", headers=auth(), timeout=30)  # noqa: E731
        for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info",
                     "/get_load"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        model = get("/model_info").json()
        assert model == get("/get_model_info").json()
        assert model["model_path"] == "tiny" and model["tokenizer_path"] is None
        assert model["is_generation"] is True and model["model_type"] == "deepseek_v4"
        info = get("/server_info")
        assert info.json() == get("/get_server_info").json() and KEY not in info.text
        info = info.json()
        assert info["served_model_name"] == "tiny" and info["page_size"] == 16
        assert info["max_total_num_tokens"] == 2048 and info["chunked_prefill_size"] == 32
        assert info["context_length"] == server.runtime.max_len > 0
        assert info["storage"] == f"file://{tmp_path}" and info["disable_radix_cache"] is False
        assert info["kv_pools"] == ["swa", "c4", "c4_index", "c128", "state"]
        assert info["tp_size"] == info["dp_size"] == 1
        idle = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert get("/get_load").json() == idle
        _load_while_a_request_runs(server, get)
        wait_for(lambda: get("/get_load").json() == idle, what="the load back at 0")
    finally:
        server.stop()


def _load_while_a_request_runs(server: ServerThread, get) -> None:
    """A long stream is in flight: the load counts it and its prompt tokens (leaving the
    stream aborts it)."""
    body = {"input_ids": list(range(5, 45)), "stream": True,
            "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=auth(),
                      timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream (an abort)
        next(lines)  # the first token is out: the request is running
        running = [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 40}]
        # (the snapshot is the last step's: the one after the first token may lag it a bit)
        wait_for(lambda: get("/get_load").json() == running, what="the load of one request")


def test_storage_credentials_stay_out_of_server_info():
    assert _redact("redis://:s3cret@10.0.0.5:6379/0") == "redis://***@10.0.0.5:6379/0"
    assert _redact("redis://user:pw@h:1/2") == "redis://***@h:1/2"
    assert _redact("file:///var/cache/kv") == "file:///var/cache/kv" and _redact(None) is None


def test_every_serve_flag_given_to_the_fleet_reaches_each_instance():
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--model", "tiny", "--port", "8000", "--instances", "3",
                          "--page-size", "32", "--storage", "file:///x", "--api-key", "k",
                          "--disable-prefix-cache", "--router-policy", "round_robin"])
    assert instance_argv(args) == ["--port", "0", "--model", "tiny", "--page-size", "32",
                                   "--storage", "file:///x", "--disable-prefix-cache",
                                   "--api-key", "k"]


def test_the_router_and_its_metrics_listen_on_the_fleets_host_alone():
    """Both on --host (an IPv6 one in brackets for --host, bare for --prometheus-host, as
    sglang-router 0.3 parses them: one it cannot parse silently becomes 0.0.0.0); a host
    name, the same port twice, or --router-args naming a flag the fleet sets are refused."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)

    def flags(*argv: str) -> dict[str, str]:
        words = router_argv(ap.parse_args(["--model", "tiny", *argv]), ["http://[::1]:1"],
                            8000, 9100)
        return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--host")
                or w.startswith("--p")}

    assert flags() == {"--host": "127.0.0.1", "--port": "8000", "--prometheus-host":
                       "127.0.0.1", "--prometheus-port": "9100", "--policy": "cache_aware"}
    assert flags("--host", "::1")["--host"] == "[::1]"
    assert flags("--host", "::1")["--prometheus-host"] == "::1"
    for argv, says in [(["--host", "localhost"], "--host must be an IP address"),
                       (["--port", "9000", "--router-metrics-port", "9000"], "must differ"),
                       (["--router-args=--prometheus-port 29000"], "--prometheus-port is"),
                       (["--router-args=--host=0.0.0.0"], "--host is the fleet's own"),
                       (["--speculative-num-draft-tokens", "3"], "--speculative-algorithm")]:
        with pytest.raises(ValueError, match=says):
            _check(ap.parse_args(["--model", "tiny", *argv]))


# ------------------------------------------------------------------------ the fleet
def served(urls: dict[int, str]) -> dict[int, float]:
    return {i: sum(v for k, v in metrics(url).items() if k.startswith("shadowradix:requests_total"))
            for i, url in urls.items()}


def stored_objects(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


def settle(path: Path) -> None:
    """Wait until the shared store stops growing: the writes of the last turn landed."""
    last, stable = -1, 0
    deadline = time.monotonic() + 20
    while stable < 4 and time.monotonic() < deadline:
        n = stored_objects(path)
        stable = stable + 1 if n == last else 0
        last = n
        time.sleep(0.1)


def chat(client: openai.OpenAI, messages: list[dict[str, str]]) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="tiny", messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)


def reference_answers() -> dict[str, list[str]]:
    """What one plain `shadowradix serve --model tiny` answers, turn by turn, for every
    conversation the fleet test sends (greedy: the answers are the model's)."""
    server = ServerThread.from_args("--model", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out: dict[str, list[str]] = {}
        for opening in [*OPENINGS, FORCED]:
            messages: list[dict[str, str]] = []
            answers = out[opening] = []
            for user in [opening, *FOLLOW_UPS]:
                messages.append({"role": "user", "content": user})
                answers.append(chat(client, messages).choices[0].message.content or "")
                messages.append({"role": "assistant", "content": answers[-1]})
        return out
    finally:
        server.stop()


def test_two_servers_behind_the_router_share_l3(tmp_path):
    """4 conversations x 3 turns through the router, one request at a time: every answer
    is a plain server's. Before the last turn the busiest instance leaves the router, so
    its conversations move to the other one, which loads their prefixes from storage; a
    conversation whose second turn is sent to the other instance directly does the same.
    SIGTERM stops the router and both servers, exit 0, no process left."""
    want = reference_answers()
    store = tmp_path / "l3"
    fleet = FleetProcess("--instances", "2", "--model", "tiny", "--storage", f"file://{store}",
                         "--port", "0", "--api-key", KEY, "--drain-timeout", "10")
    try:
        assert len(fleet.instances) == 2 and len(fleet.children) == 3, fleet.log
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # the router asks for the key too
            chat(openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="wrong", max_retries=0),
                 [{"role": "user", "content": "hi"}])
        _routed_conversations(client, fleet, store, want)
        _second_turn_on_the_other_instance(fleet.instances, store, want)
        assert fleet.terminate(90) == 0, "".join(fleet.log)
        assert not [pid for pid in fleet.children if alive(pid)]
    finally:
        fleet.kill()


def _routed_conversations(client: openai.OpenAI, fleet: FleetProcess, store: Path,
                          want: dict[str, list[str]]) -> None:
    talks: dict[str, list[dict[str, str]]] = {o: [] for o in OPENINGS}
    where: dict[str, int] = {}  # the instance that served a conversation's last turn
    moved = 0
    for turn, follow_up in enumerate([None, *FOLLOW_UPS]):
        if turn == len(FOLLOW_UPS):  # the last turn: the busiest instance leaves the router
            busiest = max(fleet.instances, key=list(where.values()).count)
            _leave_router(fleet.url, fleet.instances[busiest])
        for opening, messages in talks.items():  # one at a time: the metrics say where
            messages.append({"role": "user", "content": follow_up or opening})
            before = served(fleet.instances)
            out = chat(client, messages)
            after = served(fleet.instances)
            [now] = [i for i in fleet.instances if after[i] > before[i]]
            answer = out.choices[0].message.content or ""
            assert answer == want[opening][turn], (opening, turn)
            by_tier = out.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
            if turn and where[opening] != now:  # routed elsewhere: L3 has its prefix
                assert by_tier["device"] == 0 and by_tier["storage"] > 0, (opening, by_tier)
                moved += 1
            where[opening] = now
            messages.append({"role": "assistant", "content": answer})
            settle(store)
    assert moved > 0


def _leave_router(router: str, instance: str) -> None:
    """Take an instance out of the router's rotation (its control plane: DELETE
    /workers/ID), as when an instance is drained; the process keeps running."""
    def workers() -> dict[str, str]:
        r = httpx.get(f"{router}/workers", headers=auth(), timeout=10)
        return {w["url"]: w["id"] for w in r.raise_for_status().json()["workers"]}

    r = httpx.delete(f"{router}/workers/{workers()[instance]}", headers=auth(), timeout=10)
    assert r.status_code in (200, 202), r.text
    wait_for(lambda: instance not in workers(), what="the router to drop the instance")


def _second_turn_on_the_other_instance(instances: dict[int, str], store: Path,
                                       want: dict[str, list[str]]) -> None:
    first, other = (openai.OpenAI(base_url=f"{instances[i]}/v1", api_key=KEY, max_retries=0)
                    for i in (0, 1))
    messages = [{"role": "user", "content": FORCED}]
    out = chat(first, messages)
    assert out.choices[0].message.content == want[FORCED][0]
    settle(store)
    messages += [{"role": "assistant", "content": want[FORCED][0]},
                 {"role": "user", "content": FOLLOW_UPS[0]}]
    out = chat(other, messages)
    assert out.choices[0].message.content == want[FORCED][1]
    by_tier = out.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
    assert by_tier["device"] == 0 and by_tier["storage"] >= 16, by_tier


def test_an_instance_that_dies_stops_the_fleet(tmp_path):
    """SIGKILL one instance: the fleet stops the router and the rest, says which child died,
    and exits 1."""
    fleet = FleetProcess("--instances", "1", "--model", "tiny", "--port", "0")
    try:
        [instance] = [pid for pid in fleet.children
                      if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(instance, signal.SIGKILL)
        assert fleet.proc.wait(60) == 1
        assert not [pid for pid in fleet.children if alive(pid)]
        wait_for(lambda: any("exited with code -9; stopping the fleet" in line
                             for line in fleet.log), what="the fleet's message")
    finally:
        fleet.kill()


def test_an_instance_that_cannot_start_fails_the_fleet(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shadowradix", "fleet", "--model",
                           str(tmp_path), "--port", "0", "--instances", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1
    assert "config.json" in proc.stderr  # the instance's own message, forwarded
    assert "instance 0" in proc.stderr and "before it could print its URL" in proc.stderr
    assert "[router]" not in proc.stderr

