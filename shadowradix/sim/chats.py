"""`shadowradix trace from-chats`: a trace with sequence chains from a user's own chat logs.

Each input line is one conversation: {"messages": [...], "timestamp": ms (optional)}, or
a bare list of OpenAI-style messages. Every assistant message is one request, tokenized
through the model's own tokenizer and chat template as a chat engine would see it:

    prompt   = template(messages before it, add_generation_prompt=True)
    sequence = template(messages up to and including it)
    output   = sequence[len(prompt):]   (the reply as the model generates it)

Blocks of token ids are hashed into chains (`chain_hashes`), so the next turn's prompt,
which starts with this sequence, shares its blocks. Where a template renders the prompt
differently from the start of the sequence (some drop earlier reasoning, say), the request
keeps its prompt chain only and is counted in the summary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shadowradix.sim.trace import (
    DenseIds,
    TraceError,
    TraceRequest,
    chain_hashes,
    json_ms,
    read_lines,
)

Message = dict[str, Any]


class ChatTemplate(Protocol):
    """What the conversion needs from a tokenizer."""

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """Token ids of the chat template applied to `messages`."""
        ...

    def count(self, text: str) -> int:
        """Token count of plain text (no special tokens)."""
        ...


@dataclass(frozen=True)
class Chat:
    messages: list[Message]
    timestamp: int | None  # ms; None: gap_ms after the previous conversation


@dataclass
class ChatsSummary:
    conversations: int = 0
    requests: int = 0
    unchained: int = 0  # requests without sequence_hash_ids: prompt is not the sequence's start


class _HFTemplate:
    """A transformers tokenizer as a ChatTemplate."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass a model directory "
                             "whose tokenizer_config.json (or chat_template.jinja) has one")
        self.tok = tokenizer

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        ids = self.tok.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
        return [int(i) for i in ids]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


def load_chats(path: str | Path) -> list[Chat]:
    """The conversations of a chat log; raises TraceError naming the line of a bad one."""
    return [_parse_chat(line, f"{path}:{lineno}")
            for lineno, line in read_lines(path, "chat log") if line.strip()]


def _parse_chat(line: str, where: str) -> Chat:
    try:
        d = json.loads(line)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    messages, timestamp = (d.get("messages"), d.get("timestamp")) if isinstance(d, dict) \
        else (d, None)
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise TraceError(f"{where}: a conversation is {{\"messages\": [...]}} or a list of "
                         "messages, each with a \"role\"")
    for k, m in enumerate(messages):
        try:  # the tokenizer takes Unicode text only: a lone surrogate (\ud800) is not
            json.dumps(m, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end].encode("unicode_escape").decode()
            raise TraceError(f"{where}: message {k} is not valid Unicode text (a lone "
                             f"surrogate {bad})") from None
    try:
        return Chat(messages, None if timestamp is None else json_ms(timestamp, "timestamp"))
    except ValueError as e:
        raise TraceError(f"{where}: {e}") from None


def chat_requests(chats: Sequence[Chat], template: ChatTemplate, block_size: int = 512,
                  gap_ms: int = 1000) -> tuple[list[TraceRequest], ChatsSummary]:
    """One request per assistant message, in arrival order: a conversation starts at its
    timestamp (else gap_ms after the previous one) and its turns follow gap_ms apart.
    Block ids are numbered by first appearance in that order."""
    if block_size < 1 or gap_ms < 0:
        raise ValueError(f"block size must be >= 1 and gap >= 0, got {block_size}, {gap_ms}")
    summary = ChatsSummary(conversations=len(chats))
    rows: list[tuple[int, int, int, int, int, list[int], list[int] | None]] = []
    start = -gap_ms
    for c, chat in enumerate(chats):
        start = chat.timestamp if chat.timestamp is not None else start + gap_ms
        for turn, (prompt, seq, reply) in enumerate(_turns(chat.messages, template)):
            chained = seq[:len(prompt)] == prompt
            summary.unchained += not chained
            # The reply as generated (end-of-turn tokens included), else the text alone.
            output = len(seq) - len(prompt) if chained else template.count(reply)
            rows.append((start + turn * gap_ms, c, turn, len(prompt), output,
                         chain_hashes(prompt, block_size),
                         chain_hashes(seq, block_size) if chained else None))
    rows.sort(key=lambda r: r[:3])
    ids = DenseIds()
    requests = [TraceRequest(ts, n, out, ids(ph), block_size, None if sh is None else ids(sh))
                for ts, _, _, n, out, ph, sh in rows]
    summary.requests = len(requests)
    return requests, summary


def _turns(messages: list[Message], template: ChatTemplate) -> Iterator[
        tuple[list[int], list[int], str]]:
    """(prompt tokens, sequence tokens, reply text) per assistant message."""
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = template.render(messages[:k], True)
            if not prompt:
                raise ValueError(f"the chat template renders an empty prompt before message {k}")
            yield prompt, template.render(messages[:k + 1], False), str(m.get("content") or "")


def from_chats(path: str | Path, tokenizer: str | Path, block_size: int = 512,
               gap_ms: int = 1000) -> tuple[list[TraceRequest], ChatsSummary]:
    """`chat_requests` over a chat log file, through the tokenizer and chat template in
    the directory `tokenizer` (transformers' AutoTokenizer; nothing else loads it)."""
    chats = load_chats(path)
    if not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer} does not exist; pass a model "
                                "directory with the tokenizer files and a chat template")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("trace from-chats needs transformers (pip install "
                         "'shadowradix[model]')") from None

    return chat_requests(chats, _HFTemplate(AutoTokenizer.from_pretrained(str(tokenizer))),
                         block_size, gap_ms)
