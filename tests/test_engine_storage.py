"""L3 through the engine: a fresh Engine over the same store hits exactly; faults are misses."""

from pathlib import Path

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def two_engines(model, url: str, prompt: list[int], host_tokens: int = 0):
    """Engine 1 serves `prompt` and writes through; engine 2 (empty device) gets turn 2."""
    cfg = CacheConfig(page_size=16, device_tokens=2048, host_tokens=host_tokens, storage=url)
    first = Engine.from_hf(model, cfg)
    r1 = first.generate([prompt], P)[0]
    first.close()
    second = Engine.from_hf(model, cfg)
    turn2 = prompt + r1.output_ids + rand_tokens(9, 99)
    return second, turn2


@pytest.fixture
def redis_url(tmp_path):
    from redis_server import RedisServer

    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.mark.parametrize("backend,host_tokens", [("file", 0), ("redis", 0), ("file", 4096),
                                                 ("redis", 4096)])
def test_a_fresh_engine_hits_from_storage_exactly(model, tmp_path, redis_url, backend,
                                                  host_tokens):
    """L3 -> L1 without a host tier; L3 -> L2 -> L1 with one."""
    url = f"file://{tmp_path / 'l3'}" if backend == "file" else redis_url.url
    prompt = rand_tokens(75, 40)
    eng, turn2 = two_engines(model, url, prompt, host_tokens)
    r = eng.generate([turn2], P, return_logits=True)[0]
    assert r.cached_by_tier == {"device": 0, "host": 0, "storage": 64}
    check(model, turn2, r)
    again = eng.generate([turn2], P, return_logits=True)[0]  # now the device tree has it
    assert again.cached_by_tier["device"] == 80 and again.cached_by_tier["storage"] == 0
    check(model, turn2, again)
    assert eng.stats()["hits"]["storage"] == 64 and eng.stats()["storage_errors"] == 0
    if host_tokens:  # the prefix went through the host: it serves after a device flush
        eng.cache.flush(tiers=("device",))
        third = eng.generate([turn2], P, return_logits=True)[0]
        assert third.cached_by_tier["host"] == 80
        check(model, turn2, third)
    eng.cache.flush(tiers=("device", "host", "storage") if host_tokens else
                    ("device", "storage"))
    cold = eng.generate([turn2], P, return_logits=True)[0]
    assert cold.cached_tokens == 0  # every tier was emptied
    check(model, turn2, cold)
    eng.close()


def test_corrupt_or_truncated_objects_mean_recompute(model, tmp_path):
    root = tmp_path / "l3"
    eng, turn2 = two_engines(model, f"file://{root}", rand_tokens(75, 41))
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    files[0].write_bytes(files[0].read_bytes()[:-7])
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0x55
    files[1].write_bytes(bytes(data))
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)  # exact whatever storage held
    assert r.cached_by_tier["storage"] < 64
    assert eng.stats()["storage_errors"] >= 1


def test_unwritable_store_keeps_requests_exact(model, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the store's directory cannot be created under it
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                            storage=f"file://{blocker}/store"))
    prompt = rand_tokens(50, 42)
    check(model, prompt, eng.generate([prompt], P, return_logits=True)[0])
    eng.storage.drain()  # write-through runs on the storage thread
    assert eng.stats()["storage_errors"] >= 1


def test_a_full_disk_cap_keeps_requests_exact(model, tmp_path):
    """A cap of a few pages: most of the prefix is gone from disk by the second engine,
    so it hits part of it or nothing, and is exact either way."""
    root = tmp_path / "l3"
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=f"file://{root}",
                      storage_cap_bytes=40_000)
    first = Engine.from_hf(model, cfg)
    prompt = rand_tokens(75, 44)
    r1 = first.generate([prompt], P)[0]
    first.close()
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) <= 40_000
    second = Engine.from_hf(model, cfg)
    turn2 = prompt + r1.output_ids + rand_tokens(9, 45)
    r = second.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] < 64
    second.close()


@pytest.mark.parametrize("host_tokens", [0, 4096])
def test_server_killed_mid_run_requests_complete_exactly(model, redis_url, host_tokens):
    eng, turn2 = two_engines(model, redis_url.url, rand_tokens(75, 43), host_tokens)
    redis_url.stop()
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] == 0 and eng.stats()["storage_errors"] >= 1
    eng.close()


def test_bad_storage_url_is_refused():
    with pytest.raises(ValueError, match="storage must be"):
        CacheConfig(storage="s3://bucket")


