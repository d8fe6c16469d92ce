"""The default policy through the engine (tree/policy.py DEFAULT): the checkpoints it keeps
beyond the old default's (learned offsets before sequence ends, one every 16 pages) serve
real hits, and every logit still equals transformers' uncached forward."""

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tree.resume import REFRESH

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
PS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, policy: str | None = None, **kw) -> Engine:
    cfg = {"page_size": PS, "device_tokens": 32768, **kw}
    if policy is not None:
        cfg["policy"] = policy
    return Engine.from_hf(model, CacheConfig(**cfg))


def conversation(c: int) -> tuple[list[int], list[int]]:
    """Turn 2 keeps turn 1's first 4 pages and rewrites its last (a re-rendered reply)."""
    t1 = rand_tokens(5 * PS, 1000 + c)
    return t1, t1[:4 * PS] + rand_tokens(2 * PS + 3, 5000 + c)


def test_learned_offsets_serve_turns_that_rewrite_the_previous_ending(model):
    """First the engine sees enough such conversations to learn the offset (one page before
    a sequence's end); then 20 first turns, and only after them the 20 second turns, through
    a window pool too small for every window: with the end checkpoint alone the windows a
    second turn needs are gone; the learned checkpoints, kept last, still hold them."""
    cached = {}
    for policy in (None, "end-only"):
        eng = engine(model, policy, window_tokens=128 * PS)
        for c in range(REFRESH + 8):
            for turn in conversation(c):
                eng.generate([turn], ONE)
        if policy is None:
            assert eng._prefix.tree.resume.offsets() == (0, 1)
        later = [conversation(100 + c) for c in range(20)]
        eng.generate([t1 for t1, _ in later], ONE)
        results = [eng.generate([t2], ONE, return_logits=True)[0] for _, t2 in later]
        for (_, t2), r in list(zip(later, results, strict=True))[-3:]:
            check(model, t2, r)
        eng.check_integrity()
        cached[policy] = [r.cached_tokens for r in results]
    assert cached["end-only"] == [0] * 20
    assert cached[None] == [4 * PS] * 20


def test_a_checkpoint_every_16_pages_serves_a_divergence_deep_in_a_long_prefix(model):
    """Other requests then take the window pool: only kept checkpoints keep their windows."""
    base = rand_tokens(19 * PS, 77)
    other = base[:18 * PS + 5] + rand_tokens(30, 78)
    for policy, want in ((None, 16 * PS), ("end-only", 0)):
        eng = engine(model, policy, window_tokens=24 * PS)
        eng.generate([base], ONE)
        for i in range(3):
            eng.generate([rand_tokens(12 * PS, 90 + i)], ONE)
        r = eng.generate([other], SamplingParams(max_new_tokens=4, ignore_eos=True),
                         return_logits=True)[0]
        assert r.cached_tokens == want
        check(model, other, r)
        eng.check_integrity()


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="end-only"):
        CacheConfig(policy="lru")
    with pytest.raises(ValueError, match="policy"):
        CacheConfig(policy=3)
    assert CacheConfig(policy="periodic-4").policy == "periodic-4"
    assert CacheConfig(policy="adaptive").policy == "adaptive"  # the default's old name
