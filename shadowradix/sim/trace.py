"""Mooncake-format request traces (shared/traces/README.md).

Each line: {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}.
Each hash id stands for 512 prompt tokens; two requests share a block id exactly
when they share that block and everything before it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
# Synthetic output tokens live above every prompt token, so they never collide.
OUTPUT_TOKEN_BASE = 1 << 30
_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_tokens(self, out: np.ndarray | None = None) -> np.ndarray:
        """Deterministic prompt tokens: block h expands to h * 512 + [0, 512).

        With `out` (int32, at least len(hash_ids) * 512 long) the tokens are
        written there and a view is returned: replay reuses one buffer instead
        of allocating a fresh array per request.
        """
        ids = np.asarray(self.hash_ids, dtype=np.int32) * BLOCK_TOKENS
        n = len(self.hash_ids) * BLOCK_TOKENS
        if out is None:
            out = np.empty(n, dtype=np.int32)
        np.add(ids[:, None], _OFFSETS, out=out[:n].reshape(-1, BLOCK_TOKENS))
        return out[:self.input_length]


class TraceError(ValueError):
    """A trace line that is not a valid request; the message names file and line."""


def _parse(line: str, where: str) -> TraceRequest:
    try:
        d = json.loads(line)
        req = TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                           tuple(int(h) for h in d["hash_ids"]))
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a trace request ({type(e).__name__}: {e})") from None
    if req.input_length < 1 or req.output_length < 0:
        raise TraceError(f"{where}: input_length must be >= 1 and output_length >= 0")
    blocks = -(-req.input_length // BLOCK_TOKENS)
    if len(req.hash_ids) != blocks:
        raise TraceError(f"{where}: {len(req.hash_ids)} hash_ids for input_length "
                         f"{req.input_length} (expected {blocks})")
    if any(h < 0 or h >= (1 << 21) for h in req.hash_ids):
        raise TraceError(f"{where}: hash ids must lie in [0, 2**21)")
    return req


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Requests in file order. Reads .jsonl or .jsonl.gz. Raises TraceError naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield _parse(line, f"{path}:{lineno}")


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    return out


def bundled_trace(name: str = "conversation") -> Path:
    """The shared traces, shipped with the repository under data/traces/."""
    path = Path(__file__).resolve().parents[2] / "data" / "traces" / f"{name}_trace.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"bundled trace {path} is missing; pass a trace path instead")
    return path
