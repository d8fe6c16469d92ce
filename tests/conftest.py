"""Test-session plumbing: puts tests/ on the path and reports state-machine step counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def redis_server(tmp_path):  # type: ignore[no-untyped-def]
    """A real Valkey on 127.0.0.1 (an ephemeral port), resumed if a test paused it, and
    stopped after the test."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path)
    yield server
    server.resume()
    server.stop()


@pytest.fixture(scope="module")
def valkey_cluster_module(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A real 3-master Valkey Cluster on 127.0.0.1, shared by one module's tests (it
    takes seconds to form) and stopped after them, however they ended."""
    from valkey_cluster import ValkeyCluster

    cluster = ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def valkey_cluster(valkey_cluster_module):  # type: ignore[no-untyped-def]
    """The module's cluster with every node up; a test that kills, pauses or restarts a
    node leaves it up again for the next."""
    valkey_cluster_module.revive()
    yield valkey_cluster_module
    valkey_cluster_module.revive()

@pytest.fixture(scope="module")
def conversation():
    """The first 1,500 requests of the bundled conversation trace."""
    from shadowradix.sim.trace import bundled_trace, load_trace

    return load_trace(bundled_trace("conversation"), limit=1500)


@pytest.fixture(scope="module")
def synthetic():
    """The first 600 requests of the bundled synthetic trace."""
    from shadowradix.sim.trace import bundled_trace, load_trace

    return load_trace(bundled_trace("synthetic"), limit=600)


STEPS: dict[str, int] = {}
LOGIT_DIFFS: list[float] = []  # every differential check against transformers


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    if STEPS:
        total = sum(STEPS.values())
        detail = ", ".join(f"{k} {v:,}" for k, v in sorted(STEPS.items()))
        terminalreporter.write_line(f"state-machine steps: {total:,} ({detail})")
    if LOGIT_DIFFS:
        terminalreporter.write_line(
            f"differential checks against transformers: {len(LOGIT_DIFFS)}, "
            f"largest |logit diff| {max(LOGIT_DIFFS):.2e}")


@pytest.fixture(scope="session")
def quick_checkpoint(tmp_path_factory):
    """One `benchmarks/train_tiny.py --quick` run for the whole session (it trains for ~20
    s): (its checkpoint directory, its stdout). Tests copy the directory before changing it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("quick-checkpoint") / "trained"
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "train_tiny.py"), "--quick",
                          "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    return out, run.stdout
