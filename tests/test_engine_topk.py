"""Engine(record_topk=True): the indexer's decode-time selections, recorded per request and
CSA layer as HiSparse access streams, without changing a single output or logit."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import rand_tokens
from tiny_model import CSA, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.sparse import AccessStream, replay

P = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, record: bool, step_tokens: int = 512, **kw) -> Engine:
    cfg = {"page_size": 16, "device_tokens": 2048, **kw}
    return Engine.from_hf(model, CacheConfig(**cfg), step_tokens=step_tokens,
                          record_topk=record)


def assert_streams(model, prompt: list[int], result) -> None:
    """One step per output fed back (all but the last), per CSA layer; step j is the query at
    position len(prompt) + j, which sees (position + 1) // 4 entries and selects min(k, that)
    distinct ones."""
    k = model.config.index_topk
    csa = [i for i, t in enumerate(model.config.layer_types) if t == CSA]
    assert sorted(result.topk) == csa
    counts = [(len(prompt) + j + 1) // 4 for j in range(len(result.output_ids) - 1)]
    for stream in result.topk.values():
        assert isinstance(stream, AccessStream) and stream.top_k == k
        assert stream.counts.tolist() == counts
        for ids, count in stream.steps():
            assert len(set(ids.tolist())) == len(ids) == min(k, count)
            assert ((ids >= 0) & (ids < count)).all()


@pytest.mark.parametrize("step_tokens", [512, 7])
def test_recording_changes_no_output_and_records_every_decode_step(model, step_tokens):
    prompts = [rand_tokens(n, 900 + n) for n in (2, 19, 45, 70)]  # 2: no entry at first
    plain = engine(model, False, step_tokens).generate(prompts, P, return_logits=True)
    eng = engine(model, True, step_tokens)
    recorded = eng.generate(prompts, P, return_logits=True)
    for prompt, a, b in zip(prompts, plain, recorded, strict=True):
        assert a.topk is None
        assert a.output_ids == b.output_ids
        assert a.logits is not None and b.logits is not None and a.logits.equal(b.logits)
        assert_streams(model, prompt, b)
    eng.check_integrity()


def test_a_prefix_cache_hit_records_its_decode_steps_and_selects_the_same(model):
    """A request served from the cache selects what it would select computed cold."""
    prompt = rand_tokens(80, 950)
    cold = engine(model, True).generate([prompt], P)[0]
    eng = engine(model, True)
    eng.generate([prompt[:66]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    warm = eng.generate([prompt], P)[0]
    assert warm.cached_tokens == 64 and warm.output_ids == cold.output_ids
    assert_streams(model, prompt, warm)
    assert warm.topk == cold.topk


def test_preempted_requests_still_record_one_step_per_output(model):
    """Preemption recomputes a request; the query at its last output is recorded once,
    whether fed alone or at the end of a recompute chunk."""
    eng = engine(model, True, step_tokens=48, device_tokens=96)
    p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [rand_tokens(20 + 3 * i, 400 + i) for i in range(8)]
    results = eng.generate(prompts, p)
    assert eng.stats()["preemptions"] > 0
    for prompt, r in zip(prompts, results, strict=True):
        assert_streams(model, prompt, r)


def test_recorded_streams_replay(model):
    (r,) = engine(model, True).generate([rand_tokens(120, 960)],
                                        SamplingParams(max_new_tokens=24, ignore_eos=True))
    k = model.config.index_topk
    for stream in r.topk.values():
        again = AccessStream.from_dict(stream.to_dict())
        lru, opt = replay(again, k + 1, "lru"), replay(again, k + 1, "belady")
        assert lru.lookups == opt.lookups == stream.selections > 0
        assert opt.hits >= lru.hits
        assert np.array_equal(again.ids, stream.ids)


def test_record_topk_must_be_a_bool(model):
    with pytest.raises(ValueError, match="record_topk"):
        engine(model, 1)  # type: ignore[arg-type]
