"""Sampling never fails for accepted parameters, and one request's failure is its own.

Every filter keeps the most likely token (a top_p that rounds to 0 in float32, a min_p of
1, a top_k of 1 are greedy); min_tokens and stop_token_ids act inside the engine; a request
whose own booking raises fails alone while the others of its step finish exact; finished
requests leave the engine and keep no view of a step's logits."""

from __future__ import annotations

import pytest
import torch
from test_engine import check, rand_tokens
from tiny_model import tiny_model

import shadowradix.engine.engine as engine_module
from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.engine.sampling import sample


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model) -> Engine:
    return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048), step_tokens=64)


PROMPTS = [rand_tokens(n, 40 + n) for n in (9, 30, 17)]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, top_p=1e-300),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, top_p=5e-324),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, temperature=1e-7),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, temperature=0.0),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, top_k=1),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, min_p=1.0),
    SamplingParams(max_new_tokens=6, ignore_eos=True, greedy=False, temperature=3.0,
                   top_k=1, top_p=1e-9, min_p=0.5),
], ids=["top_p-1e-300", "top_p-denormal", "temperature-1e-7", "temperature-0", "top_k-1",
        "min_p-1", "all"])
def test_filters_that_leave_one_token_are_greedy_and_never_raise(model, params):
    eng = engine(model)
    want = [r.output_ids for r in eng.generate(PROMPTS, GREEDY)]
    got = [r.output_ids for r in eng.generate(PROMPTS, params)]
    assert got == want


def test_top_k_and_min_p_only_draw_what_they_keep():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g)
    top = set(logits.topk(5).indices.tolist())
    probs = torch.softmax(logits, -1)
    likely = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    gen = torch.Generator().manual_seed(1)
    k5 = SamplingParams(greedy=False, top_k=5)
    p3 = SamplingParams(greedy=False, min_p=0.3)
    assert {sample(logits, k5, gen) for _ in range(300)} == top
    assert {sample(logits, p3, gen) for _ in range(300)} == likely


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(model):
    eng = engine(model)
    p = [SamplingParams(max_new_tokens=8, ignore_eos=True, greedy=False, top_k=40, top_p=0.9,
                        min_p=0.01, seed=s) for s in (1, 1, 2)]
    a, b, c = (r.output_ids for r in eng.generate([PROMPTS[0]] * 3, p))
    assert a == b and a != c


def test_min_tokens_and_stop_token_ids_end_the_answer_inside_the_engine(model):
    eng = engine(model)
    prompt = PROMPTS[1]
    free = eng.generate([prompt], GREEDY)[0].output_ids
    stop = free[1]  # greedy would stop at its second token
    first = free.index(stop)
    r = eng.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert r.output_ids == free[:first + 1]  # ends on the stop token, which is an output
    late = eng.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,),
                                                 min_tokens=first + 2))[0]
    assert len(late.output_ids) >= first + 2 and stop not in late.output_ids[:first + 2]
    # The stopped answer was cached like any finished one: its next turn hits all of it.
    turn = prompt + r.output_ids + rand_tokens(40, 5)
    again = eng.generate([turn], GREEDY, return_logits=True)[0]
    assert again.cached_tokens >= (len(prompt) + len(r.output_ids)) // 16 * 16 > 0
    check(model, turn, again)


def test_stop_token_ids_outside_the_vocabulary_are_refused(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request(PROMPTS[0], SamplingParams(stop_token_ids=(10**6,)))
    for bad in ({"min_tokens": 17}, {"min_tokens": -1}, {"top_k": -1}, {"min_p": 1.5},
                {"stop_token_ids": "12"}, {"stop_token_ids": (True,)}, {"temperature": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_request_whose_booking_raises_fails_alone(model, monkeypatch):
    """The second request's sampling raises (as multinomial does on NaN logits): it ends
    with its error and frees its pages; the others of the same steps finish exact."""
    eng = engine(model)
    ids = [eng.add_request(p, GREEDY, return_logits=True) for p in PROMPTS]
    original = engine_module.sample

    def failing(logits, params, generator, banned=()):  # type: ignore[no-untyped-def]
        if failing.req == ids[1]:  # type: ignore[attr-defined]
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return original(logits, params, generator, banned)

    decide = eng._decide  # where a chunk's tokens are chosen, before any is booked

    def tagged(c, rows):  # type: ignore[no-untyped-def]
        failing.req = c.request.id  # type: ignore[attr-defined]
        return decide(c, rows)

    monkeypatch.setattr(engine_module, "sample", failing)
    monkeypatch.setattr(eng, "_decide", tagged)
    outs: dict[str, list] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    failed = outs[ids[1]]
    assert len(failed) == 1 and failed[0].finished and failed[0].result is None
    assert "probability tensor" in str(failed[0].error)
    for rid, p in zip((ids[0], ids[2]), (PROMPTS[0], PROMPTS[2]), strict=True):
        assert outs[rid][-1].finished and outs[rid][-1].error is None
        check(model, p, outs[rid][-1].result)
    eng.check_integrity()
    assert not eng.manager.leases and eng.stats()["failed"] == 1
    monkeypatch.undo()
    failing.req = ids[1]  # every request now
    monkeypatch.setattr(eng, "_decide", decide)
    monkeypatch.setattr(engine_module, "sample", failing)
    with pytest.raises(RuntimeError, match="probability"):  # generate raises its error
        eng.generate(PROMPTS[:2], GREEDY)
    assert not eng.manager.leases and not eng.has_unfinished() and not eng._requests


def test_finished_requests_leave_the_engine_and_keep_no_view_of_the_step(model):
    eng = engine(model)
    ids = [eng.add_request(p, GREEDY, return_logits=True) for p in PROMPTS]
    results, rows = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if not o.finished:  # a kept row is its own copy, not a view of the step's logits
                rows.append(eng._requests[o.request_id].logits[-1])
            else:
                results[o.request_id] = o.result
    assert sorted(results) == sorted(ids)
    assert not eng._requests  # the online path leaked every finished request before
    assert rows and all(r.untyped_storage().nbytes() == eng.vocab_size * 4 for r in rows)
    with pytest.raises(ValueError, match="return_logits"):
        eng.add_request(PROMPTS[0], GREEDY, return_logits="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="return_logits"):
        eng.generate(PROMPTS[:1], GREEDY, return_logits=1)  # type: ignore[arg-type]
