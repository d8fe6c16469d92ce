"""Storage settings a caller got wrong are refused at construction with a clear message."""

import logging
from pathlib import Path

import pytest
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine
from shadowradix.tiers.storage import open_storage


@pytest.mark.parametrize("bad", [123, b"file:///tmp/kv", ["file:///tmp/kv"]])
def test_a_storage_that_is_not_a_url_string_is_refused(bad):
    with pytest.raises(ValueError, match="URL string"):
        CacheConfig(storage=bad)


def test_a_path_gets_a_hint_to_write_a_file_url(tmp_path):
    with pytest.raises(ValueError, match=f"storage=f'file://{tmp_path}'"):
        CacheConfig(storage=tmp_path)


@pytest.mark.parametrize("cap", [True, 0, 1.5, "1GB"])
def test_a_bad_cap_is_refused(tmp_path, cap):
    with pytest.raises(ValueError, match="storage_cap_bytes"):
        CacheConfig(storage=f"file://{tmp_path}", storage_cap_bytes=cap)


def test_a_file_url_naming_a_regular_file_is_refused(tmp_path):
    f = tmp_path / "kv.bin"
    f.write_bytes(b"not a store")
    with pytest.raises(ValueError, match="existing file, not a directory"):
        open_storage(f"file://{f}")
    assert f.read_bytes() == b"not a store"


@pytest.fixture
def locked_server(tmp_path):
    from redis_server import RedisServer

    server = RedisServer(tmp_path, password="s3cret")
    yield server
    server.stop()


def test_a_missing_or_wrong_redis_password_is_refused(locked_server):
    bare = f"redis://127.0.0.1:{locked_server.port}/0"
    with pytest.raises(ValueError, match="password"):
        open_storage(bare)
    with pytest.raises(ValueError, match="refused the credentials") as e:
        open_storage(f"redis://:wrong@127.0.0.1:{locked_server.port}/0")
    assert "wrong" not in str(e.value)  # the URL's password is not echoed
    rs = open_storage(locked_server.url)
    assert rs.batch_set([("ns/c4/" + "ab" * 16, b"ok")]) == [True] and not rs.errors
    rs.close()


def test_a_redis_server_that_is_down_at_open_is_logged_and_counted(caplog):
    from redis_server import free_port

    with caplog.at_level(logging.WARNING, logger="shadowradix.storage"):
        rs = open_storage(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert rs.errors["unreachable"] == 1
    assert "unreachable at open" in caplog.text
    rs.close()


def test_redis_with_a_file_cap_is_refused():
    with pytest.raises(ValueError, match="maxmemory"):
        open_storage("redis://127.0.0.1:1/0", cap_bytes=1000)


def test_flush_takes_a_bare_tier_name_and_names_the_bad_one():
    eng = Engine.from_hf(tiny_model(), CacheConfig(page_size=16, device_tokens=256))
    eng.cache.flush(tiers="device")
    with pytest.raises(ValueError, match=r"\['dev'\]"):
        eng.cache.flush(tiers="dev")
    with pytest.raises(ValueError, match=r"\['gpu'\]"):
        eng.cache.flush(tiers=("device", "gpu"))
    eng.close()


def test_paths_in_messages_are_the_callers(tmp_path):
    """The hint for a Path is one the caller can paste."""
    with pytest.raises(ValueError) as e:
        CacheConfig(storage=Path("relative/dir"))
    assert "file://relative/dir" in str(e.value)


@pytest.mark.parametrize("setup", ["/99999", "/0?client_name=a%20b"])
def test_a_url_whose_setup_the_server_refuses_is_a_value_error(redis_server, setup):
    """A DB index the server does not have, or a client name it refuses: before, the
    server's ResponseError escaped from the engine's construction."""
    url = f"redis://127.0.0.1:{redis_server.port}{setup}"
    with pytest.raises(ValueError, match="refused this URL's connection setup") as e:
        open_storage(url)
    assert ("out of range" in str(e.value)) == (setup == "/99999")  # the server's reason
    ok = open_storage(f"redis://127.0.0.1:{redis_server.port}/3?client_name=engine-1")
    assert ok.batch_set([("ns/c4/" + "ab" * 16, b"ok")]) == [True] and not ok.errors
    ok.close()


@pytest.mark.parametrize("option", ["socket_timeout=-1", "socket_timeout=inf",
                                    "socket_connect_timeout=0", "socket_timeout=nan",
                                    "socket_timeout=soon", "socket_timeout=1e10",
                                    "socket_connect_timeout=1e308"])
def test_a_timeout_option_that_is_not_seconds_is_refused(option):
    """Before, `?socket_timeout=-1` (or inf) was taken, and every call then failed in
    redis-py, counted as the server's bad replies."""
    url = f"redis://127.0.0.1:1/0?{option}"
    name = option.split("=")[0]
    with pytest.raises(ValueError, match=f"{name} must be a number of seconds > 0"):
        CacheConfig(page_size=16, device_tokens=256, storage=url)
    with pytest.raises(ValueError, match=f"{name} must be a number of seconds > 0"):
        open_storage(url)
    CacheConfig(page_size=16, device_tokens=256,
                storage="redis://127.0.0.1:1/0?socket_timeout=2.5")


def test_a_replica_cut_off_from_its_master_at_open_is_unreachable_not_refused(redis_server,
                                                                            caplog):
    """A server that answers MASTERDOWN (a replica whose master is gone, serving no stale
    data) may answer later: it is logged and counted as down, not a ValueError."""
    import redis
    from redis_server import free_port

    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    admin.config_set("replica-serve-stale-data", "no")
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # nobody there
    try:
        with caplog.at_level(logging.WARNING, logger="shadowradix.storage"):
            rs = open_storage(redis_server.url)
        assert rs.errors["unreachable"] == 1, rs.errors
        assert "unreachable at open" in caplog.text
        rs.close()
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
        admin.close()
