"""What every benchmark shares: writing its JSON result next to the printed table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, result: Any) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
