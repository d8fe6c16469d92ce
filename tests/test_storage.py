"""L3 storage: keys, self-checking objects, the file backend and its faults."""

import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.layout import deepseek_v4_flash, deepseek_v4_pro
from shadowradix.tiers.storage import (
    CorruptObject,
    FileBackend,
    decode,
    encode,
    namespace,
    object_key,
    open_storage,
    page_hashes,
)
from shadowradix.tiers.storage.file import STALE_TMP_S


def test_page_hashes_chain_over_the_whole_prefix():
    a = np.arange(64, dtype=np.int32)
    b = a.copy()
    b[5] = 999  # first page differs: every later key differs too
    ha, hb = page_hashes(a, 16), page_hashes(b, 16)
    assert len(ha) == 4 and all(len(h) == 16 for h in ha)
    assert all(x != y for x, y in zip(ha, hb, strict=True))
    c = a.copy()
    c[40] = 7  # third page differs: the first two keys are shared
    hc = page_hashes(c, 16)
    assert hc[:2] == ha[:2] and hc[2:] != ha[2:]
    assert page_hashes(a[:70 - 6], 16) == ha  # partial pages get no key


def test_namespace_fingerprints_the_layout_and_the_model():
    ns = lambda layout, model="m0": namespace(layout, model)  # noqa: E731
    assert ns(deepseek_v4_flash()) == ns(deepseek_v4_flash())
    assert ns(deepseek_v4_flash()) != ns(deepseek_v4_pro())
    assert ns(deepseek_v4_flash()) != ns(deepseek_v4_flash(page_size=512))
    assert ns(deepseek_v4_flash()) != ns(deepseek_v4_flash(dtype="float32"))
    assert ns(deepseek_v4_flash()) != ns(deepseek_v4_flash(), "m1")  # other weights
    with pytest.raises(ValueError, match="model_fingerprint"):
        namespace(deepseek_v4_flash(), "")


def test_codec_detects_corruption_and_truncation():
    k = "ns/c4/" + "ab" * 16
    blob = encode(k, b"kv bytes" * 10)
    assert decode(k, blob) == b"kv bytes" * 10
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    with pytest.raises(CorruptObject, match="checksum"):
        decode(k, bytes(flipped))
    with pytest.raises(CorruptObject, match="truncated"):
        decode(k, blob[:-5])
    with pytest.raises(CorruptObject, match="magic"):
        decode(k, b"junk")


def key(i: int, pool: str = "c4") -> str:
    return object_key("ns", pool, i.to_bytes(16, "little"))


def test_file_roundtrip_and_misses(tmp_path):
    fs = open_storage(f"file://{tmp_path}")
    assert fs.batch_set([(key(1), b"one"), (key(2, "swa"), b"two")]) == [True, True]
    assert fs.batch_exists([key(1), key(2, "swa"), key(3)]) == [True, True, False]
    assert fs.batch_get([key(1), key(3), key(2, "swa")]) == [b"one", None, b"two"]
    fs.close()
    again = FileBackend(tmp_path)  # a fresh process sees the same objects
    assert again.batch_get([key(1)]) == [b"one"] and not again.errors


def test_a_corrupted_or_truncated_object_is_a_miss_and_is_removed(tmp_path):
    fs = FileBackend(tmp_path)
    fs.batch_set([(key(1), b"a" * 100), (key(2), b"b" * 100)])
    p1, p2 = Path(fs._path(key(1))), Path(fs._path(key(2)))
    data = bytearray(p1.read_bytes())
    data[-1] ^= 0xFF
    p1.write_bytes(bytes(data))
    p2.write_bytes(p2.read_bytes()[:50])
    assert fs.batch_get([key(1), key(2)]) == [None, None]
    assert fs.errors["corrupt"] == 2
    assert fs.batch_exists([key(1), key(2)]) == [False, False]


