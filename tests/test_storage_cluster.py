"""L3 on a real 3-master Valkey Cluster (127.0.0.1): slot-grouped batches, clear across
masters, a master killed, stalled or restarted, and several engines sharing one store."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.storage import RedisClusterBackend, decode, object_key, open_storage
from shadowradix.tiers.storage.redis_cluster import cluster_key, slot_of

P = SamplingParams(max_new_tokens=5, ignore_eos=True)
POOLS = ("kv", "c4", "swa")


def key(i: int, pool: str = "c4", ns: str = "ns") -> str:
    return object_key(ns, pool, i.to_bytes(16, "little"))


def page_items(n: int, ns: str = "ns") -> list[tuple[str, bytes]]:
    """n pages of three pools each, payload naming its key."""
    return [(key(i, p, ns), f"{p}-{i}".encode() * 10) for i in range(n) for p in POOLS]


def raw(cluster):  # type: ignore[no-untyped-def]
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])


def masters_of(cluster, keys: list[str]) -> set[str]:  # type: ignore[no-untyped-def]
    rc = raw(cluster)
    try:
        return {rc.get_node_from_key(cluster_key(k)).name for k in keys}
    finally:
        rc.close()


# ------------------------------------------------------------------ backend
def test_roundtrip_across_slots_and_masters(valkey_cluster):
    store = open_storage(valkey_cluster.url)
    items = page_items(40)
    assert masters_of(valkey_cluster, [k for k, _ in items]) == {
        f"127.0.0.1:{p}" for p in valkey_cluster.ports}  # the batch spans every master
    assert store.batch_set(items) == [True] * len(items)
    missing = key(999)
    keys = [k for k, _ in items] + [missing]
    assert store.batch_exists(keys) == [True] * len(items) + [False]
    assert store.batch_get(keys) == [v for _, v in items] + [None]
    assert store.batch_get([]) == [] and store.batch_set([]) == []
    assert not store.errors
    store.close()


def test_a_page_shares_one_slot_and_no_command_crosses_slots(valkey_cluster, monkeypatch):
    """Every pool's object of one page hashes to one slot (the page hash is the tag); a
    batch is one pipeline per master, and each MGET names keys of one slot only."""
    import redis

    assert len({slot_of(cluster_key(key(7, p))) for p in POOLS}) == 1
    assert len({slot_of(cluster_key(key(i))) for i in range(40)}) > 30  # pages spread
    sent: list[tuple[str, list[tuple]]] = []
    execute = redis.client.Pipeline.execute

    def spy(self, raise_on_error=True):  # type: ignore[no-untyped-def]
        node = self.connection_pool.connection_kwargs["port"]
        sent.append((node, [args for args, _ in self.command_stack]))
        return execute(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", spy)
    store = RedisClusterBackend(valkey_cluster.url)
    items = page_items(30)
    store.batch_set(items)
    sent.clear()
    assert store.batch_get([k for k, _ in items]) == [v for _, v in items]
    assert sorted(port for port, _ in sent) == sorted(valkey_cluster.ports)  # one per master
    mgets = [args for _, cmds in sent for args in cmds]
    assert len(mgets) == 30 and all(args[0] == "MGET" and len(args) == 4 for args in mgets)
    for args in mgets:
        assert len({slot_of(k) for k in args[1:]}) == 1
    assert not store.errors  # the server would have refused a cross-slot MGET
    store.close()


def test_clear_removes_one_namespace_from_every_master(valkey_cluster):
    store = open_storage(valkey_cluster.url)
    mine, theirs = page_items(20, "ns-a"), page_items(10, "ns-b")
    store.batch_set(mine + theirs)
    assert len(masters_of(valkey_cluster, [k for k, _ in mine])) == 3
    assert store.clear("ns-a") == 60
    assert store.batch_exists([k for k, _ in mine]) == [False] * 60
    assert store.batch_get([k for k, _ in theirs]) == [v for _, v in theirs]
    assert store.clear("ns-a") == 0 and not store.errors
    store.clear("ns-b")
    store.close()


def test_an_object_copied_under_another_key_is_a_miss(valkey_cluster):
    store = open_storage(valkey_cluster.url)
    store.batch_set([(key(1), b"page one")])
    rc = raw(valkey_cluster)
    rc.set(cluster_key(key(2)), rc.get(cluster_key(key(1))))  # intact bytes, wrong place
    rc.close()
    assert store.batch_exists([key(2)]) == [True]  # a probe cannot tell ...
    assert store.batch_get([key(1), key(2)]) == [b"page one", None]  # ... a read does
    assert store.errors["wrong_key"] == 1
    store.close()


def test_a_killed_master_is_misses_then_a_restarted_one_hits_again(valkey_cluster):
    store = RedisClusterBackend(valkey_cluster.url, backoff_s=0.5, refresh_s=0.1)
    items = page_items(30)
    keys = [k for k, _ in items]
    assert store.batch_set(items) == [True] * 90
    dead = f"127.0.0.1:{valkey_cluster.ports[1]}"
    rc = raw(valkey_cluster)
    on_dead = [rc.get_node_from_key(cluster_key(k)).name == dead for k in keys]
    rc.close()
    assert 0 < sum(on_dead) < 90
    valkey_cluster.kill(1)
    t0 = time.monotonic()
    for _ in range(5):
        got = store.batch_get(keys)
        assert got == [None if d else v for d, (_, v) in zip(on_dead, items, strict=True)]
        assert store.batch_set(items) == [not d for d in on_dead]
    assert time.monotonic() - t0 < 3.0  # refused at once, then skipped by the breaker
    assert store.errors["unreachable"] >= 1 and store.errors["skipped"] >= 1
    assert set(store.errors) <= {"unreachable", "skipped", "topology", "uncovered"}

    valkey_cluster.restart(1)  # rejoins as the same node, its slots back (data gone)
    deadline = time.monotonic() + 10
    while store.batch_set(items) != [True] * 90:  # once its back-off ends, it is probed
        assert time.monotonic() < deadline, store.errors
        time.sleep(0.2)
    assert store.batch_get(keys) == [v for _, v in items]
    store.close()


def test_a_stalled_master_costs_one_timeout(valkey_cluster):
    store = RedisClusterBackend(valkey_cluster.url, timeout_s=0.3, backoff_s=60)
    items = page_items(30)
    store.batch_set(items)
    valkey_cluster.pause(2)
    t0 = time.monotonic()
    for _ in range(10):
        got = store.batch_get([k for k, _ in items])
        assert None in got and any(g is not None for g in got)  # the others still serve
    assert time.monotonic() - t0 < 1.5  # one 0.3 s wait, then skipped, never ten
    assert store.errors["unreachable"] == 1 and store.errors["skipped"] == 9
    valkey_cluster.resume(2)
    store.close()


def test_urls_are_checked(valkey_cluster, redis_server):
    from redis_server import free_port

    for bad in ("redis-cluster://", "redis-cluster://host", "redis-cluster://h:1/2"):
        with pytest.raises(ValueError, match="redis-cluster://"):
            open_storage(bad)
        with pytest.raises(ValueError, match="redis-cluster://"):
            CacheConfig(storage=bad)
    with pytest.raises(ValueError, match="not in cluster mode"):
        open_storage(f"redis-cluster://127.0.0.1:{redis_server.port}")
    down = open_storage(f"redis-cluster://127.0.0.1:{free_port()}")  # nothing listens
    assert down.batch_get([key(1)]) == [None] and down.batch_set([(key(1), b"x")]) == [False]
    assert down.errors["unreachable"] == 1 and down.errors["skipped"] == 2
    down.close()


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_a_fresh_engine_hits_what_another_wrote_exactly(model, valkey_cluster):
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=valkey_cluster.url)
    prompt = rand_tokens(75, 140)
    first = Engine.from_hf(model, cfg)
    r1 = first.generate([prompt], P)[0]
    first.close()
    second = Engine.from_hf(model, cfg)
    turn2 = prompt + r1.output_ids + rand_tokens(9, 141)
    r = second.generate([turn2], P, return_logits=True)[0]
    assert r.cached_by_tier == {"device": 0, "host": 0, "storage": 64}
    check(model, turn2, r)
    assert second.stats()["storage_errors"] == 0
    second.close()


def test_a_master_killed_mid_batch_keeps_every_request_exact(model, valkey_cluster):
    cfg = CacheConfig(page_size=16, device_tokens=2048, host_tokens=4096,
                      storage=valkey_cluster.url)
    eng = Engine.from_hf(model, cfg, step_tokens=64)  # prefill spans steps: writes follow
    prompts = [rand_tokens(60, 150 + i) for i in range(4)]
    eng.generate(prompts[:2], P)
    eng.cache.flush(tiers=("device", "host"))  # later requests read from the cluster
    batch = prompts + [p + rand_tokens(20, 160 + i) for i, p in enumerate(prompts[:2])]
    ids = [eng.add_request(p, P, return_logits=True) for p in batch]
    results, steps = {}, 0
    while eng.has_unfinished():  # the master dies after the first step, mid-batch
        results.update({o.request_id: o.result for o in eng.step() if o.finished})
        steps += 1
        if steps == 1:
            valkey_cluster.kill(0)
    for p, rid in zip(batch, ids, strict=True):
        check(model, p, results[rid])
    eng.storage.drain()
    assert eng.stats()["storage_errors"] >= 1
    eng.close()


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_engine import check, rand_tokens
    from tiny_model import tiny_model
    from shadowradix import CacheConfig, Engine, SamplingParams
    model = tiny_model()
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096,
                                            storage={url!r}))
    prompts = [rand_tokens(80, 170 + i) for i in range(4)]
    P = SamplingParams(max_new_tokens=5, ignore_eos=True)
    for p, r in zip(prompts, eng.generate(prompts, P, return_logits=True), strict=True):
        check(model, p, r)
    eng.storage.drain()
    assert eng.stats()["storage_errors"] == 0, eng.stats()["storage_errors"]
    eng.close()
    print("exact")
""")


