"""Test-session plumbing: puts tests/ on the path, shares the cores among pytest-xdist's
workers, and reports state-machine step counts (summed over the workers)."""

from __future__ import annotations

import fcntl
import os
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


def pytest_configure(config):  # type: ignore[no-untyped-def]
    """Under xdist (`make test` runs `-n 2`), each worker gets its share of the cores for
    torch and for what it starts (servers, fleets): two workers each running torch on every
    core slow each other down several times over."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = threads
        import torch

        torch.set_num_threads(int(threads))


def pytest_sessionfinish(session):  # type: ignore[no-untyped-def]
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: hand the counts to the controller
        out["steps"] = dict(STEPS)
        out["logit_diffs"] = list(LOGIT_DIFFS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # type: ignore[no-untyped-def]
    out = getattr(node, "workeroutput", {})
    for name, n in out.get("steps", {}).items():
        STEPS[name] = STEPS.get(name, 0) + n
    LOGIT_DIFFS.extend(out.get("logit_diffs", []))


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
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    # One run for every xdist worker: the first to take the lock trains, the others wait.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, log = shared / "quick-checkpoint" / "trained", shared / "quick-checkpoint.stdout"
    out.parent.mkdir(exist_ok=True)
    with open(shared / "quick-checkpoint.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not log.exists():
            shutil.rmtree(out, ignore_errors=True)
            run = subprocess.run([sys.executable, str(root / "benchmarks" / "train_tiny.py"),
                                  "--quick", "--threads", "1", "--out", str(out)],
                                 capture_output=True, text=True, timeout=300, cwd=root)
            assert run.returncode == 0, run.stderr[-2000:]
            log.write_text(run.stdout)
    return out, log.read_text()
