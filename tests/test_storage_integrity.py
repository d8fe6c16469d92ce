"""An object is bound to its key: intact bytes found at another key's place, or an intact
object of the wrong size, are counted misses, never hits with wrong KV."""

from pathlib import Path

import numpy as np
import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.storage import FileBackend, object_key, open_storage, page_hashes

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


def key(i: int, pool: str = "c4") -> str:
    return object_key("ns", pool, i.to_bytes(16, "little"))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_swapped_files_are_wrong_key_misses(tmp_path):
    fs = FileBackend(tmp_path)
    fs.batch_set([(key(1), b"a" * 100), (key(2), b"b" * 100)])
    p1, p2 = Path(fs._path(key(1))), Path(fs._path(key(2)))
    b1, b2 = p1.read_bytes(), p2.read_bytes()
    p1.write_bytes(b2)
    p2.write_bytes(b1)
    fresh = FileBackend(tmp_path)  # a fresh process, as a swap on disk would meet
    assert fresh.batch_get([key(1), key(2)]) == [None, None]
    assert fresh.errors["wrong_key"] == 2
    assert not p1.exists() and not p2.exists()  # misplaced objects go


def test_swapped_redis_values_are_wrong_key_misses(redis_server):
    import redis

    rs = open_storage(redis_server.url)
    rs.batch_set([(key(1), b"a" * 100), (key(2, "swa"), b"b" * 100)])
    raw = redis.Redis.from_url(redis_server.url)
    v1, v2 = raw.get(key(1)), raw.get(key(2, "swa"))
    raw.set(key(1), v2)
    raw.set(key(2, "swa"), v1)
    assert rs.batch_get([key(1), key(2, "swa")]) == [None, None]
    assert rs.errors["wrong_key"] == 2
    rs.close()


def stored_keys(eng: Engine, tokens: list[int]) -> list[list[str]]:
    """Per page of `tokens`, every pool's key in the engine's namespace."""
    st = eng.storage
    hashes = page_hashes(np.asarray(tokens, dtype=np.int32), st.page_size)
    return [[object_key(st.namespace, name, h) for name in st.names] for h in hashes]


def first_engine(model, root: Path) -> tuple[CacheConfig, list[int], list[int]]:
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=f"file://{root}")
    first = Engine.from_hf(model, cfg)
    prompt = rand_tokens(75, 41)
    r1 = first.generate([prompt], P)[0]
    first.close()
    return cfg, prompt, prompt + r1.output_ids + rand_tokens(9, 99)


def test_swapped_objects_are_not_hits(model, tmp_path):
    """Pages 0 and 3 trade places on disk, in every pool: each pair is two intact objects
    of the same size, so only the key in their header tells them apart. (Page 3 holds
    the window and the checkpoint a resume reads; swaps among compressed pages alone
    would only permute keys that attention sums over.)"""
    cfg, prompt, turn2 = first_engine(model, tmp_path / "l3")
    eng = Engine.from_hf(model, cfg)
    keys = stored_keys(eng, prompt)
    fs = eng.storage.backend
    for j in range(len(eng.storage.names)):
        p1, p2 = Path(fs._path(keys[0][j])), Path(fs._path(keys[3][j]))
        b1, b2 = p1.read_bytes(), p2.read_bytes()
        assert len(b1) == len(b2)
        p1.write_bytes(b2)
        p2.write_bytes(b1)
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] < 64
    assert eng.storage.error_counts["wrong_key"] >= 1
    eng.close()


def test_an_intact_object_of_the_wrong_size_is_a_counted_miss(model, tmp_path):
    cfg, prompt, turn2 = first_engine(model, tmp_path / "l3")
    eng = Engine.from_hf(model, cfg)
    k = stored_keys(eng, prompt)[2][0]
    backend = eng.storage.backend
    (payload,) = backend.batch_get([k])
    assert payload is not None
    backend.batch_set([(k, payload[:-4])])  # a valid checksum over the short payload
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] < 64
    assert eng.stats()["storage_errors"] == 1
    eng.close()
