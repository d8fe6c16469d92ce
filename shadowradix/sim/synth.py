"""`shadowradix trace synth`: multi-turn chat traffic as a trace with sequence chains.

Conversations arrive as a Poisson process and each picks one of a few shared system
prompts. Turn t's prompt is turn t-1's whole sequence (prompt + reply) followed by a new
user message, and its sequence is that prompt followed by a reply: what a chat engine
sees. Token counts are lognormal (chat lengths are: most short, a long tail), the gap
between a conversation's turns exponential (the user reads, thinks, types).

The tokens are made up (unique per message, shared per system prompt) and hashed into
block chains exactly as `trace from-chats` hashes real ones, so the trace can be
replayed like any other. Deterministic given the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shadowradix.sim.trace import (
    BLOCK_TOKENS,
    OUTPUT_TOKEN_BASE,
    DenseIds,
    TraceRequest,
    chain_hashes,
)


class ShapeError(ValueError):
    """A ChatShape or Lengths value out of range; `field` names it (the command line
    turns it into its flag: system_tokens -> --system-tokens)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Lengths:
    """Lognormal token counts: half fall below `median`; `sigma` is the spread of the
    log-length (0.5: 90% within 0.44x-2.3x the median; 1.0: within 0.19x-5.2x).
    Both finite: an infinite median or sigma would sample nothing meaningful."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median >= 1):
            raise ValueError(f"the median must be a finite number >= 1, got {self.median:g}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {self.sigma:g}")

    @classmethod
    def parse(cls, text: str, sigma: float) -> Lengths:
        """From "MEDIAN" (with the given sigma) or "MEDIAN,SIGMA"; ValueError saying why."""
        median, _, spread = text.partition(",")
        try:
            values = float(median), float(spread) if spread else sigma
        except ValueError:
            raise ValueError(f"token lengths take MEDIAN or MEDIAN,SIGMA; got {text!r}") from None
        return cls(*values)

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        """n token counts in [1, cap]. The cap only clips draws (it changes no other draw),
        so a caller that stops at counts >= cap sees the same result as without it, and a
        long tail never allocates a prompt past it."""
        x = rng.lognormal(np.log(self.median), self.sigma, n)
        return np.clip(np.rint(np.minimum(x, cap)), 1, cap).astype(np.int64)


# Defaults: a system prompt of a few thousand tokens (instructions, tools); user messages
# of a couple of hundred with a long tail (pasted documents, code); replies a little longer
# and less spread. Mooncake's chat trace averages 343 output tokens per request.
SYSTEM_TOKENS = Lengths(2000, 0.5)
PROMPT_TOKENS = Lengths(200, 1.0)
REPLY_TOKENS = Lengths(350, 0.8)


@dataclass(frozen=True)
class ChatShape:
    """What the synthetic traffic looks like. Checked on construction (ValueError)."""

    conversations: int = 100
    turns_min: int = 1
    turns_max: int = 6
    system_prompts: int = 4  # shared system prompts conversations pick from, uniformly
    system_tokens: Lengths = field(default=SYSTEM_TOKENS)
    prompt_tokens: Lengths = field(default=PROMPT_TOKENS)  # each new user message
    reply_tokens: Lengths = field(default=REPLY_TOKENS)
    rate: float = 1.0  # conversations per second (Poisson arrivals)
    think_time: float = 60.0  # mean seconds from one turn's arrival to the next's
    max_context: int = 131072  # a conversation ends before a sequence would pass this
    block_size: int = BLOCK_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        """Raises ShapeError naming the first field out of range."""
        for name in ("conversations", "system_prompts", "block_size", "turns_min"):
            if getattr(self, name) < 1:
                raise ShapeError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ShapeError("seed", f"must be >= 0, got {self.seed}")
        if not 2 <= self.max_context <= OUTPUT_TOKEN_BASE:
            raise ShapeError("max_context", f"must be in [2, {OUTPUT_TOKEN_BASE}] (2**30: a "
                             f"trace request holds no more), got {self.max_context}")
        if self.turns_max < self.turns_min:
            raise ShapeError("turns_max", f"turns need 1 <= min <= max, got {self.turns_min}, "
                             f"{self.turns_max}")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ShapeError("rate", f"must be a finite number > 0, got {self.rate:g}")
        if not (math.isfinite(self.think_time) and self.think_time >= 0):
            raise ShapeError("think_time", f"must be a finite number >= 0, got "
                             f"{self.think_time:g}")

    def unfit(self) -> ShapeError | None:
        """A shape that is valid but mostly empty: a median length past max_context ends
        most conversations before their first turn, and more turns than max_context // 2
        (each takes >= 2 tokens) can never all fit. None when neither."""
        for name in ("system_tokens", "prompt_tokens", "reply_tokens"):
            median = getattr(self, name).median
            if median > self.max_context:
                return ShapeError(name, f"median {median:g} tokens is past max_context "
                                  f"{self.max_context}: most conversations would end before "
                                  "their first turn")
        if self.turns_max > self.max_context // 2:
            return ShapeError("turns_max", f"{self.turns_max} turns of >= 2 tokens each cannot "
                              f"fit max_context {self.max_context}")
        return None


@dataclass(frozen=True)
class _Turn:
    """One request before its chains get dense ids."""

    timestamp: int
    conversation: int
    turn: int
    input_length: int
    output_length: int
    prompt_hashes: list[int]
    sequence_hashes: list[int]


def synth_conversations(shape: ChatShape) -> list[list[TraceRequest]]:
    """Each conversation's requests, turn by turn. Block ids are numbered by first
    appearance in time order, as in `synth_trace`."""
    rng = np.random.default_rng(shape.seed)
    systems = shape.system_tokens.sample(rng, shape.system_prompts, shape.max_context + 1)
    with np.errstate(over="ignore"):  # an overflow is refused just below
        starts = np.cumsum(rng.exponential(1.0 / shape.rate, shape.conversations)) * 1000.0
    if not np.isfinite(starts[-1]):
        raise ShapeError("rate", f"{shape.rate:g} per second puts arrivals past any "
                         "timestamp; use a larger rate")
    turns: list[_Turn] = []
    next_segment = shape.system_prompts  # segments 0..K-1 are the system prompts
    for c in range(shape.conversations):
        new, next_segment = _conversation(shape, rng, c, float(starts[c]), systems,
                                          next_segment)
        turns += new
    turns.sort(key=lambda t: (t.timestamp, t.conversation, t.turn))
    ids = DenseIds()
    out: list[list[TraceRequest]] = [[] for _ in range(shape.conversations)]
    for t in turns:
        out[t.conversation].append(TraceRequest(
            t.timestamp, t.input_length, t.output_length, ids(t.prompt_hashes),
            shape.block_size, ids(t.sequence_hashes)))
    return [conv for conv in out if conv]


def synth_trace(shape: ChatShape) -> list[TraceRequest]:
    """The requests of `synth_conversations` in arrival order (a conversation's turns
    in turn order)."""
    merged = [req for conv in synth_conversations(shape) for req in conv]
    return sorted(merged, key=lambda r: r.timestamp)  # stable: ties keep their order


def _segment(number: int, length: int) -> np.ndarray:
    """Made-up tokens no other segment contains."""
    return (np.int64(number) << 32) + np.arange(length, dtype=np.int64)


def _conversation(shape: ChatShape, rng: np.random.Generator, c: int, start_ms: float,
                  systems: np.ndarray, next_segment: int) -> tuple[list[_Turn], int]:
    """Conversation c's turns, and the next unused segment number. What it draws depends
    on its turn count only, never on max_context (a conversation cut short there shifts
    no other)."""
    system = int(rng.integers(shape.system_prompts))
    n = int(rng.integers(shape.turns_min, shape.turns_max + 1))
    cap = shape.max_context + 1  # a longer message ends the conversation all the same
    users = shape.prompt_tokens.sample(rng, n, cap)
    replies = shape.reply_tokens.sample(rng, n, cap)
    with np.errstate(over="ignore"):  # an overflow is refused just below
        gaps = rng.exponential(shape.think_time, n - 1) * 1000.0
    times = start_ms + np.concatenate([[0.0], np.cumsum(gaps)])
    if not np.isfinite(times[-1]):
        raise ShapeError("think_time", f"{shape.think_time:g} s puts turns past any "
                         "timestamp; use a shorter think time")
    pieces = [_segment(system, int(systems[system]))]
    turns: list[_Turn] = []
    bs = shape.block_size
    for t in range(n):
        pieces.append(_segment(next_segment, int(users[t])))
        prompt_len = sum(p.size for p in pieces)
        pieces.append(_segment(next_segment + 1, int(replies[t])))
        next_segment += 2
        stream = np.concatenate(pieces)
        if stream.size > shape.max_context:
            break
        turns.append(_Turn(round(float(times[t])), c, t, prompt_len, int(replies[t]),
                           chain_hashes(stream[:prompt_len], bs), chain_hashes(stream, bs)))
    return turns, next_segment
