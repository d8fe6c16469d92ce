"""Speculative sampling keeps the target distribution (engine/verify.py's rejection rule).

On a 16-token vocabulary every distribution is small enough to compute exactly from
transformers' uncached forward: the joint law of the first four outputs of a fixed prompt
is a product of 1 + 16 + 256 + 4,096 filtered softmaxes. Many requests with distinct seeds
sample it with a fixed draft (likely tokens, unlikely ones, a filtered-out one, a banned
stop token); a chi-square goodness-of-fit test at a fixed seed compares what they emitted
with the exact law: the marginals of outputs 2, 3 and 4 (output 1 comes from the prefill,
outputs 2.. from verify steps) and the joints of (1, 2) and (2, 3). The same tests reject a
wrong rule (always accept the draft; on a rejection draw from the whole distribution), so
they have the power to see one. Verification alone is checked the same way on many more
draws, conditioned on each draft position; seeded speculative sampling is reproducible.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import shadowradix.engine.engine as engine_module
from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.engine.sampling import distribution, sample
from shadowradix.engine.verify import verify
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4

V = 16
N = 250  # requests per engine run (a correct rule passes at ALPHA with these)
N_POWER = 500  # requests per run where a wrong rule must fail below POWER
ALPHA = 1e-4  # a correct rule passes at this level (fixed seeds: the outcome is fixed too)
POWER = 1e-8  # a wrong rule fails below it
OUT = 4


# ------------------------------------------------------------------ chi-square
def _gamma_q(a: float, x: float) -> float:
    """The regularised upper incomplete gamma function Q(a, x) (series below a + 1, a
    continued fraction above: Numerical Recipes' gammq)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(100_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(stat: float, df: int) -> float:
    return _gamma_q(df / 2, stat / 2)


def chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Goodness of fit of `observed` counts to `probs` (same shape). Cells expected fewer
    than 5 times are pooled; an outcome of probability 0 that happened gives p = 0.
    Returns (statistic, degrees of freedom, p-value)."""
    obs, p = observed.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    n = obs.sum()
    if (obs[p <= 0] > 0).any():
        return math.inf, 0, 0.0
    exp = p * n
    big = exp >= 5
    o_bins, e_bins = list(obs[big]), list(exp[big])
    rest_o, rest_e = obs[~big & (p > 0)].sum(), exp[~big & (p > 0)].sum()
    if rest_e > 0:
        if rest_e < 5 and e_bins:
            j = int(np.argmin(e_bins))
            o_bins[j] += rest_o
            e_bins[j] += rest_e
        else:
            o_bins.append(rest_o)
            e_bins.append(rest_e)
    if len(e_bins) < 2:
        return 0.0, 0, 1.0
    o, e = np.array(o_bins), np.array(e_bins)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(e_bins) - 1
    return stat, df, chi2_sf(stat, df)


def test_the_chi_square_tail_matches_known_quantiles():
    for stat, df, want in [(3.841459, 1, 0.05), (18.307038, 10, 0.05), (6.634897, 1, 0.01),
                           (30.577914, 15, 0.01), (124.342113, 100, 0.05), (0.0, 4, 1.0),
                           (37.697, 1, math.erfc(math.sqrt(37.697 / 2))),
                           (61.0, 2, math.exp(-30.5))]:
        assert chi2_sf(stat, df) == pytest.approx(want, rel=1e-3), (stat, df)


# ---------------------------------------------------------------- the exact law
def target(logits: np.ndarray, params: SamplingParams, banned=()) -> np.ndarray:
    """The distribution SamplingParams documents, written independently of the engine:
    banned tokens removed, softmax at the temperature, then top-k, top-p (keep the most
    likely tokens whose probabilities before each sum to less than top_p) and min-p, the
    most likely token always kept; renormalised (float64)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    if banned and len(banned) < z.size:
        z[list(banned)] = -np.inf
    p = np.exp((z - z.max()) / params.temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    keep = np.ones(z.size, dtype=bool)
    if params.top_k:
        keep[params.top_k:] = False
    if params.top_p < 1:
        keep &= np.cumsum(sp) - sp < params.top_p
    if params.min_p > 0:
        keep &= sp >= sp[0] * params.min_p
    keep[0] = True
    out = np.zeros_like(p)
    out[order[keep]] = sp[keep]
    return out / out.sum()


def margin(logits: np.ndarray, params: SamplingParams, banned=()) -> float:
    """How far the filters' thresholds are from any token (float32 rounding in the engine
    must not flip a filter decision)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    if banned:
        z[list(banned)] = -np.inf
    p = np.exp((z - z.max()) / params.temperature)
    p /= p.sum()
    sp = np.sort(p)[::-1]
    gaps = [math.inf]
    if params.top_p < 1:
        gaps.append(float(np.min(np.abs(np.cumsum(sp) - sp - params.top_p))))
    if params.min_p > 0:
        gaps.append(float(np.min(np.abs(sp - sp[0] * params.min_p))))
    return min(gaps)


@pytest.fixture(scope="module")
def model():
    """A tiny V4 with a 16-token vocabulary; its head scaled so the distributions are far
    from uniform (a wrong rule shows sooner)."""
    m = tiny_deepseek_v4(0, vocab_size=V, layer_types=[SWA, CSA, HCA, CSA], sliding_window=8,
                         compress_rates={CSA: 4, HCA: 16})
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    return m


PROMPT = torch.randint(0, V, (17,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def logits(model) -> list[np.ndarray]:
    """transformers' next-token logits after PROMPT + every continuation of 0..3 tokens:
    [V], [V, V], [V, V, V], [V, V, V, V]."""
    out = []
    with torch.no_grad():
        for depth in range(OUT):
            seqs = [PROMPT + list(t) for t in itertools.product(range(V), repeat=depth)]
            rows = torch.cat([model(torch.tensor(seqs[i:i + 1024])).logits[:, -1].float()
                              for i in range(0, len(seqs), 1024)])
            out.append(rows.numpy().astype(np.float64).reshape(*([V] * depth), V))
    return out


def joint(logits: list[np.ndarray], params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3, t4) [V, V, V, V] under params, min_tokens' ban included."""
    stop = set(params.stop_token_ids)

    def banned(j: int) -> set[int]:  # output j (1-based) may not end the answer yet
        return stop if j <= params.min_tokens else set()

    law = np.ones([V] * 0)
    for depth in range(OUT):
        rows = logits[depth].reshape(-1, V)
        probs = np.stack([target(r, params, banned(depth + 1)) for r in rows])
        law = (law.reshape(-1, 1) * probs).reshape(*([V] * (depth + 1)))
    return law


def run_engine(model, params: SamplingParams, speculative: SpecConfig | None, n: int = N,
               seed0: int = 0) -> np.ndarray:
    """n requests of PROMPT with seeds seed0.. (the prompt's first page cached first):
    their outputs [n, OUT]."""
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=16 * (n + 32)),
                         step_tokens=8 * n, speculative=speculative)
    eng.generate([PROMPT], SamplingParams(max_new_tokens=1))
    ps = [SamplingParams(**{**_fields(params), "seed": seed0 + i}) for i in range(n)]
    results = eng.generate([PROMPT] * n, ps)
    eng.close()
    out = np.array([r.output_ids for r in results])
    assert out.shape == (n, OUT)
    return out


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def p_values(out: np.ndarray, law: np.ndarray) -> dict[str, float]:
    """Goodness of fit of the outputs to the exact law: marginals of outputs 2..4 and the
    joints of (1, 2) and (2, 3)."""
    def counts(cols: tuple[int, ...]) -> np.ndarray:
        c = np.zeros([V] * len(cols))
        for row in out[:, cols]:
            c[tuple(row)] += 1
        return c

    axes = set(range(OUT))
    res = {}
    for name, cols in [("t2", (1,)), ("t3", (2,)), ("t4", (3,)), ("t1,t2", (0, 1)),
                       ("t2,t3", (1, 2))]:
        marg = law.sum(axis=tuple(axes - set(cols)))
        res[name] = chi_square(counts(cols), marg)[2]
    return res


