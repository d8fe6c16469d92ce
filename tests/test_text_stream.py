"""Incremental detokenization against the brute force: whatever the tokens and however
they arrive, the released pieces join into the whole decode cut where a stop string first
appears (checked after every character),
no piece of a stop string is ever sent, and text from real UTF-8 never shows U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.server.text_stream import TextStream
from shadowradix.server.tokenizer import tiny_tokenizer

TOK = tiny_tokenizer(1024)
LETTERS = st.sampled_from(list("ab xyz.,!") + list("你好世界缓存") + ["😀", "🚀", "π", "é", "\n"])


def full_text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def expected(ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The whole decode cut where a stop string first appears, checking after every
    character: the occurrence that ends first (then the longest)."""
    text = full_text(ids)
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return text[:end - len(max(done, key=len))], True
    return text, False


def run(ids: list[int], sizes: list[int], stops: list[str]) -> tuple[list[str], TextStream]:
    stream = TextStream(TOK, stops)
    pieces, at = [], 0
    for size in sizes:
        if at >= len(ids):
            break
        pieces.append(stream.add(ids[at:at + size]))
        at += size
    if at < len(ids):
        pieces.append(stream.add(ids[at:]))
    pieces.append(stream.finish())
    return pieces, stream


@st.composite
def token_ids(draw: st.DrawFn) -> list[int]:
    """Tokens of real text (multi-byte characters split across tokens), random ids
    (invalid UTF-8, special tokens), or both."""
    parts: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            parts += TOK.encode(draw(st.text(LETTERS, min_size=1, max_size=30)))
        else:
            parts += draw(st.lists(st.integers(0, 1023), min_size=1, max_size=20))
    return parts


@settings(max_examples=300, deadline=None)
@given(ids=token_ids(), sizes=st.lists(st.integers(1, 4), max_size=40), data=st.data())
def test_pieces_join_into_the_whole_decode_cut_at_the_first_stop(ids, sizes, data):
    """(Found by this test: stop strings 'a' and '.界aa' over '..界aa': the text must end
    at 'a', which completes first, not at '.界aa', which starts first.)"""
    text = full_text(ids)
    stops = data.draw(st.lists(st.one_of(
        st.text(LETTERS, min_size=1, max_size=3),
        st.integers(0, max(len(text) - 1, 0)).flatmap(
            lambda i: st.integers(1, 4).map(lambda n: text[i:i + n]))), max_size=3))
    pieces, stream = run(ids, sizes, stops)
    want, stopped = expected(ids, stops)
    assert "".join(pieces) == want == stream.output
    assert (stream.stopped is not None) == stopped
    for i in range(len(pieces)):  # nothing sent so far ever contains a whole stop string
        sent = "".join(pieces[:i + 1])
        assert not any(s and s in sent for s in stops)


@settings(max_examples=200, deadline=None)
@given(text=st.text(LETTERS, min_size=1, max_size=60),
       sizes=st.lists(st.integers(1, 3), max_size=60))
def test_real_text_never_shows_a_broken_character(text, sizes):
    """Tokens of valid UTF-8 (byte-level BPE splits characters across tokens): every piece
    is whole characters."""
    ids = TOK.encode(text)
    pieces, _ = run(ids, sizes, [])
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip):
    ids = [TOK.bos_token_id, *TOK.encode("Hi"), TOK.eos_token_id]
    stream = TextStream(TOK, skip_special_tokens=skip)
    text = stream.add(ids) + stream.finish()
    assert text == TOK.decode(ids, skip_special_tokens=skip)
    assert ("<｜" in text) is not skip


def test_overlapping_stops_end_at_the_first_to_complete():
    ids = TOK.encode("..界aa")
    for sizes in ([1] * len(ids), [len(ids)], [2, 1, 5]):
        pieces, stream = run(ids, sizes, ["a", ".界aa"])
        assert "".join(pieces) == "..界" and stream.stopped == "a"
