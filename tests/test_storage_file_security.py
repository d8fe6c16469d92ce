"""`file://` below its root: private folders, no symlink followed, an account it can trust.

Each test is an attack or fault a user could meet on a shared machine (another local user,
a planted symlink, a deleted or rewritten account, a full disk), on real files and, for the
account, real processes.
"""

import contextlib
import errno
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shadowradix.tiers.storage import Codec, FileBackend, object_key
from shadowradix.tiers.storage.keys import DIGEST

PAYLOAD = b"x" * 1000
ACCOUNT = ".shadowradix-bytes"


def key(i: int, ns: str = "ns", pool: str = "c4") -> str:
    return object_key(ns, pool, i.to_bytes(16, "little"))


@pytest.fixture(scope="module")
def size() -> int:
    """Bytes of one stored object of PAYLOAD (a file holds exactly its encoded form)."""
    return Codec().stored_size(key(0), len(PAYLOAD))


def disk_bytes(root: Path) -> int:
    """Bytes of the store's committed objects on disk (no temporaries, no user files). Every
    folder is listed before any object is measured: with writers running, a walk that
    measures as it goes sees early folders before their evictions and late ones after their
    writes, counting bytes the disk never held at once (the longer, the more loaded)."""
    names = [os.path.join(dirpath, name) for dirpath, _, files in os.walk(root)
             for name in files if DIGEST.fullmatch(name)]
    total = 0
    for path in names:
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
            total += os.lstat(path).st_size
    return total


def account_value(root: Path) -> int | None:
    """The account's number as written, or None where it is empty or absent (to recount)."""
    try:
        raw = (root / ACCOUNT).read_bytes().strip()
    except FileNotFoundError:
        return None
    return int(raw) if raw else None


def fan_dir(fs: FileBackend, k: str) -> Path:
    return Path(fs._path(k)).parent


# ------------------------------------------------------------ 1. private folders
def test_folders_are_0700_and_objects_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "a" / "store"  # the root and its missing parent are created
        fs = FileBackend(root)
        assert fs.batch_set([(key(1), PAYLOAD)]) == [True]
    finally:
        os.umask(old)
    obj = Path(fs._path(key(1)))
    for d in (root.parent, root, root / "ns", root / "ns" / "c4", obj.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600
    assert stat.S_IMODE((root / ACCOUNT).stat().st_mode) == 0o600


# --------------------------------------------------------- 2. the account file
@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_an_account_linked_to_a_file_elsewhere_is_refused_never_written(tmp_path, link):
    root, victim = tmp_path / "store", tmp_path / "victim.txt"
    FileBackend(root).batch_set([(key(1), PAYLOAD)])
    victim.write_bytes(b"precious data, not a byte count")
    (root / ACCOUNT).unlink()
    if link == "symlink":
        (root / ACCOUNT).symlink_to(victim)
    else:
        os.link(victim, root / ACCOUNT)
    fs = FileBackend(root)
    assert fs.batch_set([(key(2), PAYLOAD)]) == [False]
    assert fs.batch_get([key(1)]) == [None]  # an unusable store: misses
    assert fs.batch_exists([key(1)]) == [False]
    with pytest.raises(RuntimeError):
        fs.clear("ns")
    assert victim.read_bytes() == b"precious data, not a byte count"
    assert fs.errors["symlink" if link == "symlink" else "account"] >= 1


def test_a_dangling_account_symlink_does_not_create_its_target(tmp_path):
    root, target = tmp_path / "store", tmp_path / "created-by-the-store"
    root.mkdir()
    (root / ACCOUNT).symlink_to(target)
    fs = FileBackend(root)
    assert fs.batch_set([(key(1), PAYLOAD)]) == [False]
    assert not target.exists() and not os.path.lexists(target)


def test_an_account_swapped_for_a_symlink_between_calls_is_refused(tmp_path):
    root, victim = tmp_path / "store", tmp_path / "victim.txt"
    fs = FileBackend(root)
    assert fs.batch_set([(key(1), PAYLOAD)]) == [True]
    victim.write_bytes(b"precious data, not a byte count")
    (root / ACCOUNT).unlink()
    (root / ACCOUNT).symlink_to(victim)
    assert fs.batch_set([(key(2), PAYLOAD)]) == [False]
    assert fs.batch_get([key(1)]) == [None]
    assert victim.read_bytes() == b"precious data, not a byte count"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_account_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    root = tmp_path / "store"
    FileBackend(root).batch_set([(key(1), PAYLOAD)])
    (root / ACCOUNT).unlink()
    if kind == "fifo":
        os.mkfifo(root / ACCOUNT)
    else:
        (root / ACCOUNT).mkdir()
    opened: list[FileBackend] = []
    t = threading.Thread(target=lambda: opened.append(FileBackend(root)), daemon=True)
    t.start()
    t.join(timeout=20)
    assert opened, "opening the store blocked on the account"
    fs = opened[0]
    assert fs.batch_get([key(1)]) == [None] and fs.batch_set([(key(2), PAYLOAD)]) == [False]
    assert fs.errors["open"] == 1


# ------------------------------------------------- 3. no symlink below the root
def test_a_symlinked_namespace_folder_is_never_written_through(tmp_path, size):
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "ns").symlink_to(outside, target_is_directory=True)
    fs = FileBackend(root, cap_bytes=2 * size)
    assert fs.batch_set([(key(i), PAYLOAD) for i in range(4)]) == [False] * 4
    assert disk_bytes(outside) == 0 and fs.errors["symlink"] >= 1
    assert FileBackend(root).bytes_stored == disk_bytes(root) == 0


