"""A store writer without the secret cannot change what an engine says (#20).

With `CacheConfig(storage_secret=...)` every object carries a keyed digest over its
header and payload; a plain client that rewrites objects (keeping key, size and a
recomputed checksum, as a careful attacker would) only causes counted misses, and the
tokens stay those of the model. Oversized values are refused before they are parsed.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.server.serve import SECRET_ENV, add_arguments, storage_secret
from shadowradix.tiers.storage import Codec, FileBackend, RedisBackend
from shadowradix.tiers.storage.codec import KEYED_MAGIC, MAGIC

P = SamplingParams(max_new_tokens=5, ignore_eos=True)
SECRET = b"correct horse battery staple"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def served(model, url: str, prompt: list[int], secret: bytes | None):
    """An engine with the store's secret serves `prompt` and writes it through; returns
    the config to build a fresh engine with, and turn 2 of the conversation."""
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=url, storage_secret=secret)
    first = Engine.from_hf(model, cfg)
    r1 = first.generate([prompt], P)[0]
    first.close()
    return cfg, prompt + r1.output_ids + rand_tokens(9, 99)


def payload_of(blob: bytes) -> int:
    """The payload size recorded in an object's header (whatever its kind)."""
    end = 6 + int.from_bytes(blob[4:6], "little") + 8
    return int.from_bytes(blob[end - 8:end], "little")


def forgeries(key: str, blob: bytes, rng: np.random.Generator) -> list[bytes]:
    """What a writer without the secret can make at `key`: random payloads of the right
    size, checksummed (the unkeyed form), keyed under a guessed secret, or the header of
    the genuine object with a new payload."""
    size = payload_of(blob)
    fake = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    keyed_elsewhere = Codec(b"a guessed secret, not the one").encode(key, fake)
    spliced = blob[:len(blob) - size] + fake  # the genuine header and digest
    return [Codec().encode(key, fake), keyed_elsewhere, spliced]


@pytest.mark.parametrize("forgery", [0, 1, 2])
def test_a_writer_without_the_secret_cannot_change_the_tokens(model, redis_server, forgery):
    import redis

    cfg, turn2 = served(model, redis_server.url, rand_tokens(75, 40), SECRET)
    rogue = redis.Redis.from_url(redis_server.url)
    keys = [k.decode() for k in rogue.scan_iter(match="sr2-*")]
    assert len(keys) >= 8  # 4 pages x the layout's pools
    rng = np.random.default_rng(forgery)
    for key in keys:
        blob = rogue.get(key)
        assert blob[:4] == KEYED_MAGIC
        rogue.set(key, forgeries(key, blob, rng)[forgery])
    rogue.close()

    eng = Engine.from_hf(model, cfg)
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)  # the model's own tokens and logits
    assert r.cached_by_tier["storage"] == 0
    assert eng.storage is not None and eng.storage.error_counts["forged"] >= 1
    eng.close()


def test_the_genuine_objects_still_hit_with_the_secret(model, redis_server):
    cfg, turn2 = served(model, redis_server.url, rand_tokens(75, 41), SECRET)
    eng = Engine.from_hf(model, cfg)
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] == 64 and eng.stats()["storage_errors"] == 0
    eng.close()


@pytest.mark.parametrize("writer,reader", [(SECRET, None), (None, SECRET),
                                           (SECRET, b"another secret of 16+ bytes")])
def test_engines_with_other_secrets_never_read_each_others_objects(model, tmp_path, writer,
                                                                   reader):
    url = f"file://{tmp_path / 'l3'}"
    _, turn2 = served(model, url, rand_tokens(75, 42), writer)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, storage=url,
                                            storage_secret=reader))
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier["storage"] == 0
    assert eng.storage is not None and eng.storage.error_counts["forged"] >= 1
    eng.close()


def test_an_unkeyed_store_keeps_todays_format(tmp_path):
    """No secret: the checksummed format of before, readable by earlier versions."""
    backend = FileBackend(tmp_path)
    key = f"ns/pool/{'ab' * 16}"
    assert backend.batch_set([(key, b"x" * 100)]) == [True]
    blob = next(p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith("ab"))
    assert blob.read_bytes()[:4] == MAGIC
    assert backend.batch_get([key], [100]) == [b"x" * 100]


