"""Argparse value types shared by every command's numeric flags.

A value out of range is an argparse error (exit 2, one line naming the flag) while the
command line is parsed, before a trace is read or a model loads: never a traceback later
("cannot convert float NaN to integer"), an overflow deep in a library, or a 0 that a
later `or` quietly turns into a default. Stdlib only, so parsing imports no torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from decimal import Decimal, DecimalException, Inexact, localcontext
from typing import TypeVar

T = TypeVar("T")


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """A type for an integer flag in [low, high] (high None: no upper bound). Refuses
    what `int` refuses ("1e3", "2.5") as well as values out of range."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want  # what argparse would print if it named the type
    return parse


def float_range(low: float, *, low_open: bool = False, high: float = math.inf,
                infinite: bool = False) -> Callable[[str], float]:
    """A type for a float flag in [low, high] ((low, high] with `low_open`). NaN is always
    refused; infinity only with `infinite` (a flag for which inf means "unbounded")."""
    if high < math.inf:
        want = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        want = f"a {'' if infinite else 'finite '}number {'>' if low_open else '>='} {low:g}"
        want += " (inf: unbounded)" if infinite else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if math.isnan(value) or (math.isinf(value) and not infinite) or value < low \
                or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want
    return parse


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A type from a parser that raises ValueError with a message of its own (argparse
    would replace that message with "invalid <name> value")."""

    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def byte_size(text: str) -> int:
    """A byte count, >= 1, in bytes or with a unit: 40GiB, 512MiB, 1.5GB, 4096 (KB, MB, GB,
    TB are powers of 1000; KiB, MiB, GiB, TiB of 1024; case does not matter)."""
    raw = text.strip()
    number = raw.rstrip("BbKkMmGgTtIi")
    unit = raw[len(number):].strip().lower()
    want = "a byte size >= 1 such as 40GiB, 512MiB, 1.5GB or 4096"
    try:  # decimal: 1.1GB is 1100000000 bytes exactly, not a float's 1100000000.0000002
        with localcontext() as exact:  # digits enough for the product; rounding refused
            exact.prec = len(number) + 20
            exact.traps[Inexact] = True
            value = Decimal(number.strip()) * _UNITS[unit]
    except (DecimalException, KeyError):  # a bad number, or one past Decimal's exponents
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
    if not value.is_finite() or value < 1 or value >= 2**63 or value != value.to_integral():
        raise argparse.ArgumentTypeError(f"must be {want} (a whole number of bytes), "
                                         f"got {text!r}")
    return int(value)


byte_size.__name__ = "a byte size"

positive_int = int_range(1)
non_negative_int = int_range(0)
port = int_range(0, 65535)
positive_float = float_range(0.0, low_open=True)
non_negative_float = float_range(0.0)
share = float_range(0.0, low_open=True, high=1.0)  # a fraction of a budget: (0, 1]
