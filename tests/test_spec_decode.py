"""Speculative decoding, greedy (DESIGN.md §4: drafts are tentative, verified, then kept or
rolled back in every pool): whatever the drafter proposes (prompt lookup, an oracle that is
always right, one that is always wrong, one right for a while) the tokens are those of
plain greedy decoding and every emitted token's logits equal transformers' uncached
forward; accepted and rejected runs cross page ends, C4 and HCA window ends and checkpoint
positions; cache hits from every tier, HiSparse, preemption and aborts stay exact; a draft
never runs past max_new_tokens, a stop inside an accepted run cuts there, and a bad
proposer fails its own request alone. Pages are poisoned when handed out and
`check_integrity` runs after every step."""

from __future__ import annotations

import pytest
import torch
from conftest import LOGIT_DIFFS
from spec_util import (
    Proposer,
    Run,
    Truth,
    all_pool_names,
    collect,
    drain,
    make,
    online,
    rand_tokens,
    spec,
)
from tiny_model import reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig

TOL = 1e-4
NEW = 20
P = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
# Mixed lengths: prompts end before, on and after page (16), C4 (4) and HCA (16) ends.
PROMPTS = [rand_tokens(n, 500 + n) for n in (5, 14, 31, 46)]
KS = [1, 3, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def truth(model) -> Truth:
    """Plain greedy decoding of PROMPTS (no speculation), checked against transformers."""
    t = Truth()
    ids, run = online(make(model), PROMPTS, P)
    for p, rid in zip(PROMPTS, ids, strict=True):
        r = run.results[rid]
        exact(model, p, r)
        t.add(p, r.output_ids)
    return t


def exact(model, prompt: list[int], r, n: int | None = None) -> None:
    """The logits that chose each output equal HF's uncached forward, and each output is
    their argmax (greedy)."""
    out = r.output_ids
    assert r.logits is not None and r.logits.shape[0] == len(out), (
        f"{len(out)} outputs, {None if r.logits is None else r.logits.shape[0]} logit rows")
    if n is not None:
        assert len(out) == n
    ref = reference_logits(model, prompt + out)[len(prompt) - 1:len(prompt) - 1 + len(out)]
    diff = (ref - r.logits).abs().max().item()
    LOGIT_DIFFS.append(diff)
    assert diff <= TOL, diff
    assert out == ref.argmax(-1).tolist()
    assert sum(r.cached_by_tier.values()) == r.cached_tokens


def plain(truth: Truth, prompt: list[int], n: int = NEW) -> list[int]:
    found = truth.of(prompt)
    assert found is not None
    return found[1][len(prompt):len(prompt) + n]


def streamed_runs(eng: Engine, prompts, params) -> tuple[list[str], Run, dict]:
    """Drive online; per request, the (start, tokens) of every output chunk (a chunk of n
    tokens kept KV for positions [start, start + n))."""
    ids = [eng.add_request(p, params, return_logits=True) for p in prompts]
    length = {rid: len(p) for rid, p in zip(ids, prompts, strict=True)}
    chunks: dict[str, list[tuple[int, int]]] = {rid: [] for rid in ids}
    run = Run()
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            if o.new_token_ids:
                chunks[o.request_id].append((length[o.request_id] - 1, len(o.new_token_ids)))
                length[o.request_id] += len(o.new_token_ids)
        collect(eng, run, outs)
    return ids, run, chunks


def crosses(chunks: dict, every: int) -> int:
    """Output chunks of more than one token whose kept positions cross a multiple of
    `every` (a page end, a compression window's end, a checkpoint position)."""
    n = 0
    for runs in chunks.values():
        for start, k in runs:
            if k > 1 and (start + k - 1) // every > start // every:
                n += 1
    return n


def check_spec_counts(eng: Engine, prop: Proposer | None, k: int, kind: str) -> dict:
    s = eng.stats()["spec"]
    assert s["num_draft_tokens"] == k and len(s["accepted_per_position"]) == k
    assert s["accepted_tokens"] == sum(s["accepted_per_position"])
    assert s["accepted_tokens"] <= s["draft_tokens"]
    if s["drafts"]:
        assert s["mean_accepted_length"] == pytest.approx(
            (s["accepted_tokens"] + s["drafts"]) / s["drafts"])
    if kind == "oracle":
        assert s["drafts"] > 0 and s["accepted_tokens"] == s["draft_tokens"]
    elif kind == "wrong":
        assert s["drafts"] > 0 and s["accepted_tokens"] == 0
    elif kind == "half":
        right = prop.right  # type: ignore[union-attr]
        assert s["drafts"] > 0 and s["accepted_tokens"] < s["draft_tokens"]
        assert all(a == 0 for a in s["accepted_per_position"][right:])
        if right:
            assert s["accepted_per_position"][0] == s["drafts"]
    return s


def proposer_for(kind: str, truth: Truth, k: int) -> Proposer | None:
    return None if kind == "ngram" else Proposer(truth, kind, right=k // 2)


# ------------------------------------------------ greedy: every drafter, K = 1, 3, 7
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["ngram", "oracle", "wrong", "half"])
def test_greedy_with_any_drafter_equals_plain_greedy_and_transformers(model, truth, kind, k):
    prop = proposer_for(kind, truth, k)
    eng = make(model, spec(prop, k))
    ids, run, chunks = streamed_runs(eng, PROMPTS, P)
    for p, rid in zip(PROMPTS, ids, strict=True):
        r = run.results[rid]
        assert r.output_ids == plain(truth, p)
        exact(model, p, r, NEW)
    check_spec_counts(eng, prop, k, kind)
    if kind == "oracle" and k > 1:  # accepted runs crossed every kind of end
        assert crosses(chunks, 4) > 0 and crosses(chunks, 16) > 0
    if prop is not None:  # never asked for more than K, nor past max_new_tokens
        for seq, n, asked in prop.calls:
            assert seq is not None
            outputs = n - len(PROMPTS[seq])
            assert 1 <= asked <= min(k, NEW - outputs - 1), (n, asked)
    eng.close()


@pytest.mark.parametrize("kind", ["oracle", "wrong", "half"])
def test_hca_windows_ending_inside_a_page(kind):
    """HCA ratio 8 with 16-token pages: HCA windows end mid-page, so runs (accepted or
    rolled back) end and start inside an unfinished HCA window, and the compress state
    the journal rewinds is mid-window."""
    mdl = tiny_model(hca_ratio=8, seed=3)
    prompts = [rand_tokens(n, 600 + n) for n in (6, 21, 37)]
    t = Truth()
    ids, run = online(make(mdl), prompts, P)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, run.results[rid].output_ids)
    prop = Proposer(t, kind, right=3)
    eng = make(mdl, spec(prop, 7))
    ids, run, chunks = streamed_runs(eng, prompts, P)
    for p, rid in zip(prompts, ids, strict=True):
        assert run.results[rid].output_ids == plain(t, p)
        exact(mdl, p, run.results[rid], NEW)
    check_spec_counts(eng, prop, 7, kind)
    if kind != "wrong":
        assert crosses(chunks, 8) > 0