def test_two_engine_processes_share_one_store(model, valkey_cluster):
    """Two processes write the same prefixes at once: both are exact, every object in
    the store is intact and at its own key, and a third engine hits all of it."""
    code = WRITER.format(tests=str(Path(__file__).parent), url=valkey_cluster.url)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "exact" in out, err[-2000:]
    rc = raw(valkey_cluster)
    stored = [k.decode() for node in rc.get_primaries()
              for k in rc.get_redis_connection(node).scan_iter(match="sr2-*", count=1000)]
    blobs = rc.mget_nonatomic(stored)
    rc.close()
    for k, blob in zip(stored, blobs, strict=True):
        decode(k.replace("{", "").replace("}", ""), blob)  # raises if not intact or misplaced
    third = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096,
                                              storage=valkey_cluster.url))
    prompts = [rand_tokens(80, 170 + i) + rand_tokens(10, 180 + i) for i in range(4)]
    for p, r in zip(prompts, third.generate(prompts, P, return_logits=True), strict=True):
        assert r.cached_by_tier["storage"] == 80  # the writers' 5 pages, none recomputed
        check(model, p, r)
    third.close()


def test_a_slow_slot_map_refresh_holds_back_no_other_call(valkey_cluster, monkeypatch):
    """The tier calls the backend from a read and a write thread. A re-read of the slot
    map that stalls (a master that is down keeps it waiting a deadline per node) ran under
    the lock the other thread needs: that thread's call, its deadline running, waited
    behind it. Now the re-read runs outside the lock and the other call uses the old map."""
    import threading

    store = RedisClusterBackend(valkey_cluster.url, refresh_s=0.0)
    items = [(object_key("ns", "p", bytes([i]) * 16), b"v%d" % i) for i in range(12)]
    assert store.batch_set(items) == [True] * 12
    nodes = store._cluster.nodes_manager
    reread = nodes.initialize
    started = threading.Event()

    def stalled(*args, **kw):  # type: ignore[no-untyped-def]
        started.set()
        time.sleep(1.5)
        return reread(*args, **kw)

    monkeypatch.setattr(nodes, "initialize", stalled)
    store._mark_stale()
    slow = threading.Thread(target=store.batch_exists, args=([k for k, _ in items],))
    slow.start()
    assert started.wait(10)
    t0 = time.monotonic()
    got = store.batch_get([k for k, _ in items])
    took = time.monotonic() - t0
    slow.join(10)
    assert got == [v for _, v in items] and took < 1.0, took
    store.close()
