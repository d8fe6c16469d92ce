"""Adversarial tests of speculative decoding (engine/speculator.py, drafters.py, verify.py,
the engine's booking of a verify step). Each test states the claim it attacks; a failing
test is a defect to fix in shadowradix/, not here."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from spec_util import Proposer, Run, Truth, collect, drain, make, online, rand_tokens, spec
from tiny_model import reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.tiers.manager import CacheManager

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def plain_outputs(model, prompts, params, **cfg) -> list[list[int]]:
    ids, run = online(make(model, **cfg), prompts, params, return_logits=False)
    return [run.results[rid].output_ids for rid in ids]


def truth_of(model, prompts, params) -> Truth:
    t = Truth()
    for p, out in zip(prompts, plain_outputs(model, prompts, params), strict=True):
        t.add(p, out)
    return t


class Interrupt(BaseException):
    """A Ctrl-C at some point of the step."""


# --------------------------------------------------------------- custom proposers
def test_a_proposer_that_appends_to_its_tokens_cannot_change_the_answer(model):
    """drafters.py: 'a drafter can make decoding slower, never wrong'. The proposer is
    handed the request's own `req.ids` list (speculator.draft -> TokenDrafter.propose), so
    a proposer that appends to it inserts tokens into the request's sequence."""
    p = rand_tokens(10, 1)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = plain_outputs(model, [p], params)[0]

    def scribbler(tokens, k):
        if isinstance(tokens, list):
            tokens.append(7)
        return []

    eng = make(model, spec(scribbler, 3))
    ids, run = online(eng, [p], params)
    if ids[0] in run.errors:  # refusing it loudly would be fine
        return
    assert run.results[ids[0]].output_ids == want


def test_a_huge_proposer_answer_is_refused_with_a_clear_error(model):
    """Bad input: 'a custom proposer returning garbage (... huge lists ...) fails its
    request alone with a clear error'. TokenDrafter._checked does `list(draft)` before
    comparing the length with k, so range(10**18) fails the request with a bare
    MemoryError (and a long lazy sequence is walked to its end) instead of 'proposer
    returned N tokens, asked for at most k'."""
    p = rand_tokens(10, 1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    eng = make(model, spec(lambda tokens, k: range(10**18), 3))
    ids, run = online(eng, [p], params)
    err = run.errors.get(ids[0])
    assert isinstance(err, ValueError) and "asked for at most" in str(err), repr(err)


def test_a_long_lazy_proposer_answer_is_not_walked_to_its_end(model):
    """A Sequence of a million tokens: refusing it needs len(), or at most k + 1 items,
    not a million __getitem__ calls (a slow proposer answer stalls every request of
    the step)."""

    class Lazy(Sequence):
        touched = 0

        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            if isinstance(i, slice):
                raise TypeError("no slices")
            if not 0 <= i < 10**6:
                raise IndexError(i)
            Lazy.touched += 1
            return 0

    p = rand_tokens(10, 1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    eng = make(model, spec(lambda tokens, k: Lazy(), 3))
    ids, run = online(eng, [p], params)
    assert isinstance(run.errors.get(ids[0]), ValueError)
    assert Lazy.touched <= 4, f"{Lazy.touched} items read to refuse a draft of at most 3"


# --------------------------------------------------------------------- sampling
def test_seeded_sampling_does_not_depend_on_the_other_requests_of_the_batch(model):
    """'seeded runs reproducible': without speculation a seeded request draws the same
    tokens whatever else runs beside it. With speculation the draft a request carries is
    cut by the step budget the others use (scheduler.plan), and verify() consumes the
    request's generator differently for a different draft length (a uniform per kept
    draft, a residual draw on rejection, else one multinomial), so the same seeded
    request answers differently alone and beside another one."""
    p, q = rand_tokens(10, 1), rand_tokens(12, 2)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, greedy=False, temperature=0.05,
                        seed=5)

    def repeat_last(tokens, k):  # always a full draft (almost always rejected)
        return [tokens[-1]] * k

    def answers(prompts, speculative):
        eng = make(model, speculative, step_tokens=2)
        ids, run = online(eng, prompts, sp, return_logits=False)
        return [run.results[rid].output_ids for rid in ids]

    # Without speculation: q's answer does not depend on p running beside it.
    assert answers([q], None)[0] == answers([p, q], None)[1]
    alone = answers([q], spec(repeat_last, 3))[0]
    beside = answers([p, q], spec(repeat_last, 3))[1]
    assert alone == beside


# ---------------------------------------------------------------------- HiSparse
def test_verify_steps_read_through_the_hot_buffers(model):
    """HiSparse (sparse/hot_buffer.py): a verify chunk has more than one row, and it once
    took the prefill staging path, re-gathering the union of its selections from the host
    every step (speculation switched the buffer off). Its rows now share the buffer: with
    a buffer that holds the whole history, a speculating engine stages exactly what one
    without speculation stages (its prefill chunks) and every verify step is a lookup.
    (The live counters equal sparse.replay's LRU model only without speculation: a verify
    step's union is one lookup step of its own, and its rejected rows were never
    recorded.)"""
    P = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [rand_tokens(n, 100 + n) for n in (20, 45, 90)]
    t = truth_of(model, prompts, P)
    runs = {}
    for name, drafter in (("off", None), ("on", spec(Proposer(t, "half", right=1), 3))):
        eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048,
                                                hisparse_buffer=64, hisparse_requests=8),
                             step_tokens=512, speculative=drafter)
        results = eng.generate(prompts, P)
        runs[name] = ([r.output_ids for r in results], eng.stats())
    (off, st_off), (on, st_on) = runs["off"], runs["on"]
    assert on == off and st_on["spec"]["accepted_tokens"] > 0
    assert st_on["hisparse"]["staged"] == st_off["hisparse"]["staged"]
    assert st_on["hisparse"]["fast_path_lookups"] >= st_on["spec"]["drafts"]