def fixed(draft: list[int]) -> SpecConfig:
    return SpecConfig("custom", len(draft), proposer=lambda tokens, k: draft[:k])


def likely(law: np.ndarray) -> list[int]:
    """The most likely 2nd and 3rd outputs: drafts accepted often."""
    return [int(law.sum(axis=(0, 2, 3)).argmax()), int(law.sum(axis=(0, 1, 3)).argmax())]


def unlikely(law: np.ndarray) -> list[int]:
    pos = [law.sum(axis=(0, 2, 3)), law.sum(axis=(0, 1, 3))]
    return [int(np.where(p > 0, p, np.inf).argmin()) for p in pos]


def filtered_then_likely(law: np.ndarray) -> list[int]:
    """A 2nd output the filters leave no probability (always rejected, never emitted),
    then the most likely 3rd output (verified in the next step, as its first draft)."""
    m2 = law.sum(axis=(0, 2, 3))
    return [int(np.flatnonzero(m2 == 0)[0]), likely(law)[1]]


CONFIGS = {
    "plain": (SamplingParams(max_new_tokens=OUT, greedy=False, ignore_eos=True), likely),
    "hot-unlikely": (SamplingParams(max_new_tokens=OUT, greedy=False, temperature=1.4,
                                    ignore_eos=True), unlikely),
    "filters": (SamplingParams(max_new_tokens=OUT, greedy=False, temperature=0.8, top_k=6,
                               top_p=0.9, min_p=0.02, ignore_eos=True), likely),
    "filtered-out": (SamplingParams(max_new_tokens=OUT, greedy=False, top_k=3,
                                    ignore_eos=True), filtered_then_likely),
}


