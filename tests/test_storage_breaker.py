"""A stalled store costs at most one bounded wait, and a flush it did not answer raises."""

import time

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.storage import RedisBackend, StorageUnavailable, object_key
from shadowradix.tiers.storage.breaker import CircuitBreaker

P = SamplingParams(max_new_tokens=3, ignore_eos=True)


def key(i: int) -> str:
    return object_key("ns", "c4", i.to_bytes(16, "little"))


def test_the_breaker_opens_backs_off_and_closes():
    now = [0.0]
    b = CircuitBreaker(backoff_s=2.0, max_backoff_s=5.0, clock=lambda: now[0])
    assert b.allow() and not b.is_open
    b.failed()
    assert not b.allow()
    now[0] = 2.0
    assert b.allow()  # the probe
    b.failed()  # failed again: twice the wait
    now[0] = 5.9
    assert not b.allow()
    now[0] = 6.0
    assert b.allow()
    b.failed()
    now[0] = 10.9  # capped at 5 s
    assert not b.allow()
    now[0] = 11.0
    b.succeeded()
    assert b.allow() and not b.is_open
    with pytest.raises(ValueError, match="backoff"):
        CircuitBreaker(backoff_s=0)


def test_a_stalled_server_costs_one_timeout_then_answers_at_once(redis_server):
    rs = RedisBackend(redis_server.url, timeout_s=0.5, backoff_s=1.0)
    assert rs.batch_set([(key(1), b"one")]) == [True]
    redis_server.pause()
    t0 = time.monotonic()
    for _ in range(10):
        assert rs.batch_get([key(1)]) == [None]
        assert rs.batch_set([(key(2), b"two")]) == [False]
    assert time.monotonic() - t0 < 1.0  # one 0.5 s timeout, not twenty
    assert rs.errors["unreachable"] == 1 and rs.errors["skipped"] == 19
    with pytest.raises(StorageUnavailable, match="did not answer"):
        rs.clear("ns")  # an explicit request tries, and says it failed
    redis_server.resume()
    time.sleep(2.1)  # past the back-off (clear's failure while it was open kept it at 1 s)
    assert rs.batch_get([key(1)]) == [b"one"]
    assert rs.batch_set([(key(2), b"two")]) == [True]
    assert rs.clear("ns") == 2
    rs.close()


def time_store_calls(backend, monkeypatch) -> list[float]:
    """Seconds each read or write call to `backend` takes, appended as they return.
    (Wall time of whole requests would measure the machine's load as much as the store.)"""
    spent: list[float] = []
    def timed(call):
        def run(*args):
            t0 = time.monotonic()
            try:
                return call(*args)
            finally:
                spent.append(time.monotonic() - t0)
        return run

    for name in ("batch_exists", "batch_get", "batch_set"):
        monkeypatch.setattr(backend, name, timed(getattr(backend, name)))
    return spent


def test_requests_against_a_stalled_server_wait_once_and_stay_exact(redis_server, monkeypatch):
    model = tiny_model()
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                            storage=redis_server.url))
    stored = rand_tokens(60, 70)
    eng.generate([stored], P)
    eng.storage.drain()
    eng.cache.flush(tiers="device")  # a bare tier name is one tier
    spent = time_store_calls(eng.storage.backend, monkeypatch)
    redis_server.pause()
    prompts = [stored + rand_tokens(8, 71)] + [rand_tokens(50, 72 + i) for i in range(3)]
    results = [eng.generate([p], P, return_logits=True)[0] for p in prompts]
    eng.storage.drain()
    for p, r in zip(prompts, results, strict=True):
        check(model, p, r)
        assert r.cached_tokens == 0
    # One 1 s timeout; without the breaker each of the 8 reads and write-throughs waits
    # its own, one after another on the storage thread.
    assert len(spent) == 8 and sum(spent) < 1.5, spent
    errors = eng.storage.error_counts
    assert errors["unreachable"] == 1 and errors["skipped"] == 7, errors
    with pytest.raises(RuntimeError, match="did not answer"):
        eng.cache.flush(tiers=("storage",))
    redis_server.resume()
    eng.close()
