"""Tokenizers for the server: a checkpoint's own (AutoTokenizer), or the tiny model's.

The tiny model's is a byte-level BPE trained at start-up with the `tokenizers` library on
a small built-in text, padded to the model's vocabulary so every id it can emit decodes.
Its special tokens and chat template follow DeepSeek's, with ids matching the model
config (bos 0, eos 1). Nothing is downloaded.

Chat prompts (`chat_ids`) keep the template's markers special but, by default, encode the
text of a special token typed into a message's content as plain text, so a client cannot
forge a turn (an end-of-sentence and an Assistant marker inside a user message).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shadowradix.server.protocol import ApiError

BOS, EOS, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>")

# DeepSeek's shape: the system prompt first, then alternating turns; an answer ends in EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")

# Enough varied text (English, code, numbers, Chinese) for the BPE to learn real merges.
_CORPUS = """\
The cache keeps every form of a token: sliding-window keys, compressed keys, indexer keys,
and the compressor state. A prefix that two requests share is computed once and read twice.
Hello, world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. The quick brown fox jumps over the lazy dog 1234567890.
def forward(self, input_ids, positions): return self.model(input_ids, positions=positions)
for i in range(10): print(i, i * i, "squares") # comments explain why, not what
{"role": "user", "content": "Summarise the article in three sentences."}
你好，世界！今天天气很好。我们在讨论大语言模型的键值缓存。前缀缓存可以复用计算结果。
稀疏注意力只读取一部分压缩后的键值，热工作集留在显存里，完整历史留在主机内存中。
Emoji and symbols: ✓ ✗ → ← ★ 😀 🚀 ∑ ∫ π ≈ ≠ ≤ ≥ € £ ¥ © ®.
"""


def tiny_tokenizer(vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast` of exactly `vocab_size` ids (bos 0, eos 1), with a chat
    template. Deterministic: the same text and settings train the same merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, USER, ASSISTANT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # the text ran out of merges: reserved ids, so every id decodes
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tiny tokenizer has {tok.get_vocab_size()} ids, want {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)


def load_tokenizer(path: str) -> Any:
    """A checkpoint directory's tokenizer and chat template (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool
             = True, specials_in_content: bool = False, bound: TextBound | None = None
             ) -> list[int]:
    """The chat template over `messages`, as token ids. The template's own special tokens
    stay special; special-token text inside a message's content is encoded as plain text
    unless `specials_in_content` (the server's --allow-special-tokens-in-content). ApiError
    (400) if the template refuses the messages, or moves content so it cannot be told apart.
    Content with no special-token text is encoded exactly as the whole rendered text is."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError("this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    pattern = None if specials_in_content else _specials(tokenizer)
    marked = [i for i, m in enumerate(messages)
              if pattern is not None and pattern.search(m["content"])]
    if pattern is not None and not marked and pattern.search(
            "".join(m["content"] for m in messages)):  # split across messages that touch
        marked = [i for i, m in enumerate(messages) if m["content"]]
    if not marked:
        text = _render(tokenizer, messages, add_generation_prompt)
        if bound is not None:
            bound.check(text, "messages")
        return _encode(tokenizer, text)
    return _encode_marked(tokenizer, messages, marked, add_generation_prompt, bound)


def _encode_marked(tokenizer: Any, messages: Sequence[dict[str, str]], marked: list[int],
                   add_generation_prompt: bool, bound: TextBound | None = None) -> list[int]:
    """Render with each marked message's content between two sentinels, then encode the
    template's text with its special tokens and the content between the sentinels with
    split_special_tokens (every special token's text as plain text)."""
    opening, closing = _sentinels(messages)
    wrapped = [dict(m, content=f"{opening}{m['content']}{closing}") if i in marked else m
               for i, m in enumerate(messages)]
    text = _render(tokenizer, wrapped, add_generation_prompt)
    parts = re.split(f"({re.escape(opening)}|{re.escape(closing)})", text)
    marks = parts[1::2]
    if marks != [opening, closing] * len(marked):
        raise ApiError(f"messages[{marked[0]}].content: it holds special-token text the chat "
                       f"template does not keep apart; remove it, or start the server with "
                       f"--allow-special-tokens-in-content", param="messages.content")
    if bound is not None:
        bound.check("".join(parts[0::2]), "messages")
    ids: list[int] = []
    for i, part in enumerate(parts[0::2]):
        ids += _encode(tokenizer, part, plain=i % 2 == 1)
    return ids


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool
            ) -> str:
    try:
        return str(tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False))
    except Exception as e:  # a template's own raise_exception (e.g. roles out of order)
        raise ApiError(f"messages: the chat template refused them: {e}",
                       param="messages") from None