def _check_margins(logits, params):
    """No filter threshold within float32 rounding of a token's probability, in the rows
    a run reaches often enough to matter (prefix probability >= 1e-3)."""
    law = joint(logits, params)
    for depth in range(OUT):
        reach = law.sum(axis=tuple(range(depth, OUT))).reshape(-1) if depth else np.ones(1)
        for row, mass in zip(logits[depth].reshape(-1, V), reach, strict=True):
            if mass >= 1e-3:
                assert margin(row, params) > 1e-6, "a filter threshold sits on a token"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_keeps_the_target_distribution(model, logits, name):
    params, pick = CONFIGS[name]
    _check_margins(logits, params)
    law = joint(logits, params)
    draft = pick(law)
    eng_out = run_engine(model, params, fixed(draft))
    ps = p_values(eng_out, law)
    assert min(ps.values()) > ALPHA, (draft, ps)
    if pick is likely:  # drafts were accepted and rejected
        assert 0 < (eng_out[:, 1] == draft[0]).sum() < N
    if pick is filtered_then_likely:
        assert (eng_out[:, 1] != draft[0]).all()


def test_min_tokens_bans_a_drafted_stop_token_while_sampling(model, logits):
    """The draft is the stop token min_tokens bans for outputs 1..3: verification rejects
    it there (probability 0) and draws from the banned distribution; output 4 may be it."""
    base = SamplingParams(max_new_tokens=OUT, greedy=False, ignore_eos=True)
    stop = likely(joint(logits, base))[0]
    params = SamplingParams(max_new_tokens=OUT, greedy=False, ignore_eos=True,
                            stop_token_ids=(stop,), min_tokens=3)
    law = joint(logits, params)
    eng_out = run_engine(model, params, fixed([stop, stop]))
    assert (eng_out[:, :3] != stop).all()
    assert (eng_out[:, 3] == stop).any()
    ps = p_values(eng_out, law)
    assert min(ps.values()) > ALPHA, ps