@pytest.mark.parametrize("step_tokens", [1, 9])
def test_drafts_cut_by_a_small_step_budget_stay_exact(model, truth, step_tokens):
    """Drafts count in the step budget: with a budget of 1 there is no room for any."""
    prop = Proposer(truth, "oracle")
    eng = make(model, spec(prop, 7), step_tokens=step_tokens)
    ids, run = online(eng, PROMPTS, P)
    for p, rid in zip(PROMPTS, ids, strict=True):
        assert run.results[rid].output_ids == plain(truth, p)
        exact(model, p, run.results[rid], NEW)
    s = eng.stats()["spec"]
    if step_tokens == 1:
        assert s["drafts"] == 0
    else:
        assert 0 < s["draft_tokens"] <= s["drafts"] * (step_tokens - 1)
        assert s["accepted_tokens"] == s["draft_tokens"]


def test_drafts_never_starve_another_decoding_request_of_its_token(model):
    """scheduler.py: each step 'gives every decoding request its one token (and its draft
    tokens ... as far as the budget ... allow)'. Two requests decode with a budget of 4:
    without speculation both get a token every step; a draft of the first must not take
    the second's token."""
    prompts = [rand_tokens(2, 700), rand_tokens(2, 701)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    t = Truth()
    ids, run = online(make(model), prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, run.results[rid].output_ids)
    eng = make(model, spec(Proposer(t, "oracle"), 7), step_tokens=4)
    ids = [eng.add_request(p, params) for p in prompts]
    starved = []
    step = 0
    while eng.has_unfinished():
        decoding = {r.id for r in eng.scheduler.running if r.decoding and not r.done}
        got = {o.request_id for o in eng.step() if o.new_token_ids}
        eng.check_integrity()
        step += 1
        starved += [(step, rid) for rid in decoding - got]
    assert not starved, f"(step, request) that decoded nothing: {starved}"


# ------------------------------------------------------------- cache hits, every tier
@pytest.mark.parametrize("kind", ["half", "wrong"])
def test_device_hit_second_turn(model, kind):
    first = rand_tokens(45, 800)
    t = Truth()
    r1 = online(make(model), [first], P)[1]
    out1 = next(iter(r1.results.values())).output_ids
    t.add(first, out1)
    turn2 = first + out1 + rand_tokens(7, 801)
    r2 = online(make(model), [turn2], P)[1]
    t.add(turn2, next(iter(r2.results.values())).output_ids)
    eng = make(model, spec(proposer_for(kind, t, 3), 3))
    for prompt, cached in ((first, 0), (turn2, 64)):
        ids, run = online(eng, [prompt], P)
        r = run.results[ids[0]]
        assert r.cached_by_tier == {"device": cached, "host": 0, "storage": 0}
        assert r.output_ids == plain(t, prompt)
        exact(model, prompt, r, NEW)
    # A second request sharing a running request's prefix, while it decodes with drafts.
    ids = [eng.add_request(first + rand_tokens(30, 802), P, return_logits=True)]
    run = Run()
    for _ in range(3):
        collect(eng, run, eng.step())
    branch = first[:32] + rand_tokens(9, 803)
    ids.append(eng.add_request(branch, P, return_logits=True))
    drain(eng, run)
    assert run.results[ids[1]].cached_by_tier["device"] == 32
    for rid, prompt in zip(ids, [first + rand_tokens(30, 802), branch], strict=True):
        exact(model, prompt, run.results[rid], NEW)
    eng.close()


@pytest.mark.parametrize("kind", ["wrong", "half"])
def test_host_hit_after_a_device_flush(model, kind):
    """The host tier only ever sees accepted tokens: what a speculating turn (drafts
    rolled back at every step with "wrong") backed up serves the next turn exactly after
    the device is flushed, while that turn speculates too."""
    first = rand_tokens(60, 810)
    t = Truth()
    out1 = next(iter(online(make(model), [first], P)[1].results.values())).output_ids
    t.add(first, out1)
    turn2 = first + out1 + rand_tokens(5, 811)
    t.add(turn2, next(iter(online(make(model), [turn2], P)[1].results.values())).output_ids)
    eng = make(model, spec(proposer_for(kind, t, 7), 7), host_tokens=4096)
    assert online(eng, [first], P)[1].results
    eng.cache.flush(tiers=("device",))
    assert eng.stats()["pools"]["swa"]["pages"] == 0
    ids, run = online(eng, [turn2], P)
    r = run.results[ids[0]]
    assert r.cached_by_tier == {"device": 0, "host": 64, "storage": 0}
    assert r.output_ids == plain(t, turn2)
    exact(model, turn2, r, NEW)
    eng.close()


@pytest.mark.parametrize("writer_spec,reader_spec", [(True, True), (True, False),
                                                     (False, True)])
def test_storage_hit_in_a_fresh_engine(model, tmp_path, writer_spec, reader_spec):
    """L3 only ever sees accepted tokens: what a speculating engine wrote through serves a
    plain one exactly, and the other way round."""
    url = f"file://{tmp_path / 'l3'}"
    first = rand_tokens(75, 820)
    t = Truth()
    out1 = next(iter(online(make(model), [first], P)[1].results.values())).output_ids
    t.add(first, out1)
    turn2 = first + out1 + rand_tokens(9, 821)
    t.add(turn2, next(iter(online(make(model), [turn2], P)[1].results.values())).output_ids)
    w = make(model, spec(Proposer(t, "wrong"), 7) if writer_spec else None, storage=url)
    online(w, [first], P)
    w.close()
    r_eng = make(model, spec(Proposer(t, "half", right=3), 7) if reader_spec else None,
                 storage=url)
    ids, run = online(r_eng, [turn2], P)
    r = run.results[ids[0]]
    assert r.cached_by_tier == {"device": 0, "host": 0, "storage": 80}
    assert r.output_ids == plain(t, turn2)
    exact(model, turn2, r, NEW)
    assert r_eng.stats()["storage_errors"] == 0
    r_eng.close()


# ------------------------------------------------------------------------ HiSparse
@pytest.mark.parametrize("kind,k", [("oracle", 7), ("wrong", 7), ("ngram", 3)])
def test_hisparse_verify_chunks_are_exact(model, kind, k):
    """Buffer = index_topk + 1: multi-row verify chunks read C4 through the staging path,
    single-row decodes (a draft cut to nothing) through the buffers; rolled-back drafts
    that completed a C4 window must not leave their entry in a buffer."""
    prompts = [rand_tokens(n, 900 + n) for n in (3, 40, 77, 130)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    t = Truth()
    off = make(model)
    ids, base = online(off, prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, base.results[rid].output_ids)
    prop = proposer_for(kind, t, k)
    eng = make(model, spec(prop, k), hisparse_buffer=5, hisparse_requests=8, step_tokens=29)
    ids, run = online(eng, prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        assert run.results[rid].output_ids == plain(t, p, 24)
        exact(model, p, run.results[rid], 24)
    check_spec_counts(eng, prop, k, kind)
    assert eng.stats()["hisparse"].get("in_use", 0) == 0
    eng.close()


def test_hisparse_mixed_single_row_and_verify_steps(model):
    """A proposer that drafts only every other step: the same request alternates between
    the hot-buffer path and the staging path, with rolled-back drafts in between."""
    prompts = [rand_tokens(n, 950 + n) for n in (60, 101)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    t = Truth()
    ids, base = online(make(model), prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, base.results[rid].output_ids)
    inner = Proposer(t, "wrong")

    def every_other(tokens, k):
        return inner(tokens, k) if len(tokens) % 2 else []

    eng = make(model, spec(every_other, 5), hisparse_buffer=5, hisparse_requests=8)
    ids, run = online(eng, prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        exact(model, p, run.results[rid], 30)
    hs = eng.stats()["hisparse"]
    assert hs["hits"] + hs["misses"] > 0  # single-row decodes went through the buffers
    eng.close()


@pytest.mark.parametrize("kind,k", [("oracle", 7), ("wrong", 7)])
def test_window_and_state_pools_much_smaller_than_the_sequence(kind, k):
    """A 32-token window in a 10-page sliding-window pool and a 4-entry state pool, for
    170- and 220-token sequences: the pages a request leaves behind are handed over or
    freed while drafts grow and shrink its own at the front."""
    mdl = tiny_model(window=32)
    prompts = [rand_tokens(100, 1400), rand_tokens(70, 1401)]
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    pools = {"window_tokens": 160, "state_tokens": 64}
    t = Truth()
    ids, base = online(make(mdl, **pools), prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, base.results[rid].output_ids)
    prop = Proposer(t, kind, right=2)
    eng = make(mdl, spec(prop, k), **pools)
    assert eng._prefix.pools["swa"].num_pages == 10 and eng._prefix.pools["state"].num_pages == 4
    ids, run = online(eng, prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        assert run.results[rid].output_ids == plain(t, p, 120)
        exact(mdl, p, run.results[rid], 120)
    check_spec_counts(eng, prop, k, kind)


# ------------------------------------------------------- preemption and aborts
@pytest.mark.parametrize("kind,k", [("wrong", 7), ("half", 3)])
def test_preemption_with_drafts_stays_exact(model, kind, k):
    prompts = [rand_tokens(n, 1000 + n) for n in (40, 52, 33, 61, 47)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    t = Truth()
    ids, base = online(make(model), prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, base.results[rid].output_ids)
    prop = proposer_for(kind, t, k)
    eng = make(model, spec(prop, k), device_tokens=64, step_tokens=40)
    ids, run = online(eng, prompts, params)
    assert eng.stats()["preemptions"] > 0
    for p, rid in zip(prompts, ids, strict=True):
        assert run.results[rid].output_ids == plain(t, p, 30)
        exact(model, p, run.results[rid], 30)
    check_spec_counts(eng, prop, k, kind)
    eng.cache.flush(tiers=("device",))
    for name, pool in eng._prefix.pools.items():
        assert pool.free_pages == pool.num_pages, name
    eng.close()


def test_drafts_never_preempt_a_request_plain_decoding_would_not(model):
    """scheduler.py: 'pages for drafts never preempt anyone'. A (oldest) and B decode in
    a 4-page pool; plain decoding needs at most 4 pages at once (B finishes before A
    needs its second page), so nothing is preempted. With speculation A's (rejected)
    drafts want A's second page early; B's own next token then needs a page: the draft
    must give way (its pages are grown after every request's own token), not B."""
    a, b = rand_tokens(14, 1100), rand_tokens(31, 1101)
    pa = SamplingParams(max_new_tokens=10, ignore_eos=True)
    pb = SamplingParams(max_new_tokens=3, ignore_eos=True)
    t = Truth()
    for p, q in ((a, pa), (b, pb)):
        t.add(p, next(iter(online(make(model), [p], q)[1].results.values())).output_ids)
    plain_eng = make(model, device_tokens=64)
    online(plain_eng, [a, b], [pa, pb])
    assert plain_eng.stats()["preemptions"] == 0

    def only_a(tokens, k):  # B never drafts; A's drafts are all wrong, so A runs as plain
        return Proposer(t, "wrong")(tokens, k) if list(tokens[:14]) == a else []

    eng = make(model, spec(only_a, 3), device_tokens=64)
    ids, run = online(eng, [a, b], [pa, pb])
    for p, rid in zip([a, b], ids, strict=True):
        assert run.results[rid].output_ids == plain(t, p, len(run.results[rid].output_ids))
    assert eng.stats()["spec"]["drafts"] > 0
    assert eng.stats()["preemptions"] == 0, "a draft's pages preempted a plain decode"


@pytest.mark.parametrize("kind", ["wrong", "half"])
def test_abort_right_after_a_verify_step(model, kind):
    prompts = [rand_tokens(n, 1200 + n) for n in (20, 35, 50)]
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    t = Truth()
    ids, base = online(make(model), prompts, params)
    for p, rid in zip(prompts, ids, strict=True):
        t.add(p, base.results[rid].output_ids)
    prop = Proposer(t, kind, right=1)
    eng = make(model, spec(prop, 3), device_tokens=640)
    ids = [eng.add_request(p, params, return_logits=True) for p in prompts]
    victim = 1
    run = Run()
    for _ in range(200):
        before = len(prop.calls)
        drafts = eng.stats()["spec"]["drafts"]
        outs = eng.step()
        collect(eng, run, outs)
        asked = [c for c in prop.calls[before:] if c[0] == victim]
        if asked and eng.stats()["spec"]["drafts"] > drafts and any(
                o.request_id == ids[victim] and o.new_token_ids for o in outs):
            break
    else:
        raise AssertionError("the victim never verified a draft")
    assert not run.finished.get(ids[victim])
    eng.abort(ids[victim])
    eng.check_integrity()
    # A new request sharing the victim's prefix and tokens it streamed.
    again = prompts[victim] + run.streams[ids[victim]][:-1]
    ids.append(eng.add_request(again, params, return_logits=True))
    t.add(again, next(iter(online(make(model), [again], params)[1].results.values())).output_ids)
    drain(eng, run)
    assert ids[victim] not in run.results and eng.stats()["aborted"] == 1
    for rid, p in zip(ids, [*prompts, again], strict=True):
        if rid == ids[victim]:
            continue
        assert run.results[rid].output_ids == plain(t, p, 25)
        exact(model, p, run.results[rid], 25)
    eng.cache.flush(tiers=("device",))
    for name, pool in eng._prefix.pools.items():
        assert pool.free_pages == pool.num_pages, name
    eng.close()


# -------------------------------------------- max_new_tokens, stops, min_tokens, eos
@pytest.mark.parametrize("new", [1, 2, 3, 5, 8])
def test_a_draft_never_makes_a_request_exceed_max_new_tokens(model, truth, new):
    prop = Proposer(truth, "oracle")
    eng = make(model, spec(prop, 7))
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    ids, run = online(eng, PROMPTS, params)
    for p, rid in zip(PROMPTS, ids, strict=True):
        assert run.results[rid].output_ids == plain(truth, p, new)
        exact(model, p, run.results[rid], new)
    for seq, n, asked in prop.calls:
        outputs = n - len(PROMPTS[seq])  # type: ignore[index]
        assert asked <= new - outputs - 1
    if new <= 1:
        assert eng.stats()["spec"]["drafts"] == 0


def _stop_params(truth: Truth, prompt: list[int], at: int, **kw) -> SamplingParams:
    stop = plain(truth, prompt)[at]
    return SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,), **kw)


@pytest.mark.parametrize("drafter", ["oracle", "half"])
@pytest.mark.parametrize("at", [1, 5])
def test_a_stop_token_inside_an_accepted_run_cuts_there(model, truth, drafter, at):
    prompt = PROMPTS[1]
    params = _stop_params(truth, prompt, at, ignore_eos=True)
    want = online(make(model), [prompt], params)[1]
    want_ids = next(iter(want.results.values())).output_ids
    first = plain(truth, prompt).index(params.stop_token_ids[0])
    assert want_ids == plain(truth, prompt)[:first + 1]
    eng = make(model, spec(proposer_for(drafter, truth, 7), 7))
    ids, run = online(eng, [prompt], params)
    r = run.results[ids[0]]
    assert r.output_ids == want_ids
    exact(model, prompt, r, len(want_ids))


@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_min_tokens_bans_a_stop_the_draft_proposes(model, truth, drafter):
    """The oracle drafts the plain run, stop token included; min_tokens bans it for the
    first outputs, so verification must reject it there and keep what the banned target
    chooses instead, exactly as without speculation."""
    prompt = PROMPTS[2]
    params = _stop_params(truth, prompt, 1, ignore_eos=True, min_tokens=5)
    want = next(iter(online(make(model), [prompt], params)[1].results.values()))
    assert want.output_ids[1] != params.stop_token_ids[0]  # the ban changed the run
    eng = make(model, spec(proposer_for(drafter, truth, 7), 7))
    ids, run = online(eng, [prompt], params)
    r = run.results[ids[0]]
    assert r.output_ids == want.output_ids
    assert torch.allclose(r.logits, want.logits, atol=1e-5)


def test_eos_inside_an_accepted_run_cuts_there(truth):
    """The model's end-of-sequence token is set to the 4th token of a plain run: an
    accepted run that contains it ends the answer there (and with ignore_eos it does
    not)."""
    mdl = tiny_model()
    prompt = PROMPTS[3]
    eos = plain(truth, prompt)[3]
    mdl.config.eos_token_id = eos
    first = plain(truth, prompt).index(eos)
    for ignore, want in ((False, plain(truth, prompt)[:first + 1]), (True, plain(truth, prompt))):
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=ignore)
        base = next(iter(online(make(mdl), [prompt], params)[1].results.values()))
        assert base.output_ids == want
        eng = make(mdl, spec(Proposer(truth, "oracle"), 7))
        ids, run = online(eng, [prompt], params)
        assert run.results[ids[0]].output_ids == want
        exact(mdl, prompt, run.results[ids[0]], len(want))


# --------------------------------------------------------------- bad proposers
def _bad(kind: str, k: int):
    return {
        "too_many": lambda: [0] * (k + 1),
        "negative": lambda: [-1],
        "out_of_vocab": lambda: [256],
        "float": lambda: [1.5],
        "bool": lambda: [True],
        "str_token": lambda: ["a"],
        "str": lambda: "ab",
        "none": lambda: None,
        "int": lambda: 3,
        "generator": lambda: (i for i in range(2)),
    }[kind]()


BAD = ["too_many", "negative", "out_of_vocab", "float", "bool", "str_token", "str", "none",
       "int", "generator", "raises"]


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_proposer_fails_its_request_alone(model, truth, bad):
    victim = PROMPTS[2]
    good = Proposer(truth, "oracle")

    def proposer(tokens, k):
        if list(tokens[:len(victim)]) == victim:
            if bad == "raises":
                raise RuntimeError("drafter crashed")
            return _bad(bad, k)
        return good(tokens, k)

    eng = make(model, spec(proposer, 3))
    ids, run = online(eng, PROMPTS, P)
    vid = ids[2]
    assert vid in run.errors and vid not in run.results and run.finished[vid] == 1
    err = run.errors[vid]
    if bad == "raises":
        assert isinstance(err, RuntimeError) and "drafter crashed" in str(err)
    else:
        assert isinstance(err, ValueError) and "proposer" in str(err), err
    for p, rid in zip(PROMPTS, ids, strict=True):
        if rid != vid:
            assert run.results[rid].output_ids == plain(truth, p)
            exact(model, p, run.results[rid], NEW)
    assert eng.stats()["failed"] == 1
    eng.cache.flush(tiers=("device",))
    for name, pool in eng._prefix.pools.items():
        assert pool.free_pages == pool.num_pages, name
    # generate() raises the failed request's error, and leaks nothing.
    with pytest.raises(RuntimeError if bad == "raises" else ValueError):
        eng.generate([victim], P)
    assert not eng.has_unfinished()
    eng.check_integrity()
    eng.close()


def test_numpy_and_tuple_drafts_of_ints_are_accepted(model, truth):
    import numpy as np

    inner = Proposer(truth, "oracle")
    eng = make(model, spec(lambda tokens, k: tuple(np.int64(t) for t in inner(tokens, k)), 3))
    ids, run = online(eng, PROMPTS, P)
    for p, rid in zip(PROMPTS, ids, strict=True):
        assert run.results[rid].output_ids == plain(truth, p)
    assert eng.stats()["spec"]["accepted_tokens"] == eng.stats()["spec"]["draft_tokens"] > 0


def test_a_proposer_that_writes_to_its_tokens_cannot_change_the_answer(model, truth):
    """drafters.py: 'a drafter can make decoding slower, never wrong'. A proposer that
    appends to (or clears) the list it is handed must not change the request's tokens."""
    def scribbler(tokens, k):
        if isinstance(tokens, list):
            tokens.append(7)
        return []

    eng = make(model, spec(scribbler, 3))
    ids, run = online(eng, PROMPTS[:2], P)
    for p, rid in zip(PROMPTS[:2], ids, strict=True):
        if rid in run.errors:  # refusing it is fine too: loudly, not silently
            continue
        assert run.results[rid].output_ids == plain(truth, p)
        exact(model, p, run.results[rid], NEW)


def test_an_interrupt_in_the_proposer_leaves_every_request_pending_and_exact(model, truth):
    class Stop(BaseException):
        pass

    good = Proposer(truth, "oracle")
    state = {"calls": 0}

    def proposer(tokens, k):
        state["calls"] += 1
        if state["calls"] == 3:
            raise Stop
        return good(tokens, k)

    eng = make(model, spec(proposer, 3))
    ids = [eng.add_request(p, P, return_logits=True) for p in PROMPTS]
    run = Run()
    interrupted = 0
    while eng.has_unfinished():
        try:
            collect(eng, run, eng.step())
        except Stop:
            interrupted += 1
            eng.check_integrity()
    assert interrupted == 1 and not run.errors
    for p, rid in zip(PROMPTS, ids, strict=True):
        assert run.results[rid].output_ids == plain(truth, p)
        exact(model, p, run.results[rid], NEW)


# --------------------------------------------------------------- configuration
@pytest.mark.parametrize("kw, match", [
    ({"method": "medusa"}, "method must be one of"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"num_draft_tokens": 65}, "num_draft_tokens"),
    ({"num_draft_tokens": 2.0}, "num_draft_tokens"),
    ({"num_draft_tokens": True}, "num_draft_tokens"),
    ({"num_draft_tokens": "3"}, "num_draft_tokens"),
    ({"ngram_min": 0}, "ngram_min"),
    ({"ngram_max": 0}, "ngram_max"),
    ({"ngram_min": 1.0}, "ngram_min"),
    ({"ngram_min": 4, "ngram_max": 2}, r"ngram_min \(4\) must be <= ngram_max \(2\)"),
    ({"method": "custom"}, "proposer"),
    ({"method": "ngram", "proposer": lambda t, k: []}, "proposer"),
    ({"method": "custom", "proposer": [1, 2]}, "proposer must be callable"),
])
def test_spec_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kw)


def test_engine_refuses_a_speculative_that_is_not_a_spec_config(model):
    for bad in ("ngram", {"method": "ngram"}, 3, True):
        with pytest.raises(ValueError, match="speculative must be a SpecConfig"):
            Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=256),
                           speculative=bad)


