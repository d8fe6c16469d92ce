"""Faithful traces: sequence chains (parsing, tokens, replay, bound), `trace synth` and
`trace from-chats`."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.cli import main
from shadowradix.layout import deepseek_v4_flash, full_attention
from shadowradix.sim import TraceError, TraceRequest, load_trace, replay
from shadowradix.sim.chats import Chat, chat_requests, from_chats
from shadowradix.sim.simulate import bound_hit_rate, policy_choice, simulate
from shadowradix.sim.synth import ChatShape, Lengths, synth_conversations, synth_trace
from shadowradix.sim.trace import write_trace
from shadowradix.tiers import PrefixCache

GOOD = {"timestamp": 0, "input_length": 40, "output_length": 30, "hash_ids": [1, 2, 3],
        "block_size": 16, "sequence_hash_ids": [1, 2, 4, 5, 6]}


def fixed(n: int) -> Lengths:
    """Every draw exactly n tokens (a lognormal without spread)."""
    return Lengths(n, 0.0)


def strip(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The same trace as Mooncake records it: prompt chains only."""
    return [replace(r, sequence_hash_ids=None) for r in requests]


def two_turns(block_size: int) -> list[TraceRequest]:
    """One conversation: a 300-token system prompt, 100-token user messages, 400-token
    replies. Turn 1: prompt 400, sequence 800; turn 2: prompt 900."""
    shape = ChatShape(conversations=1, turns_min=2, turns_max=2, system_prompts=1,
                      system_tokens=fixed(300), prompt_tokens=fixed(100),
                      reply_tokens=fixed(400), block_size=block_size)
    return synth_trace(shape)


# --- the format -------------------------------------------------------------------------

def test_the_new_fields_parse_and_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    (req,) = load_trace(path)
    assert (req.block_size, req.sequence_hash_ids) == (16, (1, 2, 4, 5, 6))
    assert req.to_json() == GOOD
    out = tmp_path / "copy.jsonl.gz"
    assert write_trace(out, [req, replace(req, timestamp=5)]) == 2
    assert load_trace(out) == [req, replace(req, timestamp=5)]


def test_a_plain_line_writes_back_as_it_was():
    plain = {"timestamp": 3, "input_length": 600, "output_length": 1, "hash_ids": [7, 8]}
    assert TraceRequest(3, 600, 1, (7, 8)).to_json() == plain


@pytest.mark.parametrize("change,why", [
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"hash_ids": [1, 2]}, r"2 hash_ids for input_length 40 \(expected 3 blocks of 16"),
    ({"block_size": 8}, "expected 5 blocks of 8"),
    ({"sequence_hash_ids": [1, 2, 4, 5]}, r"4 sequence_hash_ids .* 70 \(expected 5\)"),
    ({"sequence_hash_ids": [1, 9, 4, 5, 6]}, "must start with the 2 full prompt blocks"),
    ({"hash_ids": [1, 2, 1 << 26]}, r"\[0, 67108864\)"),
    ({"sequence_hash_ids": [1, 2, 4, 5, -1]}, "hash ids must lie in"),
    ({"sequence_hash_ids": 5}, "not a trace request"),
    ({"block_size": "big"}, "not a trace request"),
])
def test_each_bad_chain_is_named(tmp_path, change, why):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, **change}) + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:2: .*{why}"):
        load_trace(path)


def test_the_partial_prompt_block_may_differ_and_the_id_range_follows_the_block_size():
    # 40 tokens of 16: the prompt's third block is partial, the sequence's full (id 4 != 3).
    TraceRequest(0, 40, 30, (1, 2, 3), 16, (1, 2, 4, 5, 6))
    TraceRequest(0, 1024, 0, (0, (1 << 21) - 1))  # 512-token blocks: ids below 2**21, as before
    with pytest.raises(ValueError, match=r"\[0, 1048576\)"):
        TraceRequest(0, 1024, 0, (1 << 20,), block_size=1024)


def test_a_trace_has_one_block_size(tmp_path):
    path = tmp_path / "t.jsonl"
    plain = {"timestamp": 1, "input_length": 40, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(plain) + "\n")
    with pytest.raises(TraceError, match="t.jsonl:2: block_size 512 differs .* 16"):
        load_trace(path)