def test_without_speculation_the_same_test_passes(model, logits):
    """The control: the plain engine's samples fit the same exact law."""
    params, _ = CONFIGS["plain"]
    law = joint(logits, params)
    ps = p_values(run_engine(model, params, None), law)
    assert min(ps.values()) > ALPHA, ps


# ------------------------------------------------------------ the test's power
def _always_accept(rows, draft, params, generator, banned):
    return [*draft, sample(rows[len(draft)], params, generator, banned[len(draft)])]


def _textbook(rows, draft, params, generator, banned, remove: bool, bonus_row: int):
    """The textbook rejection rule (keep x with probability p(x), else draw again),
    optionally wrong: `remove` False draws the residual from the whole distribution,
    `bonus_row` -1 draws the bonus token from the row before its own."""
    out = []
    for i, x in enumerate(draft):
        p = distribution(rows[i], params, banned[i]).cpu()
        if float(torch.rand((), generator=generator)) < float(p[x]):
            out.append(x)
            continue
        if remove:
            p[x] = 0.0
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    k = len(draft) + bonus_row
    out.append(sample(rows[k], params, generator, banned[k]))
    return out


def _no_residual(rows, draft, params, generator, banned):
    """On a rejection, draw from the whole distribution (the draft not removed)."""
    return _textbook(rows, draft, params, generator, banned, remove=False, bonus_row=0)


def _bonus_from_the_last_draft_row(rows, draft, params, generator, banned):
    """The right rule, but the bonus token (every draft kept) drawn from the row before
    its own."""
    return _textbook(rows, draft, params, generator, banned, remove=True, bonus_row=-1)


@pytest.mark.parametrize("rule", [_always_accept, _no_residual], ids=lambda f: f.__name__)
def test_a_wrong_acceptance_rule_fails_the_engine_level_test(model, logits, monkeypatch, rule):
    params, pick = CONFIGS["plain"]
    law = joint(logits, params)
    monkeypatch.setattr(engine_module, "verify", rule)
    ps = p_values(run_engine(model, params, fixed(pick(law)), n=N_POWER), law)
    assert min(ps.values()) < POWER, ps


# --------------------------------------------------- verification alone, many draws
DRAWS = 12_000


def verify_draws(rule, rows: torch.Tensor, draft: list[int], params: SamplingParams,
                 banned: list[set[int]]) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [rule(rows, draft, params, g, banned) for _ in range(DRAWS)]


def conditional_p_values(draws: list[list[int]], rows: np.ndarray, draft: list[int],
                         params: SamplingParams, banned: list[set[int]]) -> dict[str, float]:
    """Emitted token i, given the drafts before it were kept, fits target(row i)."""
    res = {}
    for i in range(len(draft) + 1):
        given = [d for d in draws if len(d) > i and d[:i] == draft[:i]]
        c = np.zeros(V)
        for d in given:
            c[d[i]] += 1
        res[f"position {i + 1} ({len(given)} draws)"] = chi_square(
            c, target(rows[i], params, banned[i]))[2]
    return res


VERIFY_CASES = {
    "plain": SamplingParams(greedy=False),
    "cold-filters": SamplingParams(greedy=False, temperature=0.6, top_k=5, top_p=0.95,
                                   min_p=0.01),
    "hot": SamplingParams(greedy=False, temperature=2.0),
}


def _path_rows(logits, draft):
    """The target's rows along the draft: after the prompt + first output, then after
    each draft token (the rows a verify step reads)."""
    t1 = int(np.argmax(logits[0]))
    return np.stack([logits[1][t1], logits[2][t1, draft[0]], logits[3][t1, draft[0], draft[1]]])


@pytest.mark.parametrize("name", list(VERIFY_CASES))
def test_verify_keeps_each_positions_distribution(logits, name):
    params = VERIFY_CASES[name]
    t1 = int(np.argmax(logits[0]))
    draft = [int(np.argmax(logits[1][t1]))]
    draft.append(int(np.argsort(logits[2][t1, draft[0]])[-2]))  # its 2nd most likely
    rows = _path_rows(logits, draft)
    banned = [set(), set(), set()]
    draws = verify_draws(verify, torch.from_numpy(rows).float(), draft, params, banned)
    ps = conditional_p_values(draws, rows, draft, params, banned)
    assert min(ps.values()) > ALPHA, ps


