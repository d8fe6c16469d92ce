"""Attacks on the storage guarantees of issue #20 that broke them: a secret longer than
BLAKE2b's key, a secret file that is a FIFO, an empty secret variable, one secret read
as bytes, str or a file giving other keys, a failed lstat of the size account that made
its holder wait for its own lock forever, a failed close of a folder that turned a
committed write into a failure, and temporary files left by a failure before a rename."""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shadowradix import CacheConfig
from shadowradix.server.serve import SECRET_ENV, add_arguments, storage_secret
from shadowradix.tiers.storage import Codec, FileBackend, Forged, object_key
from shadowradix.tiers.storage.account import ACCOUNT_FILE
from shadowradix.tiers.storage.codec import KEYED_MAGIC

NS = "sr2-" + "0" * 32
KEY = object_key(NS, "swa", b"\x01" * 16)
ROOT = str(Path(__file__).resolve().parent.parent)


def keys(n: int) -> list[str]:
    return [object_key(NS, "swa", bytes([i]) * 16) for i in range(n)]


def on_disk(root: Path) -> tuple[int, list[str]]:
    """(bytes of the objects, names of temporary files) below `root`."""
    total, temps = 0, []
    for p in root.rglob("*"):
        st = p.lstat()
        if p.name == ACCOUNT_FILE or not stat.S_ISREG(st.st_mode):
            continue
        if p.name.endswith(".srtmp"):
            temps.append(p.name)
        else:
            total += st.st_size
    return total, temps


def args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(["--model", "tiny", *argv])


# ------------------------------------------------------------------------ the secret
@pytest.mark.parametrize("length", [65, 88, 4096])
def test_a_secret_of_any_length_works(tmp_path, length):
    """`head -c 64 /dev/urandom | base64` is 88 characters: keyed BLAKE2b (the first
    digest) refused it as a key (ValueError on every encode: the store held nothing)."""
    secret = b"k" * (length - 1) + b"!"
    backend = FileBackend(tmp_path / "l3", secret=secret)
    assert backend.batch_set([(KEY, b"payload")]) == [True]
    assert backend.batch_get([KEY], [7]) == [b"payload"] and not backend.errors
    # the whole secret counts: one differing past byte 64 is another key
    blob = Codec(secret).encode(KEY, b"payload")
    with pytest.raises(Forged):
        Codec(b"k" * (length - 1) + b"?").decode(KEY, blob)


@pytest.mark.parametrize("length", [16, 64, 65, 200])
def test_the_keyed_format_is_hmac_sha256_over_header_and_payload(length):
    """The stored format, pinned: another implementation can read and write it."""
    import hmac

    secret = b"s" * length
    head = KEYED_MAGIC + len(KEY).to_bytes(2, "little") + KEY.encode() + (3).to_bytes(8, "little")
    mac = hmac.new(secret, head + b"abc", hashlib.sha256).digest()
    assert Codec(secret).decode(KEY, head + mac + b"abc") == b"abc"
    assert Codec(secret).encode(KEY, b"abc") == head + mac + b"abc"


def test_one_secret_gives_one_key_as_bytes_str_file_or_variable(tmp_path, monkeypatch):
    """A library engine given the file's bytes (trailing newline and all) and a server
    reading the same file must read each other's objects."""
    raw = b"\xffnot utf-8, but a secret\n"
    path = tmp_path / "secret"
    path.write_bytes(raw)
    store = f"file://{tmp_path / 'l3'}"
    monkeypatch.delenv(SECRET_ENV, raising=False)
    from_file = storage_secret(args("--storage", store, "--storage-secret-file", str(path)))
    monkeypatch.setitem(os.environb, SECRET_ENV.encode(), raw)  # type: ignore[attr-defined]
    from_env = storage_secret(args("--storage", store))
    blob = Codec(raw).encode(KEY, b"payload")
    for secret in (from_file, from_env, raw.strip(), b"  " + raw):
        assert Codec(secret).decode(KEY, blob) == b"payload"
    text = "a secret given as text, long enough"
    assert Codec(text.encode() + b"\r\n").decode(KEY, Codec(text).encode(KEY, b"x")) == b"x"