def peak_bytes(call):  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        out = call()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_value_is_refused_before_it_is_read_redis(redis_server):
    import redis

    backend = RedisBackend(redis_server.url, secret=SECRET)
    key = f"ns/pool/{'cd' * 16}"
    rogue = redis.Redis.from_url(redis_server.url)
    rogue.set(key, KEYED_MAGIC + b"\0" * (64 << 20))  # 64 MiB where a 4 KiB page belongs
    rogue.close()
    out, peak = peak_bytes(lambda: backend.batch_get([key], [4096]))
    assert out == [None] and backend.errors["oversized"] == 1
    assert peak < 1 << 20  # a page and some, not the 64 MiB
    backend.close()


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    backend = FileBackend(tmp_path, secret=SECRET)
    key = f"ns/pool/{'ef' * 16}"
    assert backend.batch_set([(key, b"y" * 4096)]) == [True]
    path = next(p for p in tmp_path.rglob("ef*") if p.is_file())
    with open(path, "r+b") as f:
        f.truncate(1 << 32)  # 4 GiB, sparse: cheap to make, ruinous to read
    start = time.perf_counter()
    out, peak = peak_bytes(lambda: backend.batch_get([key], [4096]))
    assert out == [None] and backend.errors["oversized"] == 1
    assert peak < 1 << 20 and time.perf_counter() - start < 5
    assert not path.exists()  # a bad object is dropped


# ----------------------------------------------------------------- configuration
def test_the_secret_is_checked_and_never_shown():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        CacheConfig(storage="file:///tmp/x", storage_secret="short")
    with pytest.raises(ValueError, match="bytes or str"):
        CacheConfig(storage="file:///tmp/x", storage_secret=12345678901234567890)
    with pytest.raises(ValueError, match="needs a storage URL"):
        CacheConfig(storage_secret=SECRET)
    cfg = CacheConfig(storage="file:///tmp/x", storage_secret=SECRET)
    assert SECRET.decode() not in repr(cfg) and SECRET.decode() not in str(cfg)
    assert repr(Codec(SECRET)) == "Codec(keyed=True)"


def args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(["--model", "tiny", *argv])


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    store = f"file://{tmp_path / 'l3'}"
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert storage_secret(args("--storage", store, "--storage-secret-file", str(path))) == SECRET
    assert storage_secret(args("--storage", store)) is None
    monkeypatch.setenv(SECRET_ENV, "from the environment, long enough")
    assert storage_secret(args("--storage", store)) == b"from the environment, long enough"
    assert storage_secret(args()) is None  # no store: the variable is not for this server
    # the file wins over the environment
    assert storage_secret(args("--storage", store, "--storage-secret-file", str(path))) == SECRET
    with pytest.raises(ValueError, match="--storage-secret-file .*cannot read"):
        storage_secret(args("--storage", store, "--storage-secret-file", str(tmp_path / "no")))
    path.write_bytes(b"tiny\n")
    with pytest.raises(ValueError, match="--storage-secret-file .*at least 16"):
        storage_secret(args("--storage", store, "--storage-secret-file", str(path)))
    with pytest.raises(ValueError, match="needs --storage"):
        storage_secret(args("--storage-secret-file", str(path)))
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=SECRET_ENV):
        storage_secret(args("--storage", store))


def test_serve_refuses_a_bad_secret_file_with_one_line(tmp_path, capsys):
    from shadowradix.cli import main

    code = main(["serve", "--model", "tiny", "--port", "0", "--storage",
                 f"file://{tmp_path / 'l3'}", "--storage-secret-file", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and "--storage-secret-file" in err and "Traceback" not in err
    assert not Path(tmp_path / "l3").exists() or not os.listdir(tmp_path / "l3")


def test_a_server_with_a_secret_file_says_so_and_never_shows_it(tmp_path, monkeypatch):
    import httpx
    from server_util import ServerThread

    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    server = ServerThread.from_args("--model", "tiny", "--storage", f"file://{tmp_path / 'l3'}",
                                    "--storage-secret-file", str(path))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi " * 40,
                                                   "max_tokens": 2})
            assert r.status_code == 200
            info, metrics = http.get("/server_info"), http.get("/metrics").text
        assert info.json()["storage_authenticated"] is True
        assert SECRET.decode() not in info.text + metrics
        server.on_engine(lambda eng: eng.storage.drain())
        objects = [p for p in (tmp_path / "l3").rglob("*") if p.is_file()
                   and not p.name.startswith(".")]
        assert objects and all(p.read_bytes()[:4] == KEYED_MAGIC for p in objects)
    finally:
        server.stop()