@pytest.mark.parametrize("level", ["pool", "fan"])
def test_objects_behind_a_symlinked_folder_are_neither_served_nor_deleted(tmp_path, level):
    """Objects reached only through a symlink (planted by whoever could write there) are
    misses; `clear` never reaches them, and claims nothing while any would be served."""
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    planted = FileBackend(elsewhere)  # valid objects of our keys, outside the store
    assert planted.batch_set([(key(i), PAYLOAD) for i in range(3)]) == [True] * 3
    fs = FileBackend(root)
    assert fs.batch_set([(key(9, pool="swa"), PAYLOAD)]) == [True]
    if level == "pool":
        (root / "ns").mkdir(exist_ok=True)
        (root / "ns" / "c4").symlink_to(elsewhere / "ns" / "c4", target_is_directory=True)
    else:
        fan = fan_dir(planted, key(0)).name
        (root / "ns" / "c4").mkdir(parents=True)
        (root / "ns" / "c4" / fan).symlink_to(elsewhere / "ns" / "c4" / fan,
                                               target_is_directory=True)
    assert fs.batch_get([key(0)]) == [None] and fs.batch_exists([key(0)]) == [False]
    assert fs.errors["symlink"] >= 1
    assert fs.batch_set([(key(0), b"new")]) == [False]
    with contextlib.suppress(RuntimeError):  # StorageUnavailable is as good as an honest count
        fs.clear("ns")
    assert fs.batch_get([key(i) for i in range(3)]) == [None] * 3
    assert fs.batch_get([key(9, pool="swa")]) == [None]  # ours, really deleted
    assert planted.batch_get([key(i) for i in range(3)]) == [PAYLOAD] * 3  # not touched


def test_a_symlinked_object_file_is_a_miss(tmp_path):
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    planted = FileBackend(elsewhere)
    planted.batch_set([(key(1), PAYLOAD)])
    fs = FileBackend(root)
    fs.batch_set([(key(2), PAYLOAD)])  # makes the folders
    obj = Path(fs._path(key(1)))
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.symlink_to(planted._path(key(1)))
    assert fs.batch_get([key(1)]) == [None] and fs.batch_exists([key(1)]) == [False]
    assert Path(planted._path(key(1))).exists()


