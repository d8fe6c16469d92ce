"""The server's engine loop outlives a fault in a command it runs between steps: an abort
whose pool free faults (a client that disconnected mid-stream) killed the engine thread,
and every request in flight or sent later hung while /health still said ok (found by an
attack; the test fails on the code before its mend)."""

from __future__ import annotations

import threading

import httpx
from server_util import ServerThread


def test_a_fault_while_aborting_a_disconnected_client_leaves_the_loop_serving():
    with ServerThread.from_args("--model", "tiny", "--device-tokens", "2048",
                                "--step-tokens", "64") as srv:
        fired = []

        def arm(engine):
            real_abort = engine.abort

            def abort(rid):
                pool = engine._prefix.pools["swa"]
                real_free = pool.free

                def free(pages):
                    if not fired:
                        fired.append(rid)
                        raise RuntimeError("injected: a pool's free failed in an abort")
                    return real_free(pages)

                pool.free = free
                try:
                    return real_abort(rid)
                finally:
                    pool.free = real_free

            engine.abort = abort

        srv.on_engine(arm)
        result = {}

        def bystander():
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "every form of a token", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True})
            result["status"] = r.status_code

        thread = threading.Thread(target=bystander)
        thread.start()
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "hello world " * 5, "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    break  # the client goes away mid-stream: the server aborts it
        thread.join(90)
        assert result.get("status") == 200, result
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert fired, "no abort faulted: the repro needs one"
        assert srv.runtime.loop._thread.is_alive()
        srv.on_engine(lambda engine: engine.check_integrity())
