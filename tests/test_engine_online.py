"""The online engine core (issue: one owner of a request's cache life): requests join,
grow, stream, get preempted and get aborted between steps, and every output stays exact
against transformers. Pages are poisoned (NaN) when handed out, so a read of a page a
request no longer owns shows in the logits; `check_integrity` runs after every step."""

from __future__ import annotations

import threading

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def online(model, step_tokens: int = 64, **kw) -> Engine:
    cfg = {"page_size": 16, "device_tokens": 2048, "debug_poison": True, **kw}
    return Engine.from_hf(model, CacheConfig(**cfg), step_tokens=step_tokens)


def drain(eng: Engine, results: dict, streams: dict | None = None) -> None:
    """Step until nothing is left, checking integrity after every step."""
    while eng.has_unfinished():
        for out in eng.step():
            if streams is not None:
                streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                results[out.request_id] = out.result
        eng.check_integrity()


def submit(eng: Engine, prompts: list[list[int]], p: SamplingParams) -> dict[str, list[int]]:
    """Add each prompt (logits kept); request id -> prompt."""
    return {eng.add_request(prompt, p, return_logits=True): prompt for prompt in prompts}


def assert_pools_full(eng: Engine) -> None:
    eng.cache.flush(tiers=("device",))
    for name, pool in eng._prefix.pools.items():
        assert pool.free_pages == pool.num_pages, name


def test_requests_join_between_steps_stream_and_abort_mid_decode(model):
    eng = online(model)
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = submit(eng, [rand_tokens(30 + 7 * i, 100 + i) for i in range(3)], p)
    results: dict = {}
    streams: dict = {}
    for _ in range(4):
        for out in eng.step():
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.check_integrity()
    victim = next(iter(prompts))
    assert streams[victim], "the victim was decoding when aborted"
    eng.abort(victim)
    eng.abort(victim)  # idempotent
    eng.check_integrity()
    shared = prompts[next(iter(list(prompts)[1:]))]
    # Two join mid-run; one shares a running request's prefix.
    prompts.update(submit(eng, [rand_tokens(50, 300), shared[:32] + rand_tokens(10, 201)], p))
    drain(eng, results, streams)
    assert victim not in results and set(results) == set(prompts) - {victim}
    for rid, r in results.items():
        assert streams[rid] == r.output_ids  # streamed tokens are the result's tokens
        check(model, prompts[rid], r)
    assert any(r.cached_tokens for r in results.values())  # a running prefix was hit
    assert eng.stats()["aborted"] == 1
    assert_pools_full(eng)
    eng.close()


def test_long_decode_in_a_window_pool_much_smaller_than_the_sequence():
    """Prompt 300, 1,000+ new tokens, window 32: the sliding-window pool holds 12 pages
    (192 tokens) for a 1,330-token sequence, and the output is exact throughout."""
    model = tiny_model(window=32)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, window_tokens=192,
                                            debug_poison=True), step_tokens=64)
    prompt = rand_tokens(300, 7)
    eng.add_request(prompt, SamplingParams(max_new_tokens=1030, ignore_eos=True),
                    return_logits=True)
    results: dict = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.result
        steps += 1
        if steps % 50 == 0:
            eng.check_integrity()
        assert eng._prefix.pools["swa"].used_pages <= 12
    (r,) = results.values()
    assert len(r.output_ids) == 1030
    check(model, prompt, r)
    assert eng.stats()["preemptions"] == 0
    assert_pools_full(eng)