def test_server_killed_while_requests_run(model, redis_url):
    """The kill lands somewhere among reads, write-throughs and prefetches of a batch in
    flight: whatever it hits, every request completes and is exact."""
    import threading

    cfg = CacheConfig(page_size=16, device_tokens=2048, host_tokens=4096, storage=redis_url.url)
    eng = Engine.from_hf(model, cfg)
    prompts = [rand_tokens(60, 80 + i) for i in range(6)]
    eng.generate(prompts[:3], P)  # stored, so later requests read too
    killer = threading.Timer(0.3, redis_url.stop)
    killer.start()
    batch = prompts + [p + rand_tokens(20, 90 + i) for i, p in enumerate(prompts[:3])]
    results = eng.generate(batch, P, return_logits=True)
    killer.join()
    for p, r in zip(batch, results, strict=True):
        check(model, p, r)
    eng.close()


def test_the_directory_becoming_unwritable_mid_run_keeps_requests_exact(model, tmp_path):
    """The store's directory is swapped for a plain file between requests (root ignores
    permission bits, so a chmod would prove nothing): reads miss, writes fail, and
    every request still completes exactly."""
    root = tmp_path / "l3"
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                            storage=f"file://{root}"))
    prompt = rand_tokens(75, 46)
    r1 = eng.generate([prompt], P)[0]
    eng.storage.drain()
    root.rename(tmp_path / "gone")
    root.write_text("not a directory any more")
    eng.cache.flush(tiers=("device",))
    turn2 = prompt + r1.output_ids + rand_tokens(9, 47)
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_tokens == 0
    eng.storage.drain()
    assert eng.stats()["storage_errors"] >= 1
    eng.close()


def test_stored_pages_too_many_for_the_host_go_straight_to_the_device(model, tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    prompt = rand_tokens(75, 48)
    first = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, storage=url))
    r1 = first.generate([prompt], P)[0]
    first.close()
    tiny_host = CacheConfig(page_size=16, device_tokens=2048, host_tokens=32, storage=url)
    eng = Engine.from_hf(model, tiny_host)  # 2 host pages: the 4 stored pages do not fit
    turn2 = prompt + r1.output_ids + rand_tokens(9, 49)
    r = eng.generate([turn2], P, return_logits=True)[0]
    assert r.cached_by_tier == {"device": 0, "host": 0, "storage": 64}
    check(model, turn2, r)
    eng.close()


def test_pages_stored_from_a_running_request_hold_their_own_data(model, tmp_path):
    """A long prompt runs in chunks while the window pages it left behind are evicted and
    handed to other requests (a 6-page window pool, pages poisoned as they are handed out);
    what it wrote through must still be its own data: a fresh engine sharing only an early
    part of it resumes from storage exactly."""
    url = f"file://{tmp_path / 'l3'}"
    first = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                              window_tokens=96, storage=url,
                                              debug_poison=True), step_tokens=32)
    long = rand_tokens(200, 41)
    first.generate([long] + [rand_tokens(150, 42 + i) for i in range(3)], P)
    assert first.stats()["pools"]["swa"]["evicted"] > 0
    first.close()
    second = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, storage=url))
    branch = long[:100] + rand_tokens(20, 60)
    r = second.generate([branch], P, return_logits=True)[0]
    assert r.cached_by_tier["storage"] == 96
    check(model, branch, r)
    second.close()


def test_a_slow_storage_read_holds_back_only_its_own_request(model, redis_url):
    """A request whose L3 read hangs (the server paused) keeps its place in the queue, but
    a later one that needs no read (its prefix is on the device) is admitted meanwhile;
    once the read gives up, everything completes exactly. (Before: the queue waited.)"""
    stored = rand_tokens(75, 40)
    eng, turn2 = two_engines(model, redis_url.url, stored)
    held = rand_tokens(70, 41)
    eng.generate([held], P)  # on the device from now on
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eng.add_request(rand_tokens(20, 42), long)
    for _ in range(3):
        eng.step()
    redis_url.pause()
    try:
        slow = eng.add_request(turn2, P, return_logits=True)
        fast = eng.add_request(held, P, return_logits=True)
        done: dict = {}
        first_token: list[str] = []
        while fast not in done:
            for out in eng.step():
                if out.new_token_ids and out.request_id not in first_token:
                    first_token.append(out.request_id)
                if out.finished:
                    done[out.request_id] = out.result
        assert slow not in first_token  # still waiting for its read
    finally:
        redis_url.resume()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.result
    check(model, held, done[fast])
    check(model, turn2, done[slow])
    assert done[fast].cached_by_tier["device"] == 64
    eng.check_integrity()
    eng.close()