def test_an_unwritable_store_fails_writes_without_raising(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    fs = FileBackend(blocker / "store")
    assert fs.batch_set([(key(1), b"x")]) == [False]
    assert fs.batch_get([key(1)]) == [None]
    assert fs.errors["write"] == 1


def test_the_cap_evicts_least_recently_used_first(tmp_path):
    size = len(encode(key(0), b"x" * 100))
    fs = FileBackend(tmp_path, cap_bytes=3 * size)
    for i in range(3):
        fs.batch_set([(key(i), b"x" * 100)])
    fs.batch_get([key(0)])  # 0 is now more recent than 1
    fs.batch_set([(key(3), b"x" * 100)])
    assert fs.batch_exists([key(i) for i in range(4)]) == [True, False, True, True]
    assert fs.bytes_stored <= 3 * size
    assert sum(p.stat().st_size for p in Path(tmp_path).rglob("*") if p.is_file()
               and p.name != ".shadowradix-bytes") <= 3 * size


def test_stale_temporary_files_of_ours_are_swept_young_ones_kept(tmp_path):
    """A crashed writer's temporary file goes on a later open; a young one may be another
    process's write in flight, and a file not named as ours is never touched."""
    fs = FileBackend(tmp_path)
    fs.batch_set([(key(1), b"ok")])
    digest = Path(fs._path(key(1))).name
    stale = Path(fs._path(key(1))).parent / f"{digest}.abc123_x.srtmp"
    young = Path(fs._path(key(1))).parent / f"{digest}.zzz999_y.srtmp"
    theirs = Path(fs._path(key(1))).parent / "half-written.tmp"
    for p in (stale, young, theirs):
        p.write_bytes(b"SRK2 partial")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    os.utime(theirs, (old, old))
    FileBackend(tmp_path)
    assert not stale.exists() and young.exists() and theirs.exists()


def test_bad_urls_are_refused():
    with pytest.raises(ValueError, match="unsupported"):
        open_storage("s3://bucket")
    with pytest.raises(ValueError, match="needs a directory"):
        open_storage("file://")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "get"]), st.integers(0, 7),
                          st.binary(max_size=64)), max_size=40))
def test_file_backend_behaves_like_a_dict(tmp_path_factory, ops):
    fs = FileBackend(tmp_path_factory.mktemp("fs"))
    model: dict[str, bytes] = {}
    for op, i, payload in ops:
        if op == "set":
            assert fs.batch_set([(key(i), payload)]) == [True]
            model[key(i)] = payload
        else:
            assert fs.batch_get([key(i)]) == [model.get(key(i))]
    assert fs.bytes_stored == sum(len(encode(k, v)) for k, v in model.items())


def test_redis_roundtrip_and_misses(redis_server):
    rs = open_storage(redis_server.url)
    assert rs.batch_set([(key(1), b"one"), (key(2), b"two" * 1000)]) == [True, True]
    assert rs.batch_exists([key(1), key(3)]) == [True, False]
    assert rs.batch_get([key(2), key(3), key(1)]) == [b"two" * 1000, None, b"one"]
    assert not rs.errors
    rs.close()


def test_redis_corrupt_value_is_a_miss(redis_server):
    import redis

    rs = open_storage(redis_server.url)
    rs.batch_set([(key(1), b"payload")])
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(key(1), raw.get(key(1))[:-2])
    assert rs.batch_get([key(1)]) == [None]
    assert rs.errors["corrupt"] == 1


def test_redis_killed_mid_run_means_misses_not_exceptions(redis_server):
    rs = open_storage(redis_server.url)
    assert rs.batch_set([(key(1), b"x")]) == [True]
    redis_server.stop()
    assert rs.batch_get([key(1)]) == [None]
    assert rs.batch_set([(key(2), b"y")]) == [False]
    assert rs.batch_exists([key(1)]) == [False]
    # The first failure opens the breaker: the calls after it do not try the server.
    assert rs.errors["unreachable"] == 1 and rs.errors["skipped"] == 2
    rs.close()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_clear_deletes_one_namespace_only(tmp_path, request, backend):
    store = open_storage(f"file://{tmp_path}" if backend == "file"
                         else request.getfixturevalue("redis_server").url)
    mine = [(object_key("ns-a", "c4", bytes([i]) * 16), b"a" * 10) for i in range(5)]
    theirs = [(object_key("ns-b", "c4", bytes([i]) * 16), b"b" * 10) for i in range(3)]
    store.batch_set(mine + theirs)
    assert store.clear("ns-a") == 5
    assert store.batch_exists([k for k, _ in mine]) == [False] * 5
    assert store.batch_get([k for k, _ in theirs]) == [b"b" * 10] * 3
    assert store.clear("ns-a") == 0 and not store.errors
    store.close()
