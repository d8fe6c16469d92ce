"""Large calls to a healthy store (found by an attack on L3): one store call moves at most
what the store moves within half its deadline, so a long stored prefix or a large
write-through batch is never timed out, counted unreachable and shut off by the breaker
for every other request; and write-through waiting for a store that cannot keep up is
bounded (the rest is dropped, counted), so memory and `close()` stay bounded.

The tiny model's pages are 13 KB: the store's assumed rate (`RATE_FLOOR`) is scaled down
with them, and a real Valkey is reached through a proxy that moves about 400 KB/s."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_engine import rand_tokens
from test_storage_slow import P, TrickleProxy
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine
from shadowradix.layout.spec import KVLayout, PoolSpec, Retention
from shadowradix.model.fingerprint import model_fingerprint
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.storage import RedisBackend, pace
from shadowradix.tiers.storage_tier import StorageTier

DEADLINE = 0.5
PAGES = 40  # 517 KB of objects: over a second through the proxy


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def slow(redis_server, monkeypatch):
    """A proxy to the test's Valkey moving 8 KB every 20 ms (about 400 KB/s), and a
    store rate assumed at 200 KB/s (calls of 50 KB at a 0.5 s deadline)."""
    monkeypatch.setattr(pace, "RATE_FLOOR", 200_000)
    proxy = TrickleProxy(redis_server.port, chunk=8192, interval=0.02)
    yield proxy
    proxy.close()


def stored_prompt(model, redis_server) -> tuple[Engine, np.ndarray]:
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096,
                                            storage=redis_server.url))
    tokens = rand_tokens(PAGES * 16 + 3, 60)
    eng.generate([tokens], P)
    eng.storage.drain()
    return eng, np.asarray(tokens, dtype=np.int32)


def save(tier: StorageTier, eng: Engine, pages: int, seed: int) -> np.ndarray:
    """Write-through of `pages` pages of new tokens (the engine's first pages' bytes)."""
    tokens = np.asarray(rand_tokens(pages * 16, seed), dtype=np.int32)
    tier.save(tokens, 0, pages, {n: np.arange(pages) for n in eng.layout.pool_names},
              eng._prefix.tensor)
    return tokens


def tier_over(eng: Engine, model, proxy: TrickleProxy, **kw) -> StorageTier:
    return StorageTier(RedisBackend(proxy.url, timeout_s=DEADLINE, **kw), eng._prefix,
                       model_fingerprint(model))


@pytest.fixture
def stored(model, redis_server, slow):
    """An engine that stored a prompt of PAGES pages, and a tier over the slow proxy to the
    same store; both closed after the test."""
    eng, tokens = stored_prompt(model, redis_server)
    tier = tier_over(eng, model, slow)
    yield eng, tier, tokens
    tier.close()
    eng.close()


def test_a_long_stored_prefix_is_read_in_part_and_never_shuts_the_store_off(
        stored, slow) -> None:
    eng, tier, tokens = stored
    empty = np.zeros((len(eng.layout.pool_names), 0), dtype=np.int32)
    slow.down = "trickle"
    first = tier.prefetch(tokens, empty, PAGES).result()
    assert 0 < first.pages < PAGES  # as much as one call moves within its deadline
    assert tier.backend.errors["unreachable"] == 0, tier.backend.errors
    # Another request's read right after is served, not skipped by an open breaker.
    again = tier.prefetch(tokens, empty, first.pages).result()
    assert again.pages == first.pages
    assert tier.errors == 0, tier.error_counts
    assert tier.rate > pace.RATE_FLOOR  # it learnt the store is faster than that


def test_a_large_write_through_batch_goes_in_calls_each_within_the_deadline(
        stored, slow) -> None:
    eng, tier, _ = stored
    slow.up = "trickle"
    t0 = time.monotonic()
    tokens = save(tier, eng, PAGES, 61)
    tier.drain()
    assert tier.errors == 0, tier.error_counts
    assert tier.bytes_written == PAGES * sum(eng.layout.page_bytes().values())
    assert time.monotonic() - t0 > DEADLINE  # it did take longer than one deadline
    slow.up = "fast"
    empty = np.zeros((len(eng.layout.pool_names), 0), dtype=np.int32)
    assert tier.prefetch(tokens, empty, 2).result().pages == 2


def test_write_through_to_a_stalled_store_is_bounded_and_close_is_prompt(
        stored, slow) -> None:
    eng, tier, _ = stored
    slow.up = "stall"
    batch = 4  # 52 KB a save; the backlog holds 8 calls of 50 KB
    for i in range(30):
        save(tier, eng, batch, 100 + i)
    assert tier.faults["write_dropped"] >= (30 - 9) * batch * len(eng.layout.pool_names)
    assert tier.backlog.bytes <= tier.backlog_bytes + batch * 12928
    t0 = time.monotonic()
    tier.close()
    assert time.monotonic() - t0 < 9 * DEADLINE + 2.0  # at most the backlog's deadlines
    assert tier.backlog.bytes == 0


def test_the_pace_falls_back_when_the_store_slows_and_rises_when_it_is_fast(
        model, redis_server, slow) -> None:
    """A rate learnt while the store was fast is dropped at the first timeout (before, it
    never came down: every later long read timed out); and a store many times faster than
    the rate raises it (before, a call that fast never counted)."""
    eng, tokens = stored_prompt(model, redis_server)
    tier = tier_over(eng, model, slow)
    empty = np.zeros((len(eng.layout.pool_names), 0), dtype=np.int32)
    got = [tier.prefetch(tokens, empty, PAGES).result().pages for _ in range(12)]
    assert got[-1] >= 4 * got[0], got  # fast: it learnt to read (nearly) all of it
    assert tier.rate > 10 * pace.RATE_FLOOR
    slow.down = "trickle"  # about 400 KB/s
    first = tier.prefetch(tokens, empty, PAGES).result()
    assert first.pages == 0 and tier.backend.errors["unreachable"] == 1  # timed out
    assert tier.rate == pace.RATE_FLOOR
    # A call larger than the floor's timing out is no sign of a dead store: the breaker
    # stays closed, and the reads right after ask for less (before: the store was shut
    # off for the breaker's back-off, 5 s, every read skipped).
    again = [tier.prefetch(tokens, empty, PAGES).result().pages for _ in range(3)]
    assert all(0 < n < PAGES for n in again), again
    assert tier.backend.errors["unreachable"] == 1, tier.backend.errors
    assert tier.backend.errors["skipped"] == 0, tier.backend.errors
    tier.close()
    eng.close()


def test_a_save_whose_submission_fails_after_queueing_gives_its_room_back_once(
        stored, monkeypatch) -> None:
    """The executor queues a work item before it starts its thread: a save that raised
    there still runs later. Its room in the backlog goes back once (before: twice, and
    the backlog went negative)."""
    import concurrent.futures.thread as cft

    eng, tier, _ = stored
    real = cft.ThreadPoolExecutor._adjust_thread_count
    fail = {"n": 1}

    def adjust(self):
        if fail["n"]:
            fail["n"] -= 1
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(cft.ThreadPoolExecutor, "_adjust_thread_count", adjust)
    with pytest.raises(RuntimeError, match="new thread"):
        save(tier, eng, 4, 70)
    assert tier.backlog.bytes == 0
    save(tier, eng, 4, 70)
    tier.drain()
    assert tier.backlog.bytes == 0


def window_store(url: str, monkeypatch) -> tuple[PrefixCache, np.ndarray, np.ndarray]:
    """A window of 3 pages (page 4), calls of 2 pages at the pace's floor (deadline 0.5 s):
    12 pages stored at `url`, and a held table of the first 4 whose window pages are gone
    (it resumes from storage only with 3 stored pages, more than a call: 240 KB, longer
    than the deadline through the slow proxy)."""
    layout = KVLayout("wide-window", (  # tiny_layout's pools, pages of 80 KB
        PoolSpec("kv", 1, Retention.ALL, (2048,), "float32", 1),
        PoolSpec("c2", 2, Retention.ALL, (2048,), "float32", 1),
        PoolSpec("swa", 1, Retention.WINDOW, (2048,), "float32", 1, window=13),
        PoolSpec("state", None, Retention.CHECKPOINT, (3,), "float32", 1)), 4)
    cache = PrefixCache(layout, 64, device="cpu")
    monkeypatch.setattr(pace, "RATE_FLOOR", 2 * 4 * sum(layout.page_bytes().values()))
    tier = StorageTier(RedisBackend(url, timeout_s=DEADLINE), cache, "fp")
    tokens = np.arange(4 * 12 + 1, dtype=np.int32)
    tier.save(tokens, 0, 12, {n: np.arange(12) for n in layout.pool_names}, cache.tensor)
    tier.close()
    table = np.full((len(layout.pools), 4), -1, np.int32)
    for row, spec in enumerate(layout.pools):
        if spec.retention is Retention.ALL:
            table[row] = np.arange(4)  # held: every ALL page; the window's are gone
    return cache, tokens, table


def test_a_window_wider_than_a_call_is_read_to_its_nearest_resume_point(redis_server,
                                                                      monkeypatch) -> None:
    """The read takes the 3 pages (before, it read nothing, ever: no call, so nothing to
    learn a faster pace from)."""
    cache, tokens, table = window_store(redis_server.url, monkeypatch)
    tier = StorageTier(RedisBackend(redis_server.url, timeout_s=DEADLINE), cache, "fp")
    got = tier.prefetch(tokens, table, 12).result()
    assert (got.start, got.stop) == (4, 7), (got.start, got.stop)
    assert tier.errors == 0, tier.error_counts
    tier.close()


def test_such_a_read_timing_out_at_the_floor_shuts_the_store_off(redis_server, slow,
                                                                 monkeypatch) -> None:
    """That read is larger than a call at the floor; timing out, it is no learnt pace's
    mistake: the breaker opens (a stalled store costs one deadline, not one per read)."""
    cache, tokens, table = window_store(redis_server.url, monkeypatch)
    tier = StorageTier(RedisBackend(slow.url, timeout_s=DEADLINE), cache, "fp")
    slow.down = "trickle"  # the probe passes, the read takes 0.6 s
    assert tier.prefetch(tokens, table, 12).result().pages == 0
    assert tier.prefetch(tokens, table, 12).result().pages == 0
    assert tier.backend.errors["unreachable"] == 1, tier.backend.errors
    assert tier.backend.errors["skipped"] >= 1, tier.backend.errors
    tier.close()