def test_spec_stats_are_off_without_speculation_and_the_config_is_frozen(model):
    eng = make(model)
    s = eng.stats()["spec"]
    assert s["method"] is None and s["drafts"] == 0 and s["mean_accepted_length"] is None
    cfg = SpecConfig()
    assert (cfg.method, cfg.num_draft_tokens, cfg.ngram_min, cfg.ngram_max) == (
        "ngram", 3, 1, 3)
    with pytest.raises(AttributeError):
        cfg.num_draft_tokens = 5  # type: ignore[misc]
    eng = make(model, spec(None, 4))
    s = eng.stats()["spec"]
    assert s["method"] == "ngram" and s["num_draft_tokens"] == 4
    assert s["accepted_per_position"] == [0, 0, 0, 0]


def test_ngram_drafts_on_a_repeating_prompt_are_accepted(model):
    """A prompt that repeats a period: prompt lookup proposes; whatever it accepts, the
    tokens are plain greedy's."""
    period = rand_tokens(6, 1300)
    prompt = period * 5
    base = next(iter(online(make(model), [prompt], P)[1].results.values()))
    eng = make(model, spec(None, 5))
    ids, run = online(eng, [prompt], P)
    assert run.results[ids[0]].output_ids == base.output_ids
    exact(model, prompt, run.results[ids[0]], NEW)
    assert eng.stats()["spec"]["drafts"] > 0


def test_all_pools_helper_names_the_compressed_pools(model):
    assert set(all_pool_names(make(model))) == {"c4", "c4_index", "c128"}