# ------------------------------------------------------------------ transactions
@pytest.mark.parametrize("point", ["cache_prefix", "shrink"])
def test_an_interrupt_booking_a_verify_step_across_a_page_end_stays_an_interrupt(model,
                                                                                   point):
    """DESIGN.md §4: an interrupt during a step propagates with every request pending and
    exact on retry. In Engine._advance a verify step sets req.computed to the accepted
    position (past len(req.ids) before the tokens are taken) before cache_prefix; an
    interrupt there (or in shrink, after the tokens were taken) goes to _interrupted,
    which cuts req.ids back (restore_outputs) but leaves req.computed at the new value;
    requeue then hands manager.preempt pages up to a computed that the cut ids no longer
    cover, and the tree refuses them: the caller gets 'ValueError: pages must be ...'
    instead of its interrupt."""
    p = rand_tokens(13, 3)  # decoding from 13: an oracle draft of 3 is kept across 16
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    t = truth_of(model, [p], params)
    want = t.of(p)[1][len(p):]
    eng = make(model, spec(Proposer(t, "oracle"), 3))
    rid = eng.add_request(p, params, return_logits=True)
    original = getattr(CacheManager, point)
    armed = [True]

    def faulty(self, lease, *args, **kwargs):
        req = eng._requests.get(rid)
        # the verify step whose kept run crosses 16 (nothing of it reported yet)
        if armed[0] and req is not None and req.computed >= 16 \
                and len(p) + req.reported <= 16:
            armed[0] = False
            raise Interrupt
        return original(self, lease, *args, **kwargs)

    run = Run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CacheManager, point, faulty)
        raised = None
        for _ in range(40):
            try:
                collect(eng, run, eng.step())
            except BaseException as e:
                raised = e
                break
    assert not armed[0], "the fault never fired"
    assert isinstance(raised, Interrupt), repr(raised)
    eng.check_integrity()
    drain(eng, run)
    r = run.results[rid]
    assert r.output_ids == want
    ref = reference_logits(model, p + want)[len(p) - 1:-1]
    assert (ref - r.logits).abs().max().item() <= TOL


# ------------------------------------------------------------------- scheduling
def test_drafts_in_a_small_window_pool_never_preempt_a_plain_decode(model):
    """scheduler.py: 'pages for drafts never preempt anyone'. With window_tokens=64 (4
    sliding-window pages) two requests decode without a preemption; with speculation
    Scheduler.plan grows the first request's drafts across its page end (taking the last
    window page) before the second request's own token has its page, so the second one
    cannot grow and is preempted: the draft preempted a plain decode."""
    P = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [rand_tokens(n, 900 + n) for n in (13, 30)]
    plain_eng = make(model, None, window_tokens=64)
    ids, run = online(plain_eng, prompts, P)
    assert plain_eng.stats()["preemptions"] == 0
    t = Truth()
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, run.results[rid].output_ids)
    eng = make(model, spec(Proposer(t, "oracle"), 3), window_tokens=64)
    ids, run = online(eng, prompts, P)
    for p, rid in zip(prompts, ids, strict=True):
        assert run.results[rid].output_ids == t.of(p)[1][len(p):]
    assert eng.stats()["spec"]["accepted_tokens"] > 0
    assert eng.stats()["preemptions"] == 0, "a draft's window page preempted a plain decode"


# --------------------------------------------------------------------------- MTP
@pytest.mark.parametrize("same_next", [True, False])
def test_mtp_drafts_after_a_prefix_hit(model, monkeypatch, same_next):
    """787984f: the MTP block's KV lives in the swa pool so a prefix hit serves the
    drafter. The block's KV at position i is made from the trunk's hidden h_i AND the
    next token t_{i+1}, so the entry at a hit's last position was made with the next token
    of the request that cached it. When B's next token is the same, B's drafts equal a
    fresh engine's; when it differs they may differ slightly (the README says so), and
    B's answer never does."""
    from shadowradix import SpecConfig
    from shadowradix.model.mtp import random_mtp
    from shadowradix.model.mtp_runner import MTPRunner

    block = random_mtp(model.config, 0)
    P = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a = rand_tokens(40, 1)
    b = a[:33] + rand_tokens(2, 2) if same_next else a[:32] + rand_tokens(2, 2)
    assert (b[32] == a[32]) == same_next
    seen: list[torch.Tensor] = []
    forward = MTPRunner.forward

    def spy(self, segments, store):
        logits, out = forward(self, segments, store)
        seen.append(logits[0][-1].clone())
        return logits, out

    monkeypatch.setattr(MTPRunner, "forward", spy)

    def engine():
        return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048),
                              speculative=SpecConfig("mtp", 3), mtp=block)

    want = engine().generate([b], P)[0].output_ids
    fresh = seen[0]  # B's catch-up after its prefill: the first draft's logits
    shared = engine()
    shared.generate([a], P)
    seen.clear()
    r = shared.generate([b], P)
    assert r[0].cached_tokens == 32
    assert r[0].output_ids == want
    if same_next:
        diff = (seen[0] - fresh).abs().max().item()
        assert diff <= 1e-4, f"the drafter read a stale entry at the hit: {diff}"