def _encode(tokenizer: Any, text: str, plain: bool = False) -> list[int]:
    """The template adds BOS itself, so no special tokens are added here."""
    if not text:
        return []
    if plain:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    return list(tokenizer.encode(text, add_special_tokens=False))


def _sentinels(messages: Sequence[dict[str, str]]) -> tuple[str, str]:
    """Two private-use characters that occur in no message."""
    used = set("".join(m["content"] for m in messages))
    free = (chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in used)
    return next(free), next(free)


_PATTERNS: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = weakref.WeakKeyDictionary()


def _specials(tokenizer: Any) -> re.Pattern[str] | None:
    """One pattern matching the text of any of the tokenizer's special tokens (None: it
    has none), built once per tokenizer."""
    try:
        return _PATTERNS[tokenizer]
    except KeyError:
        pass
    texts = sorted({t.content for t in tokenizer.added_tokens_decoder.values()
                    if getattr(t, "special", False)}, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
    _PATTERNS[tokenizer] = pattern
    return pattern


@dataclass(frozen=True)
class TextBound:
    """Text too long to fit, told by its length alone, so it is refused before the
    tokenizer spends time and memory on it (a 5 MB prompt costs the tokenizer ~1 GB).

    No token stands for more than `token_chars` characters (the longest entry of the
    vocabulary), so text of more than `max_len * token_chars` characters is more than
    `max_len` tokens and can never fit in a request."""

    max_len: int  # tokens one request may hold (prompt and output)
    token_chars: int  # the most characters one token can stand for

    @property
    def max_chars(self) -> int:
        return self.max_len * self.token_chars

    def check(self, text: str, param: str) -> None:
        """ApiError (400, context_length_exceeded) if `text` can never fit."""
        if len(text) > self.max_chars:
            raise ApiError(f"{param}: {len(text)} characters can never fit: a token here stands "
                           f"for at most {self.token_chars} characters, so {self.max_len} tokens "
                           f"(what this server holds per request) hold at most {self.max_chars}",
                           param=param, code="context_length_exceeded")


def text_bound(tokenizer: Any, max_len: int) -> TextBound | None:
    """The bound for a fast tokenizer whose every token stands for text it keeps (a BPE
    that splits without dropping characters); None where no such bound holds: a slow
    tokenizer, a normalizer (it may shrink text before the split), a pre-tokenizer that
    drops whitespace, unknown characters fused into one token, or an added token that
    swallows the spaces beside it."""
    from tokenizers import models

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, models.BPE):
        return None
    if backend.model.unk_token is not None and backend.model.fuse_unk:
        return None
    if backend.normalizer is not None and _spec(backend.normalizer) != {
            "type": "Sequence", "normalizers": []}:
        return None
    if backend.pre_tokenizer is not None and not _keeps_text(_spec(backend.pre_tokenizer)):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    # A byte-level entry spells each byte as one character (and a character is at least
    # one byte); other entries spell their text, with markers ("▁", "<0x0A>") never
    # shorter than what they stand for; an added token's entry is its text.
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)
    return TextBound(max_len, max(longest, 1))


_KEEPING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def _keeps_text(spec: dict[str, Any]) -> bool:
    """Whether a pre-tokenizer only splits (or re-spells 1:1) and never drops text."""
    if spec.get("type") == "Sequence":
        return all(_keeps_text(s) for s in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING and spec.get("behavior") != "Removed"


def _spec(component: Any) -> dict[str, Any]:
    return dict(json.loads(component.__getstate__()))
