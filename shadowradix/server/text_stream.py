"""Incremental detokenization with stop strings, for streamed and whole answers alike.

A token can end in the middle of a UTF-8 character (byte-level BPE) or change how the
tokens before it decode, so text is released only once it is settled: the decode of a
short window of recent tokens that does not end in U+FFFD (an incomplete character).
Stop strings are searched in the text as it grows, and the last `len(longest stop) - 1`
characters are held back so that no part of a stop string is ever sent. Whatever is
released is a prefix of the whole decode (cut at the first stop string); `finish`
releases the rest, so the streamed pieces always join into the non-streamed text. Where
stop strings overlap, the text ends at the first to complete as it grows character by
character (as if checked after every character), so where tokens split the text makes
no difference. With `min_tokens`, as in vLLM, a stop string counts only if it completes
after the text of the first `min_tokens - 1` tokens (the answer cannot end earlier).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # settled text (a prefix of the final text, before any stop cut)
        self.sent = 0  # characters of `text` released
        self.stopped: str | None = None  # the stop string that ended the text
        self.min_tokens = min_tokens
        self._floor = 0  # a stop string must end past this much text (min_tokens)
        self._prefix = 0  # the window [prefix, read) decodes to the end of `text`
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text now safe to send ('' if none). After a stop
        string appears, `stopped` is set and nothing more is taken or released.

        Several tokens at once (a speculative step) are taken one by one, exactly as if each
        came alone: the tokens after the one a stop string completed at are not taken (so
        `len(ids)` counts the answer's tokens), and min_tokens' floor falls where it would."""
        pieces = []
        for token in token_ids:
            if self.stopped is not None:
                break
            pieces.append(self._add_one(token))
        return "".join(pieces)

    def _add_one(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        if len(self.ids) < self.min_tokens:
            self._floor = len(self.text)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: settle everything left (an incomplete character decodes
        to U+FFFD, as in the whole decode) and return the last piece."""
        if self.stopped is None:
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and self.stopped is None:
            # None starts before `sent`: the hold kept back any that could, until whole.
            hits = [(i + len(s), i, s) for s in self.stop if (i := self._find(s)) >= 0]
            if hits:  # the first to complete as the text grows (then the longest)
                _, cut, self.stopped = min(hits)
                self.text = self.text[:cut]
                final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _find(self, stop: str) -> int:
        """Where `stop` first occurs in the unsent text ending past the floor; -1: nowhere."""
        return self.text.find(stop, max(self.sent, self._floor - len(stop) + 1))

    @property
    def output(self) -> str:
        """Everything released so far."""
        return self.text[:self.sent]
