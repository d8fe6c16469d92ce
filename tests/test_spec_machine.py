"""Speculative decoding in lockstep with plain decoding, under random traffic.

Two engines on the same tiny model get the same requests (shared prefixes, repeating
prompts prompt lookup can draft from, stop tokens and min_tokens), steps, aborts and
device flushes: one decodes plainly, the other speculates with a drafter hypothesis draws
(prompt lookup, or a custom proposer that is always right, always wrong, right for a
while, or random). Pages are poisoned when handed out and the pools are small, so requests
preempt each other. Greedy decoding is deterministic, so the two must agree on every
request's tokens (compared per request at its finish: the step counts differ) and on its
logits; `check_integrity` runs after every step on both; what the speculating engine's
tree holds (every tier) is always a prefix of accepted tokens; and where no flush, abort
or eviction can make the contents depend on timing, both trees hold exactly the same
pages at the end."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import STEPS
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from spec_util import VOCAB, Truth, tree_contents
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.tree.tier import DEVICE, HOST

MODEL = tiny_model()
TOL = 1e-4
SCALE = float(os.environ.get("SHADOWRADIX_HYPOTHESIS_SCALE", "1"))
PREEMPTIONS: dict[str, list[int]] = {}  # machine -> preemptions of the speculating engine, per run


def steps(runs: int, count: int = 25) -> settings:
    return settings(max_examples=max(1, int(runs * SCALE)), stateful_step_count=count,
                    deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


# The true greedy continuation of a prompt (ignoring stops), from a roomy plain engine:
# what the oracle-like proposers draft from.
_TRUTH_ENGINE = Engine(MODEL, CacheConfig(page_size=16, device_tokens=8192))
_TRUTH: dict[tuple[int, ...], list[int]] = {}
TRUTH_NEW = 12


def true_continuation(prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _TRUTH:
        _TRUTH[key] = _TRUTH_ENGINE.generate(
            [prompt], SamplingParams(max_new_tokens=TRUTH_NEW, ignore_eos=True))[0].output_ids
    return _TRUTH[key]


class Drafter:
    """A custom proposer over the machine's Truth: oracle, wrong, half (right for `right`
    tokens), or random (a random number of right tokens, then random ones, of random
    length, from a seeded generator)."""

    def __init__(self, truth: Truth, kind: str, seed: int) -> None:
        self.truth, self.kind = truth, kind
        self.rng = random.Random(seed)

    def __call__(self, tokens, k):  # type: ignore[no-untyped-def]
        found = self.truth.of(tokens)
        true = [] if found is None else found[1][len(tokens):len(tokens) + k]
        if self.kind == "oracle":
            return true
        if self.kind == "wrong":
            return [(t + 1) % VOCAB for t in true]
        if self.kind == "half":
            return [t if i < 1 else (t + 1) % VOCAB for i, t in enumerate(true)]
        right = self.rng.randint(0, len(true))
        size = self.rng.randint(right, k)
        return true[:right] + [self.rng.randrange(VOCAB) for _ in range(size - right)]


@dataclass
class Pair:
    prompt: list[int]
    params: SamplingParams
    ids: tuple[str, str]  # (plain, spec)
    streams: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    results: list = field(default_factory=lambda: [None, None])
    finished: list[int] = field(default_factory=lambda: [0, 0])
    errors: list = field(default_factory=lambda: [None, None])
    aborted: bool = False


class LockstepMachine(RuleBasedStateMachine):
    config: ClassVar[dict] = {"device_tokens": 128}
    step_tokens = 40
    aborts = True
    flushes = True
    same_tree = False  # the trees must be equal at the end (no churn can tell them apart)

    def __init__(self) -> None:
        super().__init__()
        self.tmp = None
        self.engines: list[Engine] = []
        self.truth = Truth()
        self.pairs: list[Pair] = []
        self.by_id: list[dict[str, Pair]] = [{}, {}]
        self.sequences: list[list[int]] = []
        self.steps = -1
        self.spec_config: SpecConfig | None = None

    def _engine(self, speculative: SpecConfig | None) -> Engine:
        cfg = dict(self.config)
        if cfg.pop("storage", False):
            cfg["storage"] = f"file://{self.tmp.name}/{len(self.engines)}"  # type: ignore[union-attr]
        return Engine(MODEL, CacheConfig(page_size=16, debug_poison=True, **cfg),
                      step_tokens=self.step_tokens, speculative=speculative)

    @initialize(kind=st.sampled_from(["ngram", "oracle", "wrong", "half", "random"]),
                k=st.sampled_from([1, 2, 3, 5, 7]), seed=st.integers(0, 2**31),
                ngram=st.sampled_from([(1, 3), (2, 2), (1, 1)]), data=st.data())
    def start(self, kind: str, k: int, seed: int, ngram: tuple[int, int],
              data: st.DataObject | None = None) -> None:
        if self.config.get("storage"):
            import tempfile

            self.tmp = tempfile.TemporaryDirectory()
        if kind == "ngram":
            sc = SpecConfig("ngram", k, ngram_min=ngram[0], ngram_max=ngram[1])
        else:
            sc = SpecConfig("custom", k, proposer=Drafter(self.truth, kind, seed))
        self.spec_config = sc
        self.engines = [self._engine(None), self._engine(sc)]
        if data is not None:  # every run starts with traffic
            self.add(data, 2)

    # ------------------------------------------------------------ traffic
    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            self._add(data, data.draw(st.integers(1, 60), label="n"),
                      data.draw(st.integers(1, TRUTH_NEW), label="new"),
                      data.draw(st.sampled_from(["fresh", "shared", "shared", "repeat"]),
                                label="how"),
                      data.draw(st.booleans(), label="stop"),
                      data.draw(st.integers(0, 4), label="min_tokens"))

    def _add(self, data: st.DataObject, n: int, new: int, how: str, stop: bool,
             min_tokens: int) -> None:
        if how == "repeat":  # a period prompt lookup can draft from
            period = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
            prompt = (period * (n // len(period) + 1))[:max(n, len(period) + 1)]
        else:
            prefix: list[int] = []
            if how == "shared" and self.sequences:
                base = data.draw(st.sampled_from(self.sequences))
                prefix = base[:data.draw(st.integers(0, len(base)))]
            prompt = prefix + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                 max_size=n))
        prompt = prompt[:90]
        cont = true_continuation(prompt)
        self.truth.add(prompt, cont)
        stops = ()
        if stop:  # a token the plain run emits: the answer may end inside a run
            stops = (cont[data.draw(st.integers(0, len(cont) - 1))],)
        params = SamplingParams(max_new_tokens=new, ignore_eos=True, stop_token_ids=stops,
                                min_tokens=min(min_tokens, new))
        ids = tuple(e.add_request(prompt, params, return_logits=True) for e in self.engines)
        pair = Pair(prompt, params, ids)  # type: ignore[arg-type]
        self.pairs.append(pair)
        for side in (0, 1):
            self.by_id[side][ids[side]] = pair
        self.sequences.append(prompt)

    def _collect(self, side: int, outputs) -> None:  # type: ignore[no-untyped-def]
        for out in outputs:
            pair = self.by_id[side][out.request_id]
            assert not pair.finished[side], f"{out.request_id} reported after it finished"
            pair.streams[side].extend(out.new_token_ids)
            if out.finished:
                pair.finished[side] += 1
                pair.results[side], pair.errors[side] = out.result, out.error
                if out.error is None:
                    assert out.result.output_ids == pair.streams[side]
                    self.sequences.append(pair.prompt + pair.streams[side])

    def _step(self, side: int) -> None:
        eng = self.engines[side]
        if eng.has_unfinished():
            self._collect(side, eng.step())
            eng.check_integrity()
            self._accepted_only(side)

    @precondition(lambda self: any(e.has_unfinished() for e in self.engines))
    @rule(times=st.integers(1, 5), spec_times=st.integers(1, 5))
    def step(self, times: int, spec_times: int) -> None:
        for _ in range(times):
            self._step(0)
        for _ in range(spec_times):
            self._step(1)

    @precondition(lambda self: self.aborts and any(
        not p.aborted and not all(p.finished) for p in self.pairs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [p for p in self.pairs if not p.aborted and not all(p.finished)]
        pair = data.draw(st.sampled_from(live))
        for side, eng in enumerate(self.engines):
            eng.abort(pair.ids[side])
            eng.check_integrity()
        pair.aborted = True

    @precondition(lambda self: self.flushes and self.engines)
    @rule(host=st.booleans())
    def flush(self, host: bool) -> None:
        tiers = ("device", "host") if host and self.config.get("host_tokens") else ("device",)
        for eng in self.engines:
            eng.cache.flush(tiers=tiers)
            eng.check_integrity()

    # ----------------------------------------------------------- checks
    def _accepted_only(self, side: int) -> None:
        """The tree (device and host) holds a page-aligned prefix only where some request's
        accepted tokens computed it: every held prefix of L tokens starts some request's
        prompt + streamed outputs, whose KV reached position L - 1."""
        eng = self.engines[side]
        seqs = [p.prompt + p.streams[side] for p in self.pairs]
        tiers = (DEVICE, HOST) if eng._prefix.has_host else (DEVICE,)
        seen = set()
        for tier in tiers:
            for prefix, _pool in tree_contents(eng, tier):
                if prefix in seen:
                    continue
                seen.add(prefix)
                L = len(prefix)
                assert any(len(s) - 1 >= L and tuple(s[:L]) == prefix for s in seqs), (
                    f"engine {side} ({'spec' if side else 'plain'}) caches a {L}-token "
                    f"prefix that no request's accepted tokens computed")

    @invariant()
    def sound(self) -> None:
        self.steps += 1
        for side in range(len(self.engines)):
            for pair in self.pairs:
                assert pair.finished[side] <= 1
                assert len(pair.streams[side]) <= pair.params.max_new_tokens

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        if not self.engines:
            return
        try:
            for side, eng in enumerate(self.engines):
                for _ in range(3000):
                    if not eng.has_unfinished():
                        break
                    self._step(side)
                assert not eng.has_unfinished()
                eng.check_integrity()
                assert not eng.manager.leases
            self._compare()
            PREEMPTIONS.setdefault(type(self).__name__, []).append(
                self.engines[1].stats()["preemptions"])
        finally:
            for eng in self.engines:
                eng.close()
            if self.tmp is not None:
                self.tmp.cleanup()

    def _compare(self) -> None:
        for pair in self.pairs:
            if pair.aborted and not all(pair.finished):
                continue
            assert pair.finished == [1, 1], pair.finished
            assert pair.errors == [None, None], pair.errors
            plain, spec = pair.results
            assert spec.output_ids == plain.output_ids, (
                f"prompt of {len(pair.prompt)} tokens, {pair.params}: speculation gave "
                f"{spec.output_ids}, plain decoding {plain.output_ids}")
            diff = (spec.logits - plain.logits).abs().max().item()
            assert diff <= TOL, diff
        s = self.engines[1].stats()["spec"]
        assert s["accepted_tokens"] <= s["draft_tokens"]
        assert s["accepted_tokens"] == sum(s["accepted_per_position"])
        if self.same_tree:
            for tier in (DEVICE, HOST) if self.config.get("host_tokens") else (DEVICE,):
                a, b = (tree_contents(e, tier) for e in self.engines)
                assert a == b, (f"tier {tier}: only plain holds {len(a - b)} pages, only spec "
                                f"{len(b - a)}")


class Tight(LockstepMachine):
    """A device of 3 pages of every pool (7 frames of its arena): requests preempt each
    other; aborts and flushes."""

    config: ClassVar[dict] = {"device_tokens": 48}


class HostAndStorage(LockstepMachine):
    config: ClassVar[dict] = {"device_tokens": 128, "host_tokens": 1024, "storage": True}


class HiSparse(LockstepMachine):
    config: ClassVar[dict] = {"device_tokens": 320, "hisparse_buffer": 5,
                              "hisparse_requests": 4}


class SmallWindow(LockstepMachine):
    """The sliding-window and state pools far smaller than the compressed ones."""

    config: ClassVar[dict] = {"device_tokens": 256, "window_tokens": 48, "state_tokens": 48}


class Roomy(LockstepMachine):
    """Nothing is ever evicted, aborted or flushed: the trees end up equal, page for page,
    in every pool."""

    config: ClassVar[dict] = {"device_tokens": 8192}
    aborts = False
    flushes = False
    same_tree = True


TestTight = Tight.TestCase
TestTight.settings = steps(2)
TestHostAndStorage = HostAndStorage.TestCase
TestHostAndStorage.settings = steps(2)
TestHiSparse = HiSparse.TestCase
TestHiSparse.settings = steps(2)
TestSmallWindow = SmallWindow.TestCase
TestSmallWindow.settings = steps(2)
TestRoomy = Roomy.TestCase
TestRoomy.settings = steps(2)


@pytest.mark.parametrize("kind,k", [("wrong", 7), ("oracle", 3), ("ngram", 5)])
def test_a_fixed_lockstep_run_under_preemption(kind, k):
    """The machine's checks on fixed traffic that always preempts: five requests, some
    sharing prefixes, in the tight device."""
    machine = Tight()
    machine.start(kind, k, 0, (1, 3))
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    for i in range(5):
        tail = torch.randint(0, VOCAB, (9 + 7 * i,), generator=g).tolist()
        prompt = (base[:16 * (i % 3)] + tail)[:90]
        cont = true_continuation(prompt)
        machine.truth.add(prompt, cont)
        params = SamplingParams(max_new_tokens=TRUTH_NEW, ignore_eos=True)
        ids = tuple(e.add_request(prompt, params, return_logits=True) for e in machine.engines)
        pair = Pair(prompt, params, ids)  # type: ignore[arg-type]
        machine.pairs.append(pair)
        for side in (0, 1):
            machine.by_id[side][ids[side]] = pair
    preempted = [0, 0]
    for side in (0, 1):
        while machine.engines[side].has_unfinished():
            machine._step(side)
        preempted[side] = machine.engines[side].stats()["preemptions"]
    assert preempted[1] > 0, preempted
    machine.teardown()


# ------------------------------------------ faults inside speculative steps (DESIGN.md §4)
def _faulty_machine():  # type: ignore[no-untyped-def]
    """test_step_transaction's fault machine with a speculating engine: a fault at any
    point of a step (verification, the rewind, shrinking pages, the drafter included)
    leaves every request finished exactly once or pending and exact; greedy traffic (a
    replay of sampled draws does not hold once verification consumes the generator)."""
    import test_step_transaction as tst

    import shadowradix.engine.engine as engine_module
    from shadowradix.engine.drafters import TokenDrafter
    from shadowradix.engine.speculator import Speculator
    from shadowradix.model.compressor import Journal

    points = [*tst.DEVICE_POINTS, (engine_module, "verify"), (engine_module, "rewind_states"),
              (Speculator, "draft"), (TokenDrafter, "propose"), (Journal, "rewind"),
              (tst.CacheManager, "shrink")]

    def repeat_last(tokens, k):  # type: ignore[no-untyped-def]
        return [tokens[-1]] * k  # mostly rejected, sometimes kept

    class SpecFaults(tst.StepFaultMachine):
        config: ClassVar[dict] = {"device_tokens": 320}

        def __init__(self) -> None:
            super().__init__()
            self.engine = Engine(tst.MODEL, CacheConfig(page_size=16, debug_poison=True,
                                                        **self.config), step_tokens=40,
                                 speculative=SpecConfig("custom", 3, proposer=repeat_last))

        @rule(data=st.data(), n=st.integers(1, 60), new=st.integers(1, 12))
        def add(self, data: st.DataObject, n: int, new: int) -> None:
            prefix = data.draw(st.sampled_from(self.sequences)) if self.sequences and \
                data.draw(st.booleans()) else []
            prompt = prefix + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n,
                                                 max_size=n))
            params = SamplingParams(max_new_tokens=new, ignore_eos=True)
            rid = self.engine.add_request(prompt, params, return_logits=True)
            self.requests[rid] = tst.Tracked(prompt, params)

        @precondition(lambda self: self.engine.has_unfinished())
        @rule(point=st.sampled_from(points), nth=st.integers(1, 4),
              kind=st.sampled_from([tst.Injected, tst.Interrupt]))
        def faulty_step(self, point, nth, kind) -> None:  # type: ignore[no-untyped-def]
            with tst.fault(*point, nth, kind):
                try:
                    self._collect(self.engine.step())
                except (tst.Injected, tst.Interrupt):
                    self.faults += 1

    return SpecFaults


SpecFaults = _faulty_machine()
TestSpecFaults = SpecFaults.TestCase
TestSpecFaults.settings = steps(4, count=40)
