"""Mooncake-format request traces (shared/traces/README.md), with optional sequence chains.

Each line: {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]},
optionally "block_size" (tokens per block, default 512) and "sequence_hash_ids" (the same
block chain over prompt + output). Each hash id stands for one block; two requests share a
block id exactly when they share that block and everything before it.

Mooncake's own traces hash the prompt only, so a replay can only make up the output, and a
chat's next turn matches the previous prompt up to its last full block. A sequence chain
records what the request really ended with, so the next turn matches all of it.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from numbers import Integral
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash

BLOCK_TOKENS = 512  # Mooncake's block size, the default
# Prompt tokens lie below this and synthetic output tokens above it, so they never collide.
OUTPUT_TOKEN_BASE = 1 << 30


@cache
def _offsets(block_size: int) -> np.ndarray:
    return np.arange(block_size, dtype=np.int32)


def _expand(ids: Sequence[int], block_size: int, length: int,
            out: np.ndarray | None) -> np.ndarray:
    """Block h becomes h * block_size + [0, block_size); cut at `length` (at most
    len(ids) * block_size). Into `out` if given (int32, at least `length` long), returning
    a view of it. O(length): a partial last block is never expanded whole."""
    if out is None:
        out = np.empty(length, dtype=np.int32)
    full, rest = divmod(length, block_size)
    base = np.asarray(ids[:full + (rest > 0)], dtype=np.int32) * block_size
    if full:
        np.add(base[:full, None], _offsets(block_size),
               out=out[:full * block_size].reshape(full, block_size))
    if rest:
        np.add(base[full], np.arange(rest, dtype=np.int32), out=out[full * block_size:length])
    return out[:length]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. Construction checks that every field is an integer (a bool or a float
    is refused, not truncated) and the chains (ValueError), so every instance can be
    expanded into tokens; a trace reader turns that into a TraceError naming the line."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int = BLOCK_TOKENS
    sequence_hash_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def sequence_length(self) -> int:
        return self.input_length + self.output_length

    @property
    def expanded_tokens(self) -> int:
        """Room `prompt_tokens` and `sequence_tokens` need in a caller's buffer."""
        return self.sequence_length if self.sequence_hash_ids is not None else (
            self.input_length)

    @property
    def prompt_blocks(self) -> tuple[int, ...]:
        """The blocks the prompt's tokens come from. With a sequence chain, the prompt is
        the start of the sequence, so a partial last prompt block is the sequence's block
        there (the prompt's own id for it names a shorter block that nobody continues)."""
        if self.sequence_hash_ids is None:
            return self.hash_ids
        return self.sequence_hash_ids[:len(self.hash_ids)]

    @property
    def cached_blocks(self) -> tuple[int, ...]:
        """The blocks a finished request leaves in a cache that a later prompt can match:
        its sequence's, or, without a chain, its prompt's (its output is unknown)."""
        return self.hash_ids if self.sequence_hash_ids is None else self.sequence_hash_ids

    def prompt_tokens(self, out: np.ndarray | None = None) -> np.ndarray:
        """Deterministic prompt tokens: block h expands to h * block_size + [0, block_size),
        the last block cut to input_length. With a sequence chain these are the first
        input_length tokens of `sequence_tokens`.

        With `out` (int32, at least `expanded_tokens` long) the tokens are written there
        and a view is returned: replay reuses one buffer instead of allocating a fresh
        array per request.
        """
        return _expand(self.prompt_blocks, self.block_size, self.input_length, out)

    def sequence_tokens(self, out: np.ndarray | None = None) -> np.ndarray:
        """Prompt + output tokens, expanded from the sequence chain (as `prompt_tokens`).
        Raises ValueError when the request has no chain: its output is unknown."""
        if self.sequence_hash_ids is None:
            raise ValueError("this trace request has no sequence_hash_ids")
        return _expand(self.sequence_hash_ids, self.block_size, self.sequence_length, out)

    def to_json(self) -> dict[str, Any]:
        """The trace line; the optional fields only when they say something."""
        d: dict[str, Any] = {"timestamp": self.timestamp, "input_length": self.input_length,
                             "output_length": self.output_length,
                             "hash_ids": list(self.hash_ids)}
        if self.block_size != BLOCK_TOKENS:
            d["block_size"] = self.block_size
        if self.sequence_hash_ids is not None:
            d["sequence_hash_ids"] = list(self.sequence_hash_ids)
        return d