def test_verify_with_a_banned_draft_position(logits):
    """min_tokens bans the stop token at row 0 and 1 only: a drafted stop is rejected
    there; at row 2 it may be kept."""
    params = SamplingParams(greedy=False)
    t1 = int(np.argmax(logits[0]))
    stop = int(np.argmax(logits[1][t1]))
    draft = [stop, stop]
    rows = _path_rows(logits, draft)
    banned = [{stop}, {stop}, set()]
    draws = verify_draws(verify, torch.from_numpy(rows).float(), draft, params, banned)
    assert all(d[0] != stop for d in draws) and all(len(d) == 1 for d in draws)
    ps = conditional_p_values(draws, rows, draft, params, banned)
    assert ps[next(iter(ps))] > ALPHA, ps


@pytest.mark.parametrize("rule", [_always_accept, _no_residual, _bonus_from_the_last_draft_row],
                         ids=lambda f: f.__name__)
def test_a_wrong_rule_fails_the_verify_level_test(logits, rule):
    params = VERIFY_CASES["plain"]
    t1 = int(np.argmax(logits[0]))
    draft = [int(np.argmax(logits[1][t1]))]
    draft.append(int(np.argmax(logits[2][t1, draft[0]])))
    rows = _path_rows(logits, draft)
    banned = [set(), set(), set()]
    draws = verify_draws(rule, torch.from_numpy(rows).float(), draft, params, banned)
    ps = conditional_p_values(draws, rows, draft, params, banned)
    assert min(ps.values()) < POWER, ps


# --------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("speculative", ["ngram", "custom"])
def test_seeded_speculative_sampling_is_reproducible(model, logits, speculative):
    params = SamplingParams(max_new_tokens=8, greedy=False, temperature=0.9, top_p=0.95,
                            ignore_eos=True)
    if speculative == "ngram":
        sc = SpecConfig("ngram", 3, ngram_min=1, ngram_max=2)
    else:
        sc = fixed(likely(joint(logits, CONFIGS["plain"][0])) + [3])
    runs = [run_engine_many(model, params, sc) for _ in range(2)]
    assert runs[0] == runs[1]
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096),
                         speculative=sc)
    ps = [SamplingParams(**{**_fields(params), "seed": 100 + i}) for i in range(20)]
    a = [r.output_ids for r in eng.generate([PROMPT] * 20, ps)]
    b = [r.output_ids for r in eng.generate([PROMPT] * 20, ps)]  # now with cache hits
    assert a == b


def run_engine_many(model, params: SamplingParams, sc: SpecConfig) -> list[list[int]]:
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096),
                         speculative=sc)
    ps = [SamplingParams(**{**_fields(params), "seed": 100 + i}) for i in range(20)]
    out = [r.output_ids for r in eng.generate([PROMPT] * 20, ps)]
    assert eng.stats()["spec"]["drafts"] > 0
    return out


def test_sampled_tokens_logits_equal_transformers(model):
    """With rejections at every step, the logits that chose each sampled token are the
    target's, after every rollback."""
    from tiny_model import reference_logits

    params = SamplingParams(max_new_tokens=12, greedy=False, temperature=1.2,
                            ignore_eos=True)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096),
                         speculative=fixed([0, 1, 2, 3]))
    ps = [SamplingParams(**{**_fields(params), "seed": i}) for i in range(6)]
    for r in eng.generate([PROMPT] * 6, ps, return_logits=True):
        ref = reference_logits(model, PROMPT + r.output_ids)[len(PROMPT) - 1:-1]
        assert (ref - r.logits).abs().max().item() <= 1e-4
    assert eng.stats()["spec"]["drafts"] > 0
