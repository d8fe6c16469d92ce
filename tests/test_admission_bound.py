"""The admission bound (issue #19, "refusals"): a request is refused at `add_request` only
when it could never run alone, and one that is accepted runs alone to completion, exact.

`CacheManager.fits_ever` asks for `peak_pages(T, 1)` per pool: every page in an ALL pool,
and in a window or checkpoint pool the `hold` pages of the resume point (once) plus the
one page a one-token chunk needs; the scheduler cuts its chunks to fit those pools
(`CacheManager.chunk_end`). The metadata-only property test shows the bound is exact on
this lease mechanism (one page less in a binding pool and the request, alone, preempts
itself); the engine tests show the tokens and logits stay transformers'.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.engine.request import Request
from shadowradix.engine.scheduler import Scheduler
from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager
from shadowradix.tree.policy import named_policy

# ------------------------------------------------------------ engine: issue #19 repros
# Scaled from the issue (window 128, page 256, window_tokens 512, step 512, 200 + 300
# tokens): window 8, page 16, a 2-page window pool, a sequence under 2 pages.


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _two_page_window_engine(model, **kw) -> Engine:
    return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=1024, window_tokens=32,
                                             debug_poison=True, **kw), step_tokens=32)


REPEAT = SamplingParams(max_new_tokens=15, ignore_eos=True)  # 13 + 15: 27 positions, 2 pages


def _exact(eng: Engine, model, prompts: list[list[int]]) -> None:
    for p, r in zip(prompts, eng.generate(prompts, REPEAT, return_logits=True), strict=True):
        check(model, p, r, greedy=True)
    eng.check_integrity()


@pytest.mark.parametrize("reuse", [True, False])
def test_recomputing_a_page_the_tree_holds_runs_in_the_pool_it_was_admitted_to(model, reuse):
    """The second run recomputes page 0 (its 13-token prompt matches nothing, or reuse is
    off) while the tree holds page 0 from the first: its lock pins the tree's window page,
    so its own copy is freed and the tree's is read (the pool holds 2 pages, not 3)."""
    eng = _two_page_window_engine(model, prefix_reuse=reuse)
    prompt = rand_tokens(13, 1900)
    _exact(eng, model, [prompt])
    _exact(eng, model, [prompt])
    assert eng.stats()["preemptions"] == 0


def test_two_identical_prompts_in_one_generate_share_a_small_window_pool(model):
    """Both run at once; the older preempts the newer when pages run short, and the page
    the newer hands over is the older's duplicate: it is freed instead of pinned twice."""
    eng = _two_page_window_engine(model)
    prompt = rand_tokens(13, 1901)
    _exact(eng, model, [prompt, prompt])
    _exact(eng, model, [prompt, prompt])


def _cut_chunks(eng: Engine) -> list[tuple[int, int]]:
    """Record every chunk the scheduler plans (start, end)."""
    seen: list[tuple[int, int]] = []
    plan = eng.scheduler.plan

    def recording():  # type: ignore[no-untyped-def]
        chunks = plan()
        seen.extend((c.start, c.end) for c in chunks)
        return chunks

    eng.scheduler.plan = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("pools", [{"window_tokens": 32}, {"state_tokens": 32},
                                   {"window_tokens": 32, "state_tokens": 32}])
def test_a_request_longer_than_a_small_window_or_state_pool_runs_in_cut_chunks(model, pools):
    """70 tokens (5 pages) at step 64 in a 2-page window and/or state pool (hold 1 + the
    page being written): refused before (5 pages asked for), now run in chunks the
    scheduler cuts to fit, exact and without preemption."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=1024, debug_poison=True,
                                            **pools), step_tokens=64)
    chunks = _cut_chunks(eng)
    prompt = rand_tokens(60, 1902)
    (r,) = eng.generate([prompt], SamplingParams(max_new_tokens=11, ignore_eos=True),
                        return_logits=True)
    check(model, prompt, r, greedy=True)
    assert eng.stats()["preemptions"] == 0
    prefill = [e - s for s, e in chunks if e <= len(prompt)]
    assert sum(prefill) == len(prompt) and max(prefill) < len(prompt)  # it was cut
    eng.check_integrity()


def test_a_long_decode_with_a_small_window_in_a_pool_smaller_than_one_step(model):
    """The issue's 300 + 1,000 tokens, window 32, 6 pages of 128 (step 512), scaled: 40 +
    30 tokens, window 8, a 3-page window pool of 16-token pages at step 64."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=1024, window_tokens=48,
                                            debug_poison=True), step_tokens=64)
    prompt = rand_tokens(40, 1903)
    (r,) = eng.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True),
                        return_logits=True)
    check(model, prompt, r, greedy=True)
    assert eng.stats()["preemptions"] == 0


def test_max_sequence_len_is_what_add_request_accepts(model):
    """With 2-page window and state pools, only the ALL pools limit a sequence: 16 pages,
    256 positions of KV, so prompt + max_new_tokens up to 257, whatever the step."""
    for step in (1, 64, 512):
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=256,
                                                window_tokens=32, state_tokens=32),
                             step_tokens=step)
        longest = eng.max_sequence_len()
        assert longest == 257
        eng.add_request(rand_tokens(200, 1904), SamplingParams(max_new_tokens=longest - 200))
        with pytest.raises(ValueError, match="device pools hold"):
            eng.add_request(rand_tokens(200, 1905),
                            SamplingParams(max_new_tokens=longest - 199))
        eng.close()