class TraceError(ValueError):
    """A trace line that is not a valid request; the message names file and line."""


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _is_int(x: object) -> bool:
    """An integer, numpy's included; not a bool (True is not the integer 1 here)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _problem(req: TraceRequest) -> str | None:
    """What makes `req` invalid, or None."""
    for name in ("timestamp", "input_length", "output_length", "block_size"):
        if not _is_int(getattr(req, name)):
            return f"{name} must be an integer, got {getattr(req, name)!r}"
    ids = (*req.hash_ids, *(req.sequence_hash_ids or ()))
    if not (all(type(h) is int for h in ids) or all(map(_is_int, ids))):
        return "hash_ids and sequence_hash_ids must be integers"
    bs = req.block_size
    if bs < 1:
        return f"block_size must be >= 1, got {bs}"
    if req.input_length < 1 or req.output_length < 0:
        return "input_length must be >= 1 and output_length >= 0"
    if req.input_length + req.output_length > OUTPUT_TOKEN_BASE:  # int32 token ids
        return (f"input_length + output_length must be at most {OUTPUT_TOKEN_BASE} (2**30) "
                f"tokens, got {req.input_length + req.output_length}")
    if len(req.hash_ids) != _blocks(req.input_length, bs):
        return (f"{len(req.hash_ids)} hash_ids for input_length {req.input_length} "
                f"(expected {_blocks(req.input_length, bs)} blocks of {bs} tokens)")
    # Tokens are h * block_size + offset in int32, below the synthetic outputs.
    limit = OUTPUT_TOKEN_BASE // bs
    seq = req.sequence_hash_ids
    if any(h < 0 or h >= limit for h in (*req.hash_ids, *(seq or ()))):
        return f"hash ids must lie in [0, {limit}) (2**30 // block_size)"
    if seq is None:
        return None
    if len(seq) != _blocks(req.sequence_length, bs):
        return (f"{len(seq)} sequence_hash_ids for input_length + output_length "
                f"{req.sequence_length} (expected {_blocks(req.sequence_length, bs)})")
    full = req.input_length // bs
    if seq[:full] != req.hash_ids[:full]:
        return (f"sequence_hash_ids must start with the {full} full prompt blocks of "
                "hash_ids (the sequence is the prompt followed by the output)")
    return None


def json_int(value: Any, what: str) -> int:
    """An integer field of a JSON line. A float is accepted only without a fraction (1e3):
    10.7 is not silently 10; JSON true is not 1; a string, Infinity or 1e400 is refused."""
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():  # False for inf and nan
        return int(value)
    raise ValueError(f"{what} must be an integer, got {json.dumps(value)}")


def json_ms(value: Any, what: str) -> int:
    """A timestamp field in milliseconds: any finite number (not a bool), rounded to the
    millisecond; Infinity, NaN or 1e400 is refused instead of overflowing later."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of milliseconds, got "
                         f"{json.dumps(value)}")
    return round(value)


