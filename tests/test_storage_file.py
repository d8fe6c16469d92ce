"""`file://` touches only its own files, and its size cap holds across processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shadowradix.tiers.storage import FileBackend, object_key

PAYLOAD = b"x" * 1000


def key(i: int, ns: str = "ns") -> str:
    return object_key(ns, "c4", i.to_bytes(16, "little"))


@pytest.fixture(scope="module")
def size(tmp_path_factory) -> int:
    """Bytes of one stored object of PAYLOAD, measured on disk."""
    root = tmp_path_factory.mktemp("probe")
    FileBackend(root).batch_set([(key(0), PAYLOAD)])
    return objects_bytes(root)


def objects_bytes(root: Path) -> int:
    """Bytes of the store's objects on disk (not the user's files, not the account)."""
    return sum(p.stat().st_size for p in root.glob("*/*/*/*") if p.is_file())


def test_the_users_files_survive_open_writes_past_the_cap_and_clear(tmp_path, size):
    notes = tmp_path / "notes.tmp"
    old = tmp_path / "old.bin"
    nested = tmp_path / "project" / "build.tmp"
    nested.parent.mkdir()
    for p in (notes, old, nested):
        p.write_bytes(b"mine" * 500)
        os.utime(p, (time.time() - 86400, time.time() - 86400))  # older than any object
    fs = FileBackend(tmp_path, cap_bytes=3 * size)
    for i in range(8):
        assert fs.batch_set([(key(i), PAYLOAD)]) == [True]
    assert objects_bytes(tmp_path) <= 3 * size
    assert fs.clear("ns") == 3
    FileBackend(tmp_path, cap_bytes=1)  # a fresh open with a cap nothing fits in
    for p in (notes, old, nested):
        assert p.read_bytes() == b"mine" * 500


def test_two_stores_sharing_a_directory_keep_one_cap(tmp_path, size):
    """Two backends (two processes' views: each its own LRU) over one directory."""
    a = FileBackend(tmp_path, cap_bytes=4 * size)
    b = FileBackend(tmp_path, cap_bytes=4 * size)
    for i in range(8):
        a.batch_set([(key(i), PAYLOAD)])
        b.batch_set([(key(100 + i), PAYLOAD)])
        assert objects_bytes(tmp_path) <= 4 * size
    assert a.bytes_stored == b.bytes_stored == objects_bytes(tmp_path)


WRITER = """
import sys
from shadowradix.tiers.storage import FileBackend, object_key
fs = FileBackend(sys.argv[1], cap_bytes=int(sys.argv[2]))
base = int(sys.argv[3])
for i in range(200):
    fs.batch_set([(object_key("ns", "c4", (base + i).to_bytes(16, "little")), b"x" * 1000)])
"""


def test_the_cap_holds_for_concurrent_processes(tmp_path, size):
    cap = 10 * size
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(cap),
                               str(1000 * n)]) for n in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    assert objects_bytes(tmp_path) <= cap
    assert FileBackend(tmp_path).bytes_stored == objects_bytes(tmp_path)  # the account agrees
