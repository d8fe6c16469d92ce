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
