"""Where matches resume, learned from the matches themselves (the adaptive policy).

A finished sequence keeps a checkpoint at its end (DESIGN.md §2). When the next request
extends it exactly, that checkpoint is where it resumes. Often it does not: a chat
template re-renders the last turn, a trace hashes the prompt only, a client trims the
reply, a reasoning model's thinking is stripped from the history. Then the request
matches the sequence's tokens only up to some pages before its end, and with the end
checkpoint alone it resumes far earlier (at the last checkpoint above that point),
recomputing the pages between.

`ResumeOffsets` counts, over the matches that go ahead, where in the sequence they
matched into their logical hit stopped, measured two ways: pages before the sequence's
end, and pages before the end of its prompt (the offsets). A next turn whose history
drops the reply stops at, or a block before, the previous prompt's end wherever the reply
ended: one or two offsets from the prompt end serve what, from the sequence end, spreads
over as many offsets as reply lengths vary. It names the offsets of either kind that
cover most matches with fewest checkpoints (greedily: the one serving the most matches
no chosen one serves, while that is a large enough share), and decays its counts, so a
workload that changes is followed.
"""

from __future__ import annotations

import numpy as np

MAX_OFFSET = 16  # pages before a sequence (or prompt) end that a learned checkpoint may sit at
MIN_SHARE = 0.05  # an offset earns a checkpoint once this share of matches only it serves
MAX_KEPT = 6  # learned checkpoints per sequence, at most (each costs a window + state)
HALF_LIFE = 2048  # observations after which old counts weigh half
REFRESH = 64  # observations between recomputations of the chosen offsets


def check_prompt(prompt: object) -> None:
    """A prompt length is a token count: None (unknown) or an integer >= 0. Raises
    ValueError naming it otherwise."""
    if prompt is not None and (isinstance(prompt, bool) or not isinstance(
            prompt, (int, np.integer)) or prompt < 0):
        raise ValueError(f"prompt must be an int >= 0 (tokens), got {prompt!r}")


class ResumeOffsets:
    """A decaying joint histogram of match offsets from sequence ends and from prompt ends,
    and the offsets it picks.

    observe() mutates; offsets() and prompt_offsets() do not (they return the cached
    choice). Offset 0 from the sequence end (the static policy's checkpoint) is always
    chosen; a prompt end only where the matches earn it.
    """

    def __init__(self) -> None:
        # counts[e, p]: matches e pages before the sequence end and p before the prompt's
        # (MAX_OFFSET: farther, past the prompt end, or no prompt end known)
        self.counts = np.zeros((MAX_OFFSET + 1, MAX_OFFSET + 1))
        self.seen = 0
        self._chosen: tuple[tuple[int, ...], tuple[int, ...]] = ((0,), ())

    def observe(self, offset: int, prompt_offset: int = MAX_OFFSET) -> None:
        """Count one match whose logical hit stopped `offset` pages before a sequence end
        and `prompt_offset` before the end of its prompt (MAX_OFFSET or more: too far
        before it, or past it, for a checkpoint to serve)."""
        if offset < 0 or prompt_offset < 0:
            raise ValueError(f"offsets must be >= 0, got {offset}, {prompt_offset}")
        self.counts[min(offset, MAX_OFFSET), min(prompt_offset, MAX_OFFSET)] += 1.0
        self.seen += 1
        if self.seen % HALF_LIFE == 0:
            self.counts /= 2
        if self.seen % REFRESH == 0:
            self._chosen = self._choose()

    def offsets(self) -> tuple[int, ...]:
        """The offsets (pages before a finished sequence's end) to keep checkpoints at,
        ascending; always starts with 0. No side effects."""
        return self._chosen[0]

    def prompt_offsets(self) -> tuple[int, ...]:
        """The offsets (pages before where a finished sequence's prompt ended) to keep
        checkpoints at, ascending; often none. No side effects."""
        return self._chosen[1]

    def _choose(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        counts, total = self.counts, self.counts.sum()
        if total <= 0:
            return (0,), ()
        served = np.zeros_like(counts, dtype=bool)
        served[0, :] = True  # the end checkpoint
        ends, prompts = [0], []
        for _ in range(MAX_KEPT):
            left = np.where(served, 0.0, counts)  # the matches no chosen offset serves
            by_end, by_prompt = left[:MAX_OFFSET].sum(axis=1), left[:, :MAX_OFFSET].sum(axis=0)
            e, p = int(by_end.argmax()), int(by_prompt.argmax())
            if max(by_end[e], by_prompt[p]) < MIN_SHARE * total:
                break
            if by_end[e] >= by_prompt[p]:
                ends.append(e)
                served[e, :] = True
            else:
                prompts.append(p)
                served[:, p] = True
        return tuple(sorted(ends)), tuple(sorted(prompts))
