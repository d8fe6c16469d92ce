"""The copy/edit task and the English text the tiny DeepSeek-V4 of `train_tiny.py` learns.

Byte-level: a token is a byte (vocab 256), `EOS` (0) ends an answer. A copy/edit example:

    <English preamble>\\ncopy: <span>\\n<answer>EOS

where the answer repeats the span with the edits of `EDITS` (a few letters become digits,
about one character in four). Every answer token sits `len(span)` positions after the span
byte it copies, at most 14, so the tiny model's sliding window (16) sees it; the preamble is
text for the trunk and the MTP to model, and lets a prompt be as long as a benchmark needs.

The text is the docstrings of a fixed list of Python standard-library modules (nothing is
downloaded): the same bytes for the same Python version. Every tenth document is held out.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from dataclasses import dataclass
from functools import cache

EOS = 0
EDITS = {"a": "4", "e": "3", "o": "0", "s": "5"}
SPAN = (6, 14)
MARK = b"\ncopy: "
MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib",
           "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
           "fractions", "functools", "gzip", "hashlib", "heapq", "html", "http.client",
           "inspect", "io", "ipaddress", "itertools", "json", "logging", "operator", "os",
           "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil",
           "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
           "tempfile", "textwrap", "threading", "time", "typing", "unittest", "urllib.parse",
           "uuid", "warnings", "weakref", "zipfile")


@dataclass(frozen=True)
class CopyEditPrompt:
    """One example: `prompt` token ids (ends with the newline after the span) and the
    expected `answer` token ids (the edited span, then EOS)."""

    prompt: list[int]
    answer: list[int]


@cache
def documents() -> tuple[bytes, ...]:
    """The corpus: cleaned, printable-ASCII docstrings of `MODULES` and their public
    members, in a fixed order, each at least 80 bytes."""
    docs: list[bytes] = []
    with warnings.catch_warnings():  # typing.io and friends warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in MODULES:
            docs += _module_docs(name)
    return tuple(dict.fromkeys(docs))  # drop repeats, keep order


def _module_docs(name: str) -> list[bytes]:
    module = importlib.import_module(name)
    out = []
    for obj in [module] + [getattr(module, a) for a in sorted(vars(module)) if a[0] != "_"]:
        doc = inspect.getdoc(obj) if inspect.ismodule(obj) or callable(obj) else None
        if doc is None or (obj is not module and getattr(obj, "__module__", None) != name):
            continue
        text = re.sub(r"[^\x20-\x7e\n]", "", doc).strip()
        text = re.sub(r"\n{3,}", "\n\n", text)
        if len(text) >= 80:
            out.append(text.encode())
    return out


def split(part: str) -> tuple[bytes, ...]:
    """'train' (nine documents in ten) or 'test' (every tenth)."""
    if part not in ("train", "test"):
        raise ValueError(f"part must be 'train' or 'test', not {part!r}")
    docs = documents()
    return tuple(d for i, d in enumerate(docs) if (i % 10 == 9) == (part == "test"))


@cache
def _words(part: str) -> tuple[bytes, ...]:
    found = re.findall(rb"\b[a-z]{2,9}\b", b"\n".join(split(part)))
    return tuple(sorted(set(found)))


def edit(span: bytes) -> bytes:
    """The answer to a span: `EDITS` applied to every byte."""
    return bytes(ord(EDITS.get(chr(b), chr(b))) for b in span)


def text_chunk(rng: random.Random, part: str, length: int) -> bytes:
    """`length` bytes of corpus text starting at a word start (shorter documents are
    joined with a blank line)."""
    docs = split(part)
    out = b""
    while len(out) < length:
        doc = docs[rng.randrange(len(docs))]
        starts = [0] + [m.end() for m in re.finditer(rb"\s+", doc)]
        out += doc[rng.choice(starts):] + b"\n\n"
    return out[:length]


def example(rng: random.Random, part: str, preamble: tuple[int, int]) -> CopyEditPrompt:
    """One copy/edit example with a preamble of `preamble[0]..preamble[1]` bytes."""
    words = _words(part)
    span = b""
    while len(span) < SPAN[0]:  # a cut that ends in a space is dropped, not padded
        target = rng.randint(*SPAN)
        span = rng.choice(words)
        while len(span) < target:
            span += b" " + rng.choice(words)
        span = span[:target].rstrip()
    head = text_chunk(rng, part, rng.randint(*preamble))
    prompt = head + MARK + span + b"\n"
    return CopyEditPrompt(prompt=list(prompt), answer=[*edit(span), EOS])


def copy_edit_prompts(n: int, seed: int, part: str = "test",
                      preamble: tuple[int, int] = (16, 64)) -> list[CopyEditPrompt]:
    """`n` copy/edit prompts (held-out text by default), deterministic in `seed`; each
    prompt's preamble has `preamble[0]..preamble[1]` bytes of English text."""
    if preamble[0] < 0 or preamble[1] < preamble[0]:
        raise ValueError(f"preamble must be (low, high) with 0 <= low <= high, not {preamble}")
    rng = random.Random(seed)
    return [example(rng, part, preamble) for _ in range(n)]
