"""The n-gram drafter (prompt lookup) against a brute-force search, over growing token
lists, and the custom proposer's answers checked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadowradix.engine.config import SpecConfig
from shadowradix.engine.drafters import PromptLookup, TokenDrafter


def brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The followers of the latest earlier occurrence of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n:]
        for i in range(size - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@given(st.integers(1, 3), st.integers(0, 3),
       st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4),
                          st.integers(1, 6)), min_size=1, max_size=30))
def test_prompt_lookup_equals_brute_force(lo: int, extra: int,
                                          steps: list[tuple[list[int], int]]) -> None:
    lookup, tokens = PromptLookup(lo, lo + extra), []
    for new, k in steps:
        tokens += new
        assert lookup.propose(tokens, k) == brute(tokens, lo, lo + extra, k)


def test_prompt_lookup_takes_a_list_cut_back_anew() -> None:
    lookup = PromptLookup(1, 2)
    assert lookup.propose([1, 2, 3, 1], 2) == [2, 3]
    assert lookup.propose([4, 5, 4], 2) == [5, 4]  # shorter: not the old history


def test_no_match_proposes_nothing() -> None:
    assert PromptLookup(1, 3).propose(list(range(50)), 3) == []


@pytest.mark.parametrize("answer, says", [
    ("abc", "sequence of token ids"), (None, "sequence of token ids"),
    ([1, 2, 3, 4], "at most 3"), ([300], r"\[0, 256\)"), ([-1], r"\[0, 256\)"),
    ([True], "not a token id"), ([1.0], "not a token id")])
def test_a_bad_custom_answer_raises_a_clear_error(answer: object, says: str) -> None:
    drafter = TokenDrafter(SpecConfig("custom", 3, proposer=lambda t, k: answer), 256)
    with pytest.raises(ValueError, match=says):
        drafter.propose([1, 2], None, 3)


def test_a_custom_answer_of_numpy_ints_is_taken() -> None:
    drafter = TokenDrafter(SpecConfig("custom", 3, proposer=lambda t, k: np.array([4, 5])), 256)
    draft, _ = drafter.propose([1, 2], None, 3)
    assert draft == [4, 5] and all(type(t) is int for t in draft)