def test_an_empty_secret_variable_is_refused(tmp_path, monkeypatch):
    """`SHADOWRADIX_STORAGE_SECRET=$UNSET` must not start a server that trusts the store
    (whitespace was refused, the empty string silently meant no secret)."""
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(ValueError, match=f"{SECRET_ENV}.*empty"):
        storage_secret(args("--storage", f"file://{tmp_path}"))
    assert storage_secret(args()) is None  # no store: the variable is not for this server


def test_a_secret_file_that_is_a_fifo_without_a_writer_is_refused_at_once(tmp_path):
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    outcome: list[BaseException | bytes | None] = []

    def read() -> None:
        try:
            outcome.append(storage_secret(args("--storage", f"file://{tmp_path / 'l3'}",
                                               "--storage-secret-file", str(fifo))))
        except BaseException as e:  # the outcome is checked below
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    try:
        assert not reader.is_alive(), "start-up blocked on a FIFO no writer holds"
        assert isinstance(outcome[0], ValueError) and "--storage-secret-file" in str(outcome[0])
    finally:
        if reader.is_alive():  # free the old code's reader, blocked in open()
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(5)


def test_a_secret_file_that_is_a_pipe_is_read_to_its_end(tmp_path):
    """`--storage-secret-file <(vault read ...)`: a pipe with a writer still works."""
    r, w = os.pipe()
    try:
        os.write(w, b"a secret from a pipe, long enough\n")
        os.close(w)
        got = storage_secret(args("--storage", f"file://{tmp_path}",
                                  "--storage-secret-file", f"/proc/self/fd/{r}"))
    finally:
        os.close(r)
    assert got == b"a secret from a pipe, long enough"


def test_a_storage_url_given_as_bytes_is_refused_without_its_password():
    with pytest.raises(ValueError) as e:
        CacheConfig(storage=b"redis://:SEKRETXYZ@127.0.0.1:1/0")  # type: ignore[arg-type]
    assert "SEKRETXYZ" not in str(e.value) and "***" in str(e.value)


# ------------------------------------------------------------------- file:// faults
_LSTAT_FAILS_ONCE = """
import errno, os, sys
from shadowradix.tiers.storage import FileBackend, object_key
from shadowradix.tiers.storage import account
root = sys.argv[1]
backend = FileBackend(root, cap_bytes=10**6)
real, calls = account._ident_at, [0]
def ident_at(path):  # the lstat after the body (an EIO, an NFS ESTALE) fails once
    calls[0] += 1
    return None if calls[0] == 2 else real(path)
account._ident_at = ident_at
ok = backend.batch_set([(object_key("sr2-" + "0" * 32, "swa", b"\\x01" * 16), b"x" * 100)])
account._ident_at = real
print(ok, backend.bytes_stored)
"""