# ------------------------------------------------ the bound, exact: metadata-only pools

def _layout(ps: int, windows: list[int], state: bool) -> KVLayout:
    pools = [PoolSpec("kv", 1, Retention.ALL, (1,), "float32", 1)]
    pools += [PoolSpec(f"swa{i}", 1, Retention.WINDOW, (1,), "float32", 1, window=w)
              for i, w in enumerate(windows)]
    if state:
        pools.append(PoolSpec("state", None, Retention.CHECKPOINT, (1,), "float32", 1))
    return KVLayout("bound", tuple(pools), ps)


def _next_token(ids: list[int]) -> int:
    """A deterministic 'model': the same sequence always continues the same way, so a
    repeated prompt recomputes pages the tree already holds."""
    return (ids[-1] * 31 + len(ids) * 7) % 23


def _drive(manager: CacheManager, step: int, jobs: list[tuple[list[int], int]],
           max_steps: int = 5000) -> tuple[list[list[int]], int]:
    """Run requests through the engine's Scheduler and the manager, as Engine._step does
    (admit, plan, 'forward', cache, sample, finish), without a model. Returns every
    request's outputs and the preemptions; raises RuntimeError where the engine would
    ("no request can run") and AssertionError on a page budget overrun."""
    sched = Scheduler(manager, step)
    reqs = [Request(f"r{i}", list(p), len(p), SamplingParams(max_new_tokens=n, ignore_eos=True),
                    None) for i, (p, n) in enumerate(jobs)]
    sched.waiting.extend(reqs)
    cache = manager.cache
    for _ in range(max_steps):
        sched.admit()
        chunks = sched.plan()
        if not chunks and sched.waiting and not sched.running:
            raise RuntimeError("no request can run")
        for c in chunks:
            req = c.request
            req.computed = c.end
            assert req.lease is not None
            manager.cache_prefix(req.lease, req.ids, req.computed)
            if c.end == len(req.ids):
                req.ids.append(_next_token(req.ids))
                if len(req.outputs) >= req.params.max_new_tokens:
                    sched.finish(req)
                    req.done = True
        for name, pool in cache.pools.items():
            assert pool.used_pages <= pool.num_pages, name
        if all(r.done for r in reqs):
            manager.check_integrity()
            return [r.outputs for r in reqs], sched.preemptions
    raise AssertionError("did not finish")


def _expected(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(_next_token(ids))
    return ids[len(prompt):]


@st.composite
def _configs(draw):  # type: ignore[no-untyped-def]
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    windows = draw(st.lists(st.integers(1, 3 * ps + 1), min_size=1, max_size=2))
    state = draw(st.booleans())
    prompt = draw(st.integers(1, 6 * ps))
    new = draw(st.integers(1, 4 * ps))
    step = draw(st.integers(1, 3 * ps + 2))
    policy = draw(st.sampled_from(["shadowradix", "end-only", "eager-swa", "no-shadows"]))
    slack = draw(st.lists(st.integers(-1, 2), min_size=len(windows) + 2,
                          max_size=len(windows) + 2))
    history = draw(st.lists(st.tuples(st.integers(0, 6 * ps), st.integers(1, 3 * ps)),
                            max_size=3))
    reuse = draw(st.booleans())
    return ps, windows, state, prompt, new, step, policy, slack, history, reuse


def _manager(layout: KVLayout, pages: dict[str, int], policy: str,
             reuse: bool = True) -> CacheManager:
    return CacheManager(PrefixCache(layout, pages, named_policy(policy)), reuse=reuse)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs())
def test_fits_ever_is_exact_for_a_request_alone(cfg):
    """Pools sized around the bound (peak - 1 .. peak + 2 pages each). If `fits_ever`
    says yes, the request runs alone to completion, whatever earlier requests left cached
    (the same prompt included), never preempted, its outputs those of the 'model'; and it
    also runs alongside a copy of itself. If it says no, run anyway on empty pools it
    reaches a step where nothing can run."""
    ps, windows, state, n_prompt, new, step, policy, slack, history, reuse = cfg
    layout = _layout(ps, windows, state)
    rng = np.random.default_rng(n_prompt * 1000 + new)
    prompt = rng.integers(0, 23, n_prompt).tolist()
    tokens = n_prompt + new - 1
    peak = _manager(layout, {n: 10_000 for n in layout.pool_names}, policy).peak_pages(tokens)
    pages = {n: max(1, peak[n] + d) for n, d in zip(layout.pool_names, slack, strict=False)}
    manager = _manager(layout, pages, policy, reuse)
    event("fits" if manager.fits_ever(tokens) else "refused")
    if manager.fits_ever(tokens):
        for cut, n in history:  # earlier requests, alone, that share a prefix with it
            earlier = prompt[:cut] + rng.integers(0, 23, max(0, 2 - cut)).tolist()
            if manager.fits_ever(len(earlier) + n - 1):
                assert _drive(manager, step, [(earlier, n)]) == ([_expected(earlier, n)], 0)
        want = _expected(prompt, new)
        assert _drive(manager, step, [(prompt, new)]) == ([want], 0)  # after the history
        assert _drive(manager, step, [(prompt, new)]) == ([want], 0)  # after itself
        assert _drive(manager, step, [(prompt, new)] * 2)[0] == [want, want]  # with a twin
        return
    with pytest.raises(RuntimeError, match="no request can run"):
        _drive(_manager(layout, pages, policy, reuse), step, [(prompt, new)])