def test_a_state_pool_much_smaller_than_the_sequence_stays_exact_and_resumes(model):
    """state_tokens=128: 8 state entries for a 500-token sequence (31 pages). The running
    request holds only its resume point's; the next turn resumes at the end checkpoint."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048, state_tokens=128,
                                            debug_poison=True), step_tokens=64)
    assert eng._prefix.pools["state"].num_pages == 8
    prompt = rand_tokens(300, 8)
    first = eng.generate([prompt], SamplingParams(max_new_tokens=200, ignore_eos=True),
                         return_logits=True)[0]
    check(model, prompt, first)
    turn2 = prompt + first.output_ids + rand_tokens(20, 9)
    second = eng.generate([turn2], SamplingParams(max_new_tokens=8, ignore_eos=True),
                          return_logits=True)[0]
    check(model, turn2, second)
    assert second.cached_tokens == 496  # every full page of turn 1: its end checkpoint
    eng.check_integrity()
    with pytest.raises(ValueError, match="state_tokens"):
        CacheConfig(page_size=16, state_tokens=24)


def test_more_requests_than_the_device_holds_finish_exact_with_preemptions(model):
    """Eight requests whose decodes outgrow a device of 6 pages of every pool (11 frames of
    its arena): the newest are preempted and resume from what the cache still holds; none
    raises, all are exact."""
    eng = online(model, step_tokens=48, device_tokens=96)
    p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = submit(eng, [rand_tokens(20 + 3 * i, 400 + i) for i in range(8)], p)
    results: dict = {}
    drain(eng, results)
    assert eng.stats()["preemptions"] > 0
    assert set(results) == set(prompts)
    for rid, r in results.items():
        check(model, prompts[rid], r)
    assert_pools_full(eng)


def test_a_request_that_can_never_fit_is_refused_and_the_cache_survives(model):
    eng = online(model, device_tokens=256)
    longest = eng.max_sequence_len()
    first = rand_tokens(70, 500)
    (r0,) = eng.generate([first], SamplingParams(max_new_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="device"):
        eng.add_request(rand_tokens(longest, 501), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt 1"):
        eng.generate([first, rand_tokens(longest, 502)])
    (r1,) = eng.generate([first + r0.output_ids + [3]], SamplingParams(max_new_tokens=2),
                         return_logits=True)
    assert r1.cached_tokens == 64  # the earlier prefix still hits
    check(model, first + r0.output_ids + [3], r1)
    eng.check_integrity()


def test_logits_are_kept_only_when_asked(model):
    eng = online(model)
    rid = eng.add_request(rand_tokens(20, 600), SamplingParams(max_new_tokens=3))
    results: dict = {}
    drain(eng, results)
    assert results[rid].logits is None


def test_a_concurrent_call_raises_instead_of_corrupting(model):
    eng = online(model)
    inside, release = threading.Event(), threading.Event()
    forward = eng.runner.forward_batch

    def slow(*args, **kwargs):
        inside.set()
        release.wait(10)
        return forward(*args, **kwargs)

    eng.runner.forward_batch = slow  # type: ignore[method-assign]
    out: list = []
    worker = threading.Thread(target=lambda: out.append(eng.generate([rand_tokens(20, 700)])))
    worker.start()
    try:
        assert inside.wait(10)
        for call in (lambda: eng.step(), lambda: eng.generate([[1, 2, 3]]),
                     lambda: eng.add_request([1, 2]), lambda: eng.abort("req-0")):
            with pytest.raises(RuntimeError, match="thread"):
                call()
    finally:
        release.set()
        worker.join(30)
    eng.runner.forward_batch = forward  # type: ignore[method-assign]
    assert len(out) == 1 and len(out[0][0].output_ids) == 16
    eng.check_integrity()


def test_requests_compare_by_identity():
    from shadowradix.engine.request import Request

    p = SamplingParams()
    a, b = Request("x", [1], 1, p, None), Request("x", [1], 1, p, None)
    assert a != b and a == a


def test_seeded_sampling_draws_the_same_tokens_across_preemption(model):
    """Seeded sampling draws the same tokens whether or not the request was preempted."""
    p = SamplingParams(max_new_tokens=30, greedy=False, temperature=0.8, seed=3,
                       ignore_eos=True)
    prompts = [rand_tokens(25 + i, 800 + i) for i in range(6)]
    roomy = online(model).generate(prompts, p)
    tight = online(model, step_tokens=32, device_tokens=64)
    squeezed = tight.generate(prompts, p)
    assert tight.stats()["preemptions"] > 0
    assert [r.output_ids for r in squeezed] == [r.output_ids for r in roomy]


@pytest.mark.parametrize("host_tokens", [0, 4096])
def test_prefix_reuse_off_computes_every_prompt_whole(model, host_tokens):
    """The benchmarks' cache-off baseline: the same prompts twice, nothing served from any
    tier, still exact, and the books sound (pages still join the tree and get evicted)."""
    eng = online(model, host_tokens=host_tokens, prefix_reuse=False)
    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [rand_tokens(70, 7), rand_tokens(70, 7) + rand_tokens(20, 8)]
    for _ in range(2):
        for prompt, r in zip(prompts, eng.generate(prompts, p, return_logits=True), strict=True):
            assert r.cached_tokens == 0
            check(model, prompt, r)
        eng.check_integrity()
    assert eng.stats()["prefill_tokens"] == 2 * sum(len(x) for x in prompts)
    assert_pools_full(eng)
    with pytest.raises(ValueError, match="prefix_reuse"):
        CacheConfig(prefix_reuse=1)
