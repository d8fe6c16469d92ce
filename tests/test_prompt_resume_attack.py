"""Attacks on learned checkpoints measured from prompt ends (tree/resume.py, tree/radix.py,
tiers/manager.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_sound, page_key, tiny_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tree_machine import CacheMachine

from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree import CheckpointPolicy
from shadowradix.tree.resume import MAX_KEPT, MAX_OFFSET, REFRESH, ResumeOffsets

PS = 4
LEARN = CheckpointPolicy(learn_resume=True)


# ------------------------------------------------------------------ the chooser
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, MAX_OFFSET + 3), st.integers(0, MAX_OFFSET + 3)),
                min_size=1, max_size=REFRESH * 3))
def test_chooser_returns_well_formed_offsets(obs):
    r = ResumeOffsets()
    for e, p in obs:
        r.observe(e, p)
    r._chosen = r._choose()
    ends, prompts = r.offsets(), r.prompt_offsets()
    assert ends[0] == 0
    assert list(ends) == sorted(set(ends)) and list(prompts) == sorted(set(prompts))
    assert all(0 <= o < MAX_OFFSET for o in (*ends, *prompts))
    assert len(ends) - 1 + len(prompts) <= MAX_KEPT
    # every chosen offset serves at least MIN_SHARE of the total when chosen, so each
    # chosen one must have seen observations at all
    for o in ends[1:]:
        assert r.counts[o].sum() > 0
    for o in prompts:
        assert r.counts[:, o].sum() > 0


def test_chooser_with_zero_total_after_decay_picks_nothing():
    r = ResumeOffsets()
    r.counts[:] = 0.0
    assert r._choose() == ((0,), ())


def test_chooser_only_far_observations_picks_nothing():
    r = ResumeOffsets()
    for _ in range(REFRESH):
        r.observe(MAX_OFFSET + 5, MAX_OFFSET + 5)
    assert (r.offsets(), r.prompt_offsets()) == ((0,), ())


# ------------------------------------------------------------- prompt validation
def _insert(cache: PrefixCache, tokens: list[int], prompt, start: int = 0):
    full = len(tokens) // PS
    got = cache.alloc({p.name: full - start for p in cache.layout.pools})
    assert got is not None
    table = np.stack([got[p.name] for p in cache.layout.pools])
    return cache.insert(tokens, table, start, prompt=prompt)


@pytest.mark.parametrize("prompt", [np.int64(9), np.uint64(9), np.int32(9), np.uint8(9)])
def test_numpy_integer_prompts_mark_the_same_leaf(prompt):
    cache = PrefixCache(tiny_layout(PS), 64, LEARN)
    res = _insert(cache, list(range(6 * PS)), prompt)
    assert res.node.prompt_end == 2 and isinstance(res.node.prompt_end, int)
    cache.check_integrity()


@pytest.mark.parametrize("prompt", [np.int64(9), np.uint64(9)])
def test_numpy_integer_prompts_through_the_manager(prompt):
    cache = PrefixCache(tiny_layout(PS), 64, LEARN)
    manager = CacheManager(cache)
    tokens = np.arange(9, dtype=np.int32)
    lease = manager.admit(tokens, chunk=9, prompt=prompt)
    assert lease is not None and lease.prompt == 9 and type(lease.prompt) is int
    seq = np.arange(6 * PS, dtype=np.int32)
    assert manager.grow(lease, seq.size)
    manager.finish(lease, seq, seq.size)
    leaf = cache.match(seq, record=False).deepest
    assert leaf.prompt_end == 2 and leaf.end_page == 6
    manager.check_integrity()


@pytest.mark.parametrize("prompt", [0, PS, 6 * PS, 6 * PS + 3, 2**70, np.uint64(2**64 - 1)])
def test_edge_prompts_keep_the_tree_whole(prompt):
    cache = PrefixCache(tiny_layout(PS), 64, LEARN)
    cache.tree.resume._chosen = ((0,), (0, 1, 2))
    res = _insert(cache, list(range(6 * PS)), prompt)
    want = int(prompt) // PS if int(prompt) // PS <= 6 else -1
    assert res.node.prompt_end == want
    cache.check_integrity()
    cache.flush()
    cache.check_integrity(held={})


def test_prompt_beyond_the_sequence_marks_nothing():
    cache = PrefixCache(tiny_layout(PS), 64, LEARN)
    res = _insert(cache, list(range(6 * PS)), 7 * PS)
    assert res.node.prompt_end == -1


def test_unfinished_insert_marks_no_prompt_end():
    cache = PrefixCache(tiny_layout(PS), 64, LEARN)
    full = 6
    got = cache.alloc({p.name: full for p in cache.layout.pools})
    table = np.stack([got[p.name] for p in cache.layout.pools])
    res = cache.insert(list(range(full * PS)), table, finished=False, prompt=2 * PS)
    assert res.node.prompt_end == -1


# ------------------------------------------------ learned prompt checkpoints kept
def test_prompt_checkpoint_is_kept_at_prompt_end_minus_offset():
    cache = PrefixCache(tiny_layout(PS), 200, CheckpointPolicy(learn_resume=True,
                                                                eager_window_release=True))
    cache.tree.resume._chosen = ((0,), (0, 2))
    toks = list(range(20 * PS))
    _insert(cache, toks, 8 * PS + 1)
    # resumes at the prompt end and two pages before it, from the kept checkpoints alone
    for q in (8, 6):
        m = cache.match(toks[:q * PS] + [999_999] * PS, record=False)
        assert m.prefix_len == q * PS, (q, m.prefix_len)
    m = cache.match(toks[:7 * PS] + [999_999] * PS, record=False)
    assert m.prefix_len < 7 * PS


def test_split_of_a_marked_leaf_keeps_the_mark_on_the_leaf():
    cache = PrefixCache(tiny_layout(PS), 200, LEARN)
    toks = list(range(20 * PS))
    res = _insert(cache, toks, 8 * PS)
    leaf = res.node
    # another sequence forks inside the prompt
    _insert(cache, toks[:5 * PS] + [7] * (3 * PS), None)
    assert leaf.alive and leaf.prompt_end == 8 and leaf.start_page == 5
    # a fork after the prompt end
    _insert(cache, toks[:12 * PS] + [8] * (3 * PS), None)
    assert leaf.prompt_end == 8 and leaf.start_page == 12
    cache.check_integrity()


def test_learning_from_a_fork_after_prompt_end_is_not_misattributed():
    """After a split past the prompt end, a match stopping in the (now) tail is past the
    prompt: its prompt offset must be 'far', never negative."""
    cache = PrefixCache(tiny_layout(PS), 400, LEARN)
    toks = list(range(20 * PS))
    res = _insert(cache, toks, 8 * PS)
    _insert(cache, toks[:12 * PS] + [8] * (3 * PS), None)
    assert res.node.start_page == 12
    cache.match(toks[:14 * PS] + [99] * PS)
    assert cache.tree.resume.counts[min(20 - 14, MAX_OFFSET), MAX_OFFSET] == 1


# --------------------------------------------------------------- turn learning
def _serve(cache: PrefixCache, tokens: list[int], reply: list[int], prompt: bool = True,
           content=None) -> int:
    m = cache.match(tokens)
    if content is not None:
        assert_sound(cache, tokens, m, content)
    handle = cache.lock(m)
    seq = [*tokens, *reply]
    done, full = m.prefix_len // PS, len(seq) // PS
    got = cache.alloc({p.name: full - done for p in cache.layout.pools})
    if got is None:
        cache.unlock(handle)
        return -1
    table = np.stack([got[p.name] for p in cache.layout.pools])
    if content is not None:
        for row, spec in enumerate(cache.layout.pools):
            for i, page in enumerate(got[spec.name].tolist()):
                content[row][page] = page_key(seq, done + i, row, PS)
    cache.insert(seq, table, done, prompt=len(tokens) if prompt else None)
    cache.unlock(handle)
    cache.check_integrity()
    return m.prefix_len


def test_drop_reply_chats_under_pressure_stay_sound():
    """Chats whose next turn drops the reply, prompt offsets learned, memory tight:
    every match sound, the tree whole."""
    lay = tiny_layout(PS)
    cache = PrefixCache(lay, 300, CheckpointPolicy(learn_resume=True, every_pages=3))
    content = [{} for _ in lay.pools]
    rng = np.random.default_rng(0)
    for c in range(REFRESH + 30):
        n = int(rng.integers(3, 6)) * PS + int(rng.integers(0, PS))
        base = [50_000 + 300 * c + i for i in range(n)]
        hist = base
        for t in range(3):
            reply = [int(x) for x in rng.integers(1, 40, int(rng.integers(1, 6)) * PS + 2)]
            got = _serve(cache, hist, reply, True, content)
            if got < 0:
                cache.flush()
            hist = hist + [7 + t] * (PS + int(rng.integers(0, PS)))  # reply dropped
    assert cache.tree.resume.prompt_offsets(), cache.tree.resume.counts.sum(axis=0)


# ------------------------------------------------------------------ the machine
class ForcedPromptMachine(CacheMachine):
    """The tree machine with prompt offsets (and end offsets) chosen from the start."""

    policy = CheckpointPolicy(learn_resume=True)

    def __init__(self) -> None:
        super().__init__()
        r = self.cache.tree.resume
        r._chosen = ((0, 1), (0, 1, 2))
        r._choose = lambda: ((0, 1), (0, 1, 2))  # type: ignore[method-assign]


class ForcedPromptEagerMachine(ForcedPromptMachine):
    policy = CheckpointPolicy(learn_resume=True, eager_window_release=True)


class ForcedPromptUnbounded(ForcedPromptMachine):
    pages = 10_000
    bounded = False


def _case(machine):
    return machine.TestCase


_s = settings(max_examples=25, stateful_step_count=40, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
TestForcedPrompt = _case(ForcedPromptMachine)
TestForcedPrompt.settings = _s
TestForcedPromptEager = _case(ForcedPromptEagerMachine)
TestForcedPromptEager.settings = _s
TestForcedPromptUnbounded = _case(ForcedPromptUnbounded)
TestForcedPromptUnbounded.settings = _s


# ---------------------------------------------------------------- preemption
def test_preempted_mid_prefill_marks_no_prompt_end_and_resumes_whole():
    cache = PrefixCache(tiny_layout(PS), 200, LEARN)
    cache.tree.resume._chosen = ((0,), (0, 1))
    manager = CacheManager(cache)
    prompt = np.arange(10 * PS + 2, dtype=np.int32)
    lease = manager.admit(prompt, chunk=5 * PS + 1)
    assert lease is not None
    assert manager.grow(lease, 5 * PS + 1)
    manager.preempt(lease, prompt, 5 * PS + 1)
    manager.check_integrity()
    leaf = cache.match(prompt[:5 * PS], record=False).deepest
    assert leaf.prompt_end == -1
    lease = manager.admit(prompt, chunk=prompt.size, prompt=prompt.size)
    assert lease is not None and lease.cached >= 4 * PS
    seq = np.arange(14 * PS, dtype=np.int32)
    assert manager.grow(lease, seq.size)
    manager.preempt(lease, seq, 12 * PS)  # preempted while decoding
    manager.check_integrity()
    lease = manager.admit(seq[:12 * PS + 1], chunk=10**6, prompt=prompt.size)
    assert lease is not None and lease.cached == 12 * PS
    assert manager.grow(lease, seq.size)
    manager.finish(lease, seq, seq.size)
    manager.check_integrity()
    assert cache.match(seq, record=False).deepest.prompt_end == 10