def json_ids(value: Any, what: str) -> tuple[int, ...]:
    """A list of block ids. A string is refused, not iterated ("12" is not [1, 2])."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of integers, got {json.dumps(value)[:40]}")
    if all(type(h) is int for h in value):  # the common case, checked in one pass
        return tuple(value)
    return tuple(json_int(h, f"{what}[{i}]") for i, h in enumerate(value))


def _parse(line: str, where: str) -> TraceRequest:
    try:
        d = json.loads(line)
        if not isinstance(d, dict):
            raise ValueError("a trace line is a JSON object")
        seq = d.get("sequence_hash_ids")
        fields = (json_ms(d["timestamp"], "timestamp"),
                  json_int(d["input_length"], "input_length"),
                  json_int(d["output_length"], "output_length"),
                  json_ids(d["hash_ids"], "hash_ids"),
                  json_int(d.get("block_size", BLOCK_TOKENS), "block_size"),
                  None if seq is None else json_ids(seq, "sequence_hash_ids"))
    except KeyError as e:
        raise TraceError(f"{where}: not a trace request (no {e} field)") from None
    except ValueError as e:
        raise TraceError(f"{where}: not a trace request ({e})") from None
    try:
        return TraceRequest(*fields)
    except ValueError as e:
        raise TraceError(f"{where}: {e}") from None


def read_lines(path: str | Path, what: str = "trace") -> Iterator[tuple[int, str]]:
    """(line number, line) of a .jsonl or .jsonl.gz file. Raises TraceError naming the line
    for bytes that are not UTF-8, and the last line read when the file cannot be read to
    its end (a truncated or corrupt .gz), instead of EOFError or zlib.error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    lineno = 0
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
        try:
            for lineno, raw in enumerate(f, 1):
                yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{path}:{lineno}: not UTF-8 text ({e})") from None
        except (EOFError, OSError, zlib.error) as e:
            after = f"after line {lineno}" if lineno else "at its start"
            raise TraceError(f"{path}:{lineno + 1}: cannot read the {what} {after} "
                             f"({type(e).__name__}: {e}); is it a truncated or corrupt "
                             "file?") from None


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Requests in file order. Reads .jsonl or .jsonl.gz. Raises TraceError naming the line,
    also when a line's block_size differs from the first line's (one trace, one block size:
    ids of different block sizes cannot name the same tokens), and when the file cannot be
    read to its end."""
    block_size = None
    for lineno, line in read_lines(path):
        if line.strip():
            req = _parse(line, f"{path}:{lineno}")
            if block_size is None:
                block_size = req.block_size
            elif req.block_size != block_size:
                raise TraceError(f"{path}:{lineno}: block_size {req.block_size} differs "
                                 f"from the earlier lines' {block_size}; a trace has one "
                                 "block size")
            yield req


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    return out


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write `requests` as trace lines (.jsonl, or gzip for .gz); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    f: IO[str]
    with (gzip.open(path, "wt", encoding="utf-8") if path.suffix == ".gz"
          else path.open("w", encoding="utf-8")) as f:
        for req in requests:
            f.write(json.dumps(req.to_json()) + "\n")
            n += 1
    return n


def chain_hashes(tokens: np.ndarray | Sequence[int], block_size: int) -> list[int]:
    """A 128-bit hash per block of `tokens`, the last one possibly partial. Block i's hash
    covers every token up to the end of block i (it hashes block i-1's hash with block i's
    tokens), so equal hashes mean equal prefixes, and a partial block shares a hash only
    with the identical partial block."""
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[int] = []
    prev = b""
    for start in range(0, arr.size, block_size):
        h = xxhash.xxh3_128_intdigest(prev + arr[start:start + block_size].tobytes())
        out.append(h)
        prev = h.to_bytes(16, "little")
    return out


class DenseIds:
    """Small block ids for raw chain hashes, numbered by first appearance: a trace's ids
    expand into int32 tokens, so they must stay below 2**30 // block_size."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}

    def __call__(self, hashes: Iterable[int]) -> tuple[int, ...]:
        ids = self._ids
        return tuple(ids.setdefault(h, len(ids)) for h in hashes)


def bundled_trace(name: str = "conversation") -> Path:
    """The shared traces, shipped with the repository under data/traces/."""
    path = Path(__file__).resolve().parents[2] / "data" / "traces" / f"{name}_trace.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"bundled trace {path} is missing; pass a trace path instead")
    return path