def test_a_failed_lstat_of_the_account_never_waits_for_its_own_lock(tmp_path):
    """The holder invalidated a file it thought moved by locking the file at the path
    from a second fd while its first still held the lock: for a failed lstat that file
    is the same one, and the process (and every process sharing the store) hung."""
    root = tmp_path / "l3"
    try:
        out = subprocess.run([sys.executable, "-c", _LSTAT_FAILS_ONCE, str(root)], cwd=ROOT,
                             capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the account's holder waited for its own lock")
    assert out.returncode == 0, out.stderr
    total, temps = on_disk(root)
    assert out.stdout.split() == ["[True]", str(total)] and not temps


def test_a_folder_close_that_fails_does_not_fail_a_committed_write(tmp_path, monkeypatch):
    """close() of a folder's fd reporting EIO (Linux frees the fd anyway) made a write
    that was renamed into place report False, uncounted by the account, or raise."""
    root = tmp_path / "l3"
    backend = FileBackend(root, cap_bytes=10**6)
    real = os.close

    def close(fd: int) -> None:
        folder = stat.S_ISDIR(os.fstat(fd).st_mode)
        real(fd)
        if folder:
            raise OSError(errno.EIO, "close failed")

    items = [(k, b"y" * 100) for k in keys(3)]
    monkeypatch.setattr(os, "close", close)
    try:
        done = backend.batch_set(items)
    finally:
        monkeypatch.setattr(os, "close", real)
    assert done == [True] * 3
    assert backend.batch_get([k for k, _ in items], [100] * 3) == [p for _, p in items]
    total, temps = on_disk(root)
    assert (root / ACCOUNT_FILE).read_text().strip() == str(total) and not temps
    assert backend.bytes_stored == total


def test_a_write_failing_before_its_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A fault between staging and the rename (the lstat of the old object, here) left
    the temporary file, uncounted, for STALE_TMP_S: the directory outgrew its cap."""
    from shadowradix.tiers.storage import file

    root = tmp_path / "l3"
    backend = FileBackend(root, cap_bytes=10**6)

    def size_at(fan: int, name: str) -> int:
        raise OSError(errno.EIO, "stat failed")

    monkeypatch.setattr(file, "size_at", size_at)
    assert backend.batch_set([(k, b"z" * 100) for k in keys(2)]) == [False, False]
    monkeypatch.undo()
    assert on_disk(root) == (0, []) and backend.bytes_stored == 0
    assert backend.errors["write"] == 2


def test_a_failing_stat_of_the_root_is_no_exception(tmp_path, monkeypatch):
    """The constructor raises only for a root that is a regular file; an error asking
    (EIO) raised OSError out of it."""
    def exists(self: Path) -> bool:
        raise OSError(errno.EIO, "stat failed")

    monkeypatch.setattr(Path, "exists", exists)
    backend = FileBackend(tmp_path / "l3")
    monkeypatch.undo()
    assert backend.batch_set([(KEY, b"w")]) == [True]


# ------------------------------------------------------------- messages and lost writes
@pytest.mark.parametrize("url", ["mysql://u:SEKRETXYZ@h/db", "Redis://:SEKRETXYZ@h:1/0",
                                 b"redis://:SEKRETXYZ@h:1/0"])
def test_open_storage_never_shows_a_password(url):
    from shadowradix.tiers.storage import open_storage

    with pytest.raises(ValueError) as e:
        open_storage(url)  # type: ignore[arg-type]
    assert "SEKRETXYZ" not in str(e.value)


def test_parse_cluster_url_never_shows_a_password():
    from shadowradix.tiers.storage.redis_cluster import parse_cluster_url

    with pytest.raises(ValueError) as e:
        parse_cluster_url("redis://:SEKRETXYZ@h:1")
    assert "SEKRETXYZ" not in str(e.value)


def test_a_backend_write_that_raises_is_counted(tmp_path, monkeypatch):
    """Write-through runs on the write thread, whose Futures nobody reads: a backend that
    raised lost the write uncounted (a secret over 64 bytes made every write fail with
    storage_errors 0)."""
    from test_engine import rand_tokens
    from tiny_model import tiny_model

    from shadowradix import Engine, SamplingParams

    def boom(self, items):  # type: ignore[no-untyped-def]
        raise RuntimeError("a backend bug")

    monkeypatch.setattr(FileBackend, "batch_set", boom)
    eng = Engine.from_hf(tiny_model(), CacheConfig(page_size=16, device_tokens=2048,
                                                   storage=f"file://{tmp_path}"))
    eng.generate([rand_tokens(75, 40)], SamplingParams(max_new_tokens=3, ignore_eos=True))
    eng.storage.drain()
    assert eng.stats()["storage_errors"] > 0
    assert eng.storage.error_counts["write_failed"] == 4 * len(eng.storage.names)  # 4 pages
    eng.close()
