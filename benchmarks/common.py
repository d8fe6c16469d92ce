"""What every benchmark shares: writing its JSON result next to the printed table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, result: Any) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))


def trace_args(ap: argparse.ArgumentParser, sizes: str) -> None:
    """The flags every trace replay benchmark takes: --trace, --sizes, --workers, --json."""
    ap.add_argument("--trace", default="conversation",
                    help="conversation | synthetic (bundled) or a trace file")
    ap.add_argument("--sizes", default=sizes, help="device GB, comma-separated")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)


def trace_path(name: str) -> str:
    """A bundled trace's path ("conversation", "synthetic"), or `name` itself."""
    from shadowradix.sim.trace import bundled_trace

    return str(bundled_trace(name)) if name in ("conversation", "synthetic") else name
