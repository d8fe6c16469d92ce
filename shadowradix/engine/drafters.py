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
from numbers import Integral
from typing import Any

from shadowradix.engine.config import SpecConfig


class NgramIndex:
    """The latest end of every n-gram of a growing token list (n in [lo, hi]), indexed
    lazily: each token is indexed once, so a lookup costs O(hi) per new token."""

    __slots__ = ("done", "ends", "hi", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> latest e with tokens[e-n:e]
        self.done = 0  # every n-gram ending before `done` is indexed

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        suffix n-gram (an occurrence ends before the last token, so it has a follower)."""
        size = len(tokens)
        if size < self.done:  # the list was cut back: index it anew
            self.ends.clear()
            self.done = 0
        for e in range(max(self.done, 1), size):
            for n in range(self.lo, min(self.hi, e) + 1):
                self.ends[tuple(tokens[e - n:e])] = e
        self.done = max(self.done, size)
        for n in range(min(self.hi, size), self.lo - 1, -1):
            found = self.ends.get(tuple(tokens[size - n:]))
            if found is not None:
                return list(tokens[found:found + k])
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
            index = state if isinstance(state, NgramIndex) else NgramIndex(
                self.config.ngram_min, self.config.ngram_max)
            return index.propose(tokens, k), index
        return self._checked(self._proposer(tokens, k), k), state

    def _checked(self, draft: Any, k: int) -> list[int]:
        """A custom proposer's answer as a list of token ids; ValueError for anything else
        (the request fails alone with it)."""
        if isinstance(draft, str | bytes) or not isinstance(draft, Sequence):
            raise ValueError(f"proposer must return a sequence of token ids, got {draft!r}")
        out = list(draft)
        if len(out) > k:
            raise ValueError(f"proposer returned {len(out)} tokens, asked for at most {k}")
        for t in out:
            if isinstance(t, bool) or not isinstance(t, Integral) or not (
                    0 <= int(t) < self.vocab_size):
                raise ValueError(f"proposer returned {t!r}: not a token id in "
                                 f"[0, {self.vocab_size})")
        return [int(t) for t in out]
