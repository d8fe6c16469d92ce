"""Test-session plumbing: puts tests/ on the path and reports state-machine step counts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

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
