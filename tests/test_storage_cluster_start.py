"""A redis-cluster:// store opened while masters are down (a real 3-master Valkey Cluster
on 127.0.0.1): a down master costs misses on its own slots only, whichever master it is
and wherever it sits in the seed list, and its slots hit again once it is back."""

from __future__ import annotations

import time

import pytest

from shadowradix.tiers.storage import RedisClusterBackend, object_key
from shadowradix.tiers.storage.redis_cluster import cluster_key, slot_of

POOLS = ("kv", "c4", "swa")


def page_items(n: int, ns: str) -> list[tuple[str, bytes]]:
    """n pages of three pools each (90 objects for 30 pages), payload naming its key."""
    return [(object_key(ns, p, i.to_bytes(16, "little")), f"{ns}-{p}-{i}".encode() * 10)
            for i in range(n) for p in POOLS]


def owners(cluster) -> list[tuple[int, int, int]]:  # type: ignore[no-untyped-def]
    """(first slot, last slot, node index) of each slot range, asked of a live node."""
    import redis

    client = redis.Redis(port=cluster.ports[cluster.alive()[0]], protocol=2)
    try:
        return [(int(start), int(end), cluster.ports.index(int(master[1])))
                for start, end, master, *_ in client.execute_command("CLUSTER SLOTS")]
    finally:
        client.close()


def owner(ranges: list[tuple[int, int, int]], key: str | None = None) -> int:
    """The index of the node serving `key` (slot 0 for None)."""
    slot = 0 if key is None else slot_of(cluster_key(key))
    return next(node for start, end, node in ranges if start <= slot <= end)


def seed_url(cluster, first: int, others: list[int]) -> str:  # type: ignore[no-untyped-def]
    return "redis-cluster://" + ",".join(f"127.0.0.1:{cluster.ports[i]}"
                                         for i in [first, *others])


def written(cluster, ns: str) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
    items = page_items(30, ns)
    store = RedisClusterBackend(cluster.url)
    assert store.batch_set(items) == [True] * 90 and not store.errors
    store.close()
    return items


def check_partial(store: RedisClusterBackend, items: list[tuple[str, bytes]],
                  on_dead: list[bool]) -> None:
    """Exactly the objects off the dead master hit, every one intact; the dead master's
    misses cost one refused connect, then its breaker skips it."""
    keys = [k for k, _ in items]
    assert 0 < sum(on_dead) < len(items)
    for _ in range(3):
        got = store.batch_get(keys)
        assert got == [None if d else v for d, (_, v) in zip(on_dead, items, strict=True)], (
            dict(store.errors))
        assert store.batch_exists(keys) == [not d for d in on_dead]
    assert store.errors["unreachable"] >= 1
    assert set(store.errors) <= {"unreachable", "skipped", "topology", "uncovered"}


def back_after_restart(cluster, store: RedisClusterBackend, dead: int,  # type: ignore[no-untyped-def]
                       items: list[tuple[str, bytes]]) -> None:
    """Restart the dead master (its data is gone: no persistence): once its back-off
    ends, its slots take writes and hit again."""
    cluster.restart(dead)
    deadline = time.monotonic() + 10
    while store.batch_set(items) != [True] * len(items):
        assert time.monotonic() < deadline, dict(store.errors)
        time.sleep(0.1)
    assert store.batch_get([k for k, _ in items]) == [v for _, v in items]


@pytest.mark.parametrize("which", ["the master of slot 0", "another master"])
def test_a_master_down_at_open_costs_only_its_slots(valkey_cluster, which):
    """redis-py's RedisCluster asks its default node (the master of the first slot
    range) for COMMAND while it is constructed: with that master down, the whole
    constructor failed and the store missed everything."""
    items = written(valkey_cluster, f"start-{which.split()[-1]}")
    ranges = owners(valkey_cluster)
    dead = owner(ranges) if which == "the master of slot 0" else (owner(ranges) + 1) % 3
    on_dead = [owner(ranges, k) == dead for k, _ in items]
    valkey_cluster.kill(dead)
    url = seed_url(valkey_cluster, dead, [i for i in range(3) if i != dead])  # dead first
    t0 = time.monotonic()
    store = RedisClusterBackend(url, backoff_s=0.3, refresh_s=0.1)
    assert time.monotonic() - t0 < 2.0
    check_partial(store, items, on_dead)
    back_after_restart(valkey_cluster, store, dead, items)
    store.close()


def test_seeds_of_a_down_master_and_one_live_node(valkey_cluster):
    items = written(valkey_cluster, "two-seeds")
    ranges = owners(valkey_cluster)
    dead = owner(ranges)
    live = (dead + 2) % 3
    on_dead = [owner(ranges, k) == dead for k, _ in items]
    valkey_cluster.kill(dead)
    for first, second in ((dead, live), (live, dead)):
        store = RedisClusterBackend(seed_url(valkey_cluster, first, [second]),
                                    backoff_s=0.3, refresh_s=0.1)
        check_partial(store, items, on_dead)
        store.close()
    store = RedisClusterBackend(seed_url(valkey_cluster, dead, [live]), backoff_s=0.3,
                                refresh_s=0.1)
    back_after_restart(valkey_cluster, store, dead, items)
    store.close()


def test_a_cluster_wholly_down_at_open_serves_once_it_is_up(valkey_cluster):
    for i in range(3):
        valkey_cluster.kill(i)
    store = RedisClusterBackend(valkey_cluster.url, backoff_s=0.3)
    items = page_items(10, "late")
    assert store.batch_get([k for k, _ in items]) == [None] * 30
    assert store.batch_set(items) == [False] * 30
    assert store.errors["unreachable"] == 1 and store.errors["skipped"] >= 1
    valkey_cluster.revive()
    deadline = time.monotonic() + 10
    while store.batch_set(items) != [True] * 30:
        assert time.monotonic() < deadline, dict(store.errors)
        time.sleep(0.1)
    assert store.batch_get([k for k, _ in items]) == [v for _, v in items]
    store.close()