def test_the_root_itself_may_be_a_symlink(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    fs = FileBackend(link, cap_bytes=10**6)
    assert fs.batch_set([(key(1), PAYLOAD)]) == [True]
    assert fs.batch_get([key(1)]) == [PAYLOAD] and not fs.errors
    assert fs.clear("ns") == 1 and disk_bytes(real) == 0


# ------------------------------------------ 4. an account deleted or rewritten
@pytest.mark.parametrize("attack", ["delete", "junk", "replace", "shrink"])
def test_a_tampered_account_is_recounted_from_disk(tmp_path, size, attack):
    root = tmp_path / "store"
    fs = FileBackend(root, cap_bytes=10 * size)
    fs.batch_set([(key(i), PAYLOAD) for i in range(5)])
    acct = root / ACCOUNT
    if attack == "delete":
        acct.unlink()
    elif attack == "junk":
        acct.write_bytes(b"0\n")
    elif attack == "replace":  # a new file (new inode) with a well-formed 0
        (root / "new").write_bytes(b"0".ljust(20))
        os.replace(root / "new", acct)
    else:
        acct.write_bytes(b"9" * 20)  # well formed, absurd: the store must not empty itself
    assert fs.batch_set([(key(5), PAYLOAD)]) == [True]
    assert fs.bytes_stored == disk_bytes(root) == 6 * size
    assert account_value(root) == 6 * size
    assert fs.batch_get([key(i) for i in range(6)]) == [PAYLOAD] * 6


WRITER = """
import os, sys
from shadowradix.tiers.storage import FileBackend, object_key
root, cap, base, batch, calm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 2, sys.argv[4]
fs = FileBackend(root, cap_bytes=cap)
i = after = 0
while after < 25:
    fs.batch_set([(object_key("ns", "c4", (base + i + j).to_bytes(16, "little")), b"x" * 1000)
                  for j in range(batch)])
    i += batch
    after += os.path.exists(calm)
    if i % 40 == 0 and base == 0:
        fs.clear("ns")  # one writer also clears, while the others write
"""


def test_the_cap_and_account_survive_an_account_deleted_and_rewritten_under_3_processes(
        tmp_path, size):
    root, calm = tmp_path / "store", tmp_path / "calm"
    cap, batch, n = 10 * size, 2 * size, 3
    FileBackend(root, cap_bytes=cap)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(cap),
                               str(100_000 * p), str(calm)]) for p in range(n)]
    acct, peak = root / ACCOUNT, 0
    try:
        for r in range(90):
            time.sleep(0.02)
            try:
                if r % 3 == 0:
                    acct.unlink()
                elif r % 3 == 1:
                    acct.write_bytes(b"0\n")
                else:
                    (tmp_path / "new").write_bytes(b"0".ljust(20))
                    os.replace(tmp_path / "new", acct)
            except FileNotFoundError:
                pass
            peak = max(peak, disk_bytes(root))
        calm.touch()
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            p.kill()
    assert peak <= cap + n * batch  # each holder of a lock adds at most one batch
    assert disk_bytes(root) <= cap
    assert account_value(root) == disk_bytes(root)


# --------------------------------------------------------------- 5. a full disk
def test_a_full_disk_at_the_accounts_write_leaves_result_and_account_true(
        tmp_path, size, monkeypatch):
    root = tmp_path / "store"
    fs = FileBackend(root, cap_bytes=100 * size)
    fs.batch_set([(key(0), PAYLOAD)])

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", full)
        assert fs.batch_set([(key(1), PAYLOAD), (key(2), PAYLOAD)]) == [True, True]
        assert fs.batch_get([key(1), key(2)]) == [PAYLOAD, PAYLOAD]  # result == readable
    assert account_value(root) in (None, 3 * size)  # never a count that disagrees
    assert fs.bytes_stored == disk_bytes(root) == 3 * size
    assert account_value(root) == 3 * size