def test_a_chain_expands_into_the_prompt_then_the_output():
    req = TraceRequest(0, 40, 30, (1, 2, 3), 16, (1, 2, 4, 5, 6))
    seq = req.sequence_tokens()
    assert seq.size == 70 and seq.dtype == np.int32
    assert np.array_equal(seq[:16], 16 + np.arange(16))  # block h: h * 16 + offset
    assert np.array_equal(seq[32:48], 4 * 16 + np.arange(16))
    assert np.array_equal(req.prompt_tokens(), seq[:40])  # the sequence's partial block
    buf = np.empty(req.expanded_tokens, dtype=np.int32)
    assert np.shares_memory(req.prompt_tokens(buf), buf)
    with pytest.raises(ValueError, match="no sequence_hash_ids"):
        replace(req, sequence_hash_ids=None).sequence_tokens()


# --- the replay and the bound -----------------------------------------------------------

def turn_hits(requests: list[TraceRequest], page_size: int) -> list[int]:
    layout = deepseek_v4_flash(page_size=page_size)
    cache = PrefixCache(layout, 64)
    hits: list[int] = []
    replay(cache, requests, with_output=True, per_request=hits, check_every=1)
    return hits


@pytest.mark.parametrize("block_size", [16, 128, 512])
def test_turn_two_hits_the_whole_of_turn_one(block_size):
    """Turn 1 ends at 800 tokens; turn 2's prompt starts with them. With the chain it
    resumes at the last full block of turn 1's sequence, page-aligned (the end-of-sequence
    checkpoint when the block divides the page); without, at turn 1's last full prompt
    block. A trace knows sharing to the block: a partial block's id differs from the id of
    the full block that extends it, and so do their tokens."""
    trace = two_turns(block_size)
    assert [r.input_length for r in trace] == [400, 900]
    full = 800 // block_size * block_size
    assert np.array_equal(trace[1].prompt_tokens()[:full], trace[0].sequence_tokens()[:full])
    ps = 128
    assert turn_hits(trace, ps) == [0, 800 // block_size * block_size // ps * ps]
    assert turn_hits(strip(trace), ps) == [0, 400 // block_size * block_size // ps * ps]
    if block_size <= ps:
        assert turn_hits(trace, ps)[1] == 768  # 800 rounded down to the page


@pytest.fixture(scope="module")
def chats_trace():
    shape = ChatShape(conversations=40, turns_max=5, system_prompts=3, rate=4.0,
                      think_time=5.0, seed=7)
    return synth_trace(shape)


def test_chains_give_strictly_more_hits_and_reach_their_bound(chats_trace):
    lay = deepseek_v4_flash()
    chained = simulate(chats_trace, lay, policy_choice("shadowradix"), None)
    plain = simulate(strip(chats_trace), lay, policy_choice("shadowradix"), None)
    assert chained["hit_rate"] == chained["bound_hit_rate"]
    assert plain["hit_rate"] == plain["bound_hit_rate"]
    assert chained["hit_rate"] > plain["hit_rate"] > 0.1


@pytest.mark.parametrize("policy", ["shadowradix", "no-shadows"])
@pytest.mark.parametrize("block_size,every", [(512, 0), (64, 3), (200, 2)])
def test_unbounded_hit_rate_equals_the_bound_with_chains(policy, block_size, every):
    """As for the Mooncake traces (test_sim.py), with chains on every request or, in a
    mixed trace, on some; with blocks that divide the page or not."""
    trace = synth_trace(ChatShape(conversations=25, turns_max=4, system_prompts=2,
                                  block_size=block_size, seed=block_size))
    if every:
        trace = [replace(r, sequence_hash_ids=None) if i % every == 0 else r
                 for i, r in enumerate(trace)]
    r = simulate(trace, deepseek_v4_flash(), policy_choice(policy), None)
    assert r["refused"] == 0
    assert r["hit_rate"] == r["bound_hit_rate"] == bound_hit_rate(trace, 256) > 0.1


def test_a_bounded_replay_with_chains_keeps_every_invariant(chats_trace):
    layout = full_attention(layers=2, kv_heads=1, head_dim=8, page_size=64)
    cache = PrefixCache(layout, 300)  # far less than the trace: evictions all along
    st = replay(cache, chats_trace, with_output=True, chunk_pages=4, check_every=10)
    assert st.requests == len(chats_trace) and st.refused == 0 and st.cached_tokens > 0
    assert sum(cache.evicted.values()) > 0


# --- trace synth ------------------------------------------------------------------------

def test_synth_is_deterministic_per_seed_and_shares_system_prompts():
    shape = ChatShape(conversations=12, system_prompts=3, system_tokens=fixed(300),
                      block_size=16, seed=3)
    trace = synth_trace(shape)
    assert trace == synth_trace(shape)
    assert trace != synth_trace(replace(shape, seed=4))
    firsts = [conv[0].hash_ids[:300 // 16] for conv in synth_conversations(shape)]
    assert 1 < len(set(firsts)) <= 3  # every conversation starts with one of 3 prompts


@settings(max_examples=25, deadline=None)
@given(conversations=st.integers(1, 6), turns=st.tuples(st.integers(1, 4), st.integers(0, 3)),
       system_prompts=st.integers(1, 3), block_size=st.sampled_from([1, 7, 16, 64, 512]),
       medians=st.tuples(*[st.integers(1, 400)] * 3), sigma=st.floats(0, 1.5),
       max_context=st.integers(2, 8000), seed=st.integers(0, 2**32 - 1))
def test_synth_writes_valid_conversations(tmp_path_factory, conversations, turns,
                                          system_prompts, block_size, medians, sigma,
                                          max_context, seed):
    system, prompt, reply = (Lengths(m, sigma) for m in medians)
    shape = ChatShape(conversations, turns[0], sum(turns), system_prompts, system, prompt,
                      reply, rate=2.0, think_time=10.0, max_context=max_context,
                      block_size=block_size, seed=seed)
    convs = synth_conversations(shape)
    trace = synth_trace(shape)
    assert len(trace) == sum(map(len, convs))
    assert set(trace) == {r for conv in convs for r in conv}
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    for conv in convs:
        assert 1 <= len(conv) <= sum(turns)
        for prev, req in pairwise(conv):  # the next turn extends it
            assert prev.timestamp <= req.timestamp
            assert req.input_length > prev.sequence_length
            full = prev.sequence_length // block_size * block_size
            assert np.array_equal(req.prompt_tokens()[:full], prev.sequence_tokens()[:full])
            assert req.hash_ids[:full // block_size] == prev.sequence_hash_ids[
                :full // block_size]
        assert all(r.sequence_length <= max_context for r in conv)
    path = tmp_path_factory.mktemp("synth") / "t.jsonl"
    write_trace(path, trace)
    assert load_trace(path) == trace  # and every line validates


def test_synth_rejects_a_bad_shape():
    with pytest.raises(ValueError, match="turns need"):
        ChatShape(turns_min=3, turns_max=2)
    with pytest.raises(ValueError, match="MEDIAN"):
        Lengths.parse("many", 1.0)
    assert Lengths.parse("300", 0.7) == Lengths(300, 0.7)
    assert Lengths.parse("300,0.2", 0.7) == Lengths(300, 0.2)


def test_cli_trace_synth(tmp_path, capsys):
    out = tmp_path / "chat.jsonl.gz"
    assert main(["trace", "synth", "--conversations", "6", "--reply-tokens", "120",
                 "--block-size", "64", "--seed", "2", "-o", str(out)]) == 0
    trace = load_trace(out)
    assert trace and all(r.sequence_hash_ids and r.block_size == 64 for r in trace)
    prompt_only = tmp_path / "prompt.jsonl"
    assert main(["trace", "synth", "--conversations", "6", "--reply-tokens", "120",
                 "--block-size", "64", "--seed", "2", "--prompt-only",
                 "-o", str(prompt_only)]) == 0
    assert load_trace(prompt_only) == strip(trace)
    assert main(["trace", "synth", "--turns-min", "3", "--turns-max", "2", "-o", str(out)]) == 2
    assert "turns need" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "--help"])
    printed = capsys.readouterr().out
    assert "synth" in printed and "from-chats" in printed


# --- trace from-chats -------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant for cache questions."}
CHATS = [
    {"timestamp": 1000, "messages": [
        SYSTEM, {"role": "user", "content": "What is a prefix cache?"},
        {"role": "assistant", "content": "It keeps the KV of prompts that others share."},
        {"role": "user", "content": "And a checkpoint?"},
        {"role": "assistant", "content": "The state at a page end, so a request resumes."}]},
    [SYSTEM, {"role": "user", "content": "Hello, world!"},
     {"role": "assistant", "content": "Hello! How are you today?"}],
    {"messages": [SYSTEM, {"role": "user", "content": "The quick brown fox?"},
                  {"role": "assistant", "content": "Jumps over the lazy dog."},
                  {"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "For 1234567890 squares."},
                  {"role": "user", "content": "Thanks"}]},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from shadowradix.server.tokenizer import tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer(1024).save_pretrained(path)
    return path


@pytest.fixture
def chats_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    return path


def test_from_chats_chains_each_turn_onto_the_last(tokenizer_dir, chats_file):
    trace, summary = from_chats(chats_file, tokenizer_dir, block_size=8, gap_ms=500)
    assert (summary.conversations, summary.requests, summary.unchained) == (3, 5, 0)
    # Conversation 1 starts at 1000 ms (its own), 2 at 1500, 3 at 2000; turns 500 ms apart.
    assert [r.timestamp for r in trace] == [1000, 1500, 1500, 2000, 2500]
    first, second = trace[0], trace[1]  # conversation 1, turns 1 and 2
    assert all(r.sequence_hash_ids is not None for r in trace)
    full = first.sequence_length // 8
    assert second.hash_ids[:full] == first.sequence_hash_ids[:full]
    assert np.array_equal(second.prompt_tokens()[:full * 8], first.sequence_tokens()[:full * 8])
    assert len({r.hash_ids[0] for r in trace}) == 1  # one system prompt, one first block
    assert turn_hits_full(trace, 8)[1] == first.sequence_length // 8 * 8


def turn_hits_full(requests: list[TraceRequest], page_size: int) -> list[int]:
    hits: list[int] = []
    replay(PrefixCache(full_attention(page_size=page_size), 256), requests, with_output=True,
           per_request=hits)
    return hits


def test_from_chats_matches_the_tokenizer(tokenizer_dir, chats_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = CHATS[1]
    prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    seq = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    trace, _ = from_chats(chats_file, tokenizer_dir, block_size=4)
    req = trace[2]  # conversation 2 starts with conversation 1's second turn
    assert (req.input_length, req.sequence_length) == (len(prompt), len(seq))


class ForgetfulTemplate:
    """Renders earlier replies as "..." (as templates that drop reasoning do) and a
    generation prompt the rendered reply does not start with: no prompt is the start of
    its sequence."""

    def render(self, messages, add_generation_prompt):
        out = []
        for i, m in enumerate(messages):
            text = m["content"] if (m["role"] != "assistant" or i == len(messages) - 1) \
                else "..."
            out += [ord(ch) for ch in f"<{m['role']}>{text}"]
        return out + ([0] if add_generation_prompt else [])

    def count(self, text):
        return len(text)


def test_a_template_that_rerenders_history_drops_the_chain_and_says_so():
    chats = [Chat(c["messages"] if isinstance(c, dict) else c, None) for c in CHATS]
    trace, summary = chat_requests(chats, ForgetfulTemplate(), block_size=4, gap_ms=10)
    assert summary.unchained == 5  # the generation prompt [0] never starts a sequence
    assert all(r.sequence_hash_ids is None for r in trace)
    assert trace[0].output_length == len(CHATS[0]["messages"][2]["content"])


def test_cli_trace_from_chats(tokenizer_dir, chats_file, tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    assert main(["trace", "from-chats", str(chats_file), "--tokenizer", str(tokenizer_dir),
                 "--block-size", "16", "-o", str(out)]) == 0
    assert "wrote 5 requests of 3 conversations" in capsys.readouterr().out
    assert len(load_trace(out)) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[1]) + "\n" + '{"messages": [{"content": "no role"}]}\n')
    assert main(["trace", "from-chats", str(bad), "--tokenizer", str(tokenizer_dir),
                 "-o", str(out)]) == 2
    assert "bad.jsonl:2: " in capsys.readouterr().err
    assert main(["trace", "from-chats", str(chats_file), "--tokenizer", str(tmp_path / "none"),
                 "-o", str(out)]) == 2
    assert "tokenizer directory" in capsys.readouterr().err
