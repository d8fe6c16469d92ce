"""Who proposes the draft tokens a speculative step verifies (SpecConfig.method).

    # ngram    prompt lookup over the request's own tokens (prompt + output): the tokens
    #          that followed the latest earlier occurrence of its last n tokens, longest
    #          n first; nothing when nothing matches
    # custom   the caller's proposer(tokens, k)
    # mtp      the checkpoint's MTP block (engine/mtp_drafter.py): drafts come from a
    #          forward, not from here

A drafter only proposes; the engine verifies every draft against the target model, so a
drafter can make decoding slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from numbers import Integral
from typing import Any

import numpy as np

from shadowradix.engine.config import SpecConfig


class PromptLookup:
    """A request's tokens as a growing int32 array, searched for its suffix n-grams.

    Each step appends the new tokens and scans the history with vectorised compares:
    O(length x n) machine work and no per-token Python objects, so a 32K-token prompt
    costs ~0.1 ms a step and its first draft no indexing pass (a dict of n-grams took
    0.4 s and 11 MB for one such prompt)."""

    __slots__ = ("hi", "lo", "size", "tokens")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tokens = np.zeros(64, dtype=np.int32)
        self.size = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        suffix n-gram (an occurrence ends before the last token, so it has a follower)."""
        size = len(tokens)
        if size < self.size:  # the list was cut back: take it anew
            self.size = 0
        if size > self.tokens.size:
            grown = np.zeros(max(size, 2 * self.tokens.size), dtype=np.int32)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:size] = tokens[self.size:size]
        self.size = size
        a = self.tokens[:size]
        for n in range(min(self.hi, size - 1), self.lo - 1, -1):
            found = a[:size - n] == a[size - n]  # starts i < size - n: a follower exists
            for j in range(1, n):
                found &= a[j:size - n + j] == a[size - n + j]
            hits = np.flatnonzero(found)
            if hits.size:
                e = int(hits[-1]) + n
                return a[e:e + k].tolist()
        return []


class TokenDrafter:
    """Drafts from a request's tokens alone (ngram, custom): `propose(tokens, state, k)`
    returns (draft, state), the state being the drafter's per-request memory."""

    def __init__(self, config: SpecConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._proposer: Callable[[Sequence[int], int], Any] | None = config.proposer

    def propose(self, tokens: Sequence[int], state: Any, k: int) -> tuple[list[int], Any]:
        if self._proposer is None:
            index = state if isinstance(state, PromptLookup) else PromptLookup(
                self.config.ngram_min, self.config.ngram_max)
            return index.propose(tokens, k), index
        return self._checked(self._proposer(tuple(tokens), k), k), state  # a copy: read-only

    def _checked(self, draft: Any, k: int) -> list[int]:
        """A custom proposer's answer as a list of token ids; ValueError for anything else
        (the request fails alone with it)."""
        if isinstance(draft, np.ndarray) and draft.ndim == 1:
            draft = draft.tolist()
        if isinstance(draft, str | bytes) or not isinstance(draft, Sequence):
            raise ValueError(f"proposer must return a sequence of token ids, got "
                             f"{type(draft).__name__}")
        if len(draft) > k:  # before reading it: a huge or lazy answer is never walked
            raise ValueError(f"proposer returned {len(draft)} tokens, asked for at most {k}")
        out = list(islice(draft, k))
        for t in out:
            if isinstance(t, bool) or not isinstance(t, Integral) or not (
                    0 <= int(t) < self.vocab_size):
                raise ValueError(f"proposer returned {t!r}: not a token id in "
                                 f"[0, {self.vocab_size})")
        return [int(t) for t in out]
