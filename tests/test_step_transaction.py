"""A step is a transaction (DESIGN.md §4): a fault at any point of a step, under random
traffic, leaves every request either finished exactly once or pending, and exact.

A state machine drives one engine (pages poisoned when handed out) with requests that share
prefixes, greedy and seeded sampling, aborts, device flushes and preemption in a small
device, and arms one fault per faulty step: at the n-th call of any point a step goes
through (admission, growth, every layer of the forward, the compressors, HiSparse's reads,
sampling, handing pages to the tree, host copies, storage writes, finishing). A fault is
an Exception (a request's own booking fails it alone; anything else fails the step) or an
interrupt (a BaseException: Ctrl-C). After every rule every page has one owner; at the end
every request is drained and each finished one is checked against transformers, its
sampled tokens against a replay of its generator, and its stream against its result."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import LOGIT_DIFFS, STEPS
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_tree_machine import steps
from tiny_model import reference_logits, tiny_model

import shadowradix.engine.engine as engine_module
import shadowradix.model.attention as attention_module
import shadowradix.model.runner as runner_module
from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.engine.sampling import sample
from shadowradix.engine.scheduler import Scheduler
from shadowradix.model.runner import DeepseekV4Runner
from shadowradix.sparse.hot_buffer import HotBuffers, HotSet
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage_tier import StorageTier
from shadowradix.tree.radix import ShadowRadix

MODEL = tiny_model()
VOCAB = 256
TOL = 1e-4


class Injected(Exception):
    """A fault: an error raised by whatever the step called."""


class Interrupt(BaseException):
    """An interrupt (Ctrl-C) at that point."""


# Every point a step goes through: (namespace, attribute).
POINTS = [
    (CacheManager, "admit"), (CacheManager, "grow"), (CacheManager, "cache_prefix"),
    (CacheManager, "finish"), (CacheManager, "preempt"), (ShadowRadix, "match_prefix"),
    (ShadowRadix, "insert"), (ShadowRadix, "lock"), (ShadowRadix, "unlock"),
    (PrefixCache, "alloc"), (PrefixCache, "free"), (PrefixCache, "release_queued"),
    (Scheduler, "finish"),
    (DeepseekV4Runner, "forward_batch"), (DeepseekV4Runner, "resume"),
    (runner_module, "attention_layer"), (attention_module, "compress"),
    (attention_module, "_snapshot"), (engine_module, "sample"), (Engine, "_result"),
    (HostTier, "backup"), (HostTier, "load"), (HostTier, "after_insert"),
    (StorageTier, "save"), (StorageTier, "fetch"), (HotSet, "plan"), (HotBuffers, "fetch"),
    (HotBuffers, "acquire"), (CacheManager, "_poison"), (CacheManager, "abort"),
]
NAMES = [f"{o.__name__.rsplit('.', 1)[-1]}.{a}" for o, a in POINTS]  # type: ignore[attr-defined]
# The points an engine with no host tier, storage or HiSparse goes through.
DEVICE_POINTS = [p for p in POINTS if p[0] not in (HostTier, StorageTier, HotSet, HotBuffers)]
DEVICE_NAMES = [n for p, n in zip(POINTS, NAMES, strict=True) if p in DEVICE_POINTS]


@contextlib.contextmanager
def fault(owner: object, attr: str, nth: int, kind: type[BaseException]) -> Iterator[list[int]]:
    """Raise `kind` at the nth call of owner.attr while the block runs; yields the count."""
    original = getattr(owner, attr)
    calls = [0]

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == nth:
            raise kind(f"{attr} call {nth}")
        return original(*args, **kwargs)

    setattr(owner, attr, failing)
    try:
        yield calls
    finally:
        setattr(owner, attr, original)


@dataclass
class Tracked:
    prompt: list[int]
    params: SamplingParams
    streamed: list[int] = field(default_factory=list)
    finished: int = 0  # outputs with finished=True (must end at 1)
    result: object = None
    error: BaseException | None = None
    aborted: bool = False


class StepFaultMachine(RuleBasedStateMachine):
    config: ClassVar[dict] = {}

    def __init__(self) -> None:
        super().__init__()
        self.tmp = None
        cfg = dict(self.config)
        if cfg.pop("storage", False):
            import tempfile

            self.tmp = tempfile.TemporaryDirectory()
            cfg["storage"] = f"file://{self.tmp.name}"
        self.engine = Engine(MODEL, CacheConfig(page_size=16, debug_poison=True, **cfg),
                             step_tokens=40)
        self.requests: dict[str, Tracked] = {}
        self.sequences: list[list[int]] = []
        self.faults = 0
        self.steps = -1

    # ------------------------------------------------------------ traffic
    @rule(data=st.data(), n=st.integers(1, 60), new=st.integers(1, 12),
          sampled=st.booleans(), seed=st.integers(0, 2**31))
    def add(self, data: st.DataObject, n: int, new: int, sampled: bool, seed: int) -> None:
        prefix = data.draw(st.sampled_from(self.sequences)) if self.sequences and \
            data.draw(st.booleans()) else []
        prompt = prefix + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n,
                                             max_size=n))
        params = SamplingParams(max_new_tokens=new, ignore_eos=True, greedy=not sampled,
                                temperature=0.8, top_p=0.9, top_k=50, seed=seed)
        rid = self.engine.add_request(prompt, params, return_logits=True)
        self.requests[rid] = Tracked(prompt, params)

    def _collect(self, outputs) -> None:  # type: ignore[no-untyped-def]
        for out in outputs:
            t = self.requests[out.request_id]
            assert not t.finished, f"{out.request_id} reported after it finished"
            t.streamed += out.new_token_ids
            if out.finished:
                t.finished += 1
                t.result, t.error = out.result, out.error
                if out.error is None:
                    assert out.result.output_ids == t.streamed
                    self.sequences.append(t.prompt + t.streamed)

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(times=st.integers(1, 6))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._collect(self.engine.step())

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(point=st.sampled_from(POINTS), nth=st.integers(1, 4),
          kind=st.sampled_from([Injected, Interrupt]))
    def faulty_step(self, point: tuple[object, str], nth: int,
                    kind: type[BaseException]) -> None:
        with fault(*point, nth, kind) as calls:
            try:
                self._collect(self.engine.step())
            except (Injected, Interrupt):
                self.faults += 1
        assert calls[0] >= 0

    @precondition(lambda self: any(not t.finished and not t.aborted
                                   for t in self.requests.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(r for r, t in self.requests.items() if not t.finished and not t.aborted)
        rid = data.draw(st.sampled_from(live))
        self.engine.abort(rid)
        self.requests[rid].aborted = True

    @rule()
    def flush_device(self) -> None:
        self.engine.cache.flush(tiers=("device",))

    # ----------------------------------------------------------- checks
    @invariant()
    def sound(self) -> None:
        self.steps += 1
        self.engine.check_integrity()
        for rid, t in self.requests.items():
            assert t.finished <= 1
            assert len(t.streamed) <= t.params.max_new_tokens
            pending = rid in self.engine._requests or any(  # or its last output waits
                o.request_id == rid for o in self.engine._outbox)
            assert t.finished or t.aborted or pending, f"{rid} was lost"

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        eng = self.engine
        for _ in range(2000):
            if not eng.has_unfinished():
                break
            self._collect(eng.step())
        assert not eng.has_unfinished()
        eng.check_integrity()
        assert not eng.manager.leases
        for t in self.requests.values():
            if t.aborted and not t.finished:
                continue
            assert t.finished == 1
            if t.error is not None:  # failed alone: only ever by an injected fault
                assert isinstance(t.error, Injected), t.error
                continue
            self._exact(t)
        eng.close()
        if self.tmp is not None:
            self.tmp.cleanup()

    def _exact(self, t: Tracked) -> None:
        r = t.result
        out = r.output_ids  # type: ignore[attr-defined]
        assert len(out) == t.params.max_new_tokens
        n = len(t.prompt)
        ref = reference_logits(MODEL, t.prompt + out)[n - 1:n - 1 + len(out)]
        diff = (ref - r.logits).abs().max().item()  # type: ignore[attr-defined]
        LOGIT_DIFFS.append(diff)
        assert diff <= TOL, diff
        gen = torch.Generator().manual_seed(t.params.seed) if t.params.sampling else None
        replay = [sample(row, t.params, gen) for row in r.logits]  # type: ignore[attr-defined]
        assert replay == out, "the tokens are not the generator's draws in order"


class DeviceOnly(StepFaultMachine):
    config: ClassVar[dict] = {"device_tokens": 320}  # small: decodes preempt


class HostAndStorage(StepFaultMachine):
    config: ClassVar[dict] = {"device_tokens": 320, "host_tokens": 1024, "storage": True}


class HiSparse(StepFaultMachine):
    config: ClassVar[dict] = {"device_tokens": 512, "hisparse_buffer": 5}


TestDeviceOnly = DeviceOnly.TestCase
TestDeviceOnly.settings = steps(12)
TestHostAndStorage = HostAndStorage.TestCase
TestHostAndStorage.settings = steps(8)
TestHiSparse = HiSparse.TestCase
TestHiSparse.settings = steps(8)


# ------------------------------------------------- each fault, once, by hand
INSIDE_THE_FORWARD = {"attention_layer", "compress", "_snapshot", "plan", "fetch"}
P = SamplingParams(max_new_tokens=4, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (37, 21, 50)]


def collect(seen: dict[str, Tracked], outputs) -> None:  # type: ignore[no-untyped-def]
    for out in outputs:
        t = seen[out.request_id]
        assert not t.finished, f"{out.request_id} reported after it finished"
        t.streamed += out.new_token_ids
        t.finished += out.finished
        if out.finished:
            t.result, t.error = out.result, out.error


@pytest.mark.parametrize("owner,attr", DEVICE_POINTS, ids=DEVICE_NAMES)
@pytest.mark.parametrize("kind", [Injected, Interrupt])
def test_a_fault_at_each_point_of_a_step_leaves_every_request_exact(owner, attr, kind):
    """Three requests; the fault fires at the first call of the point after the first
    step (the third, inside the forward). The step either fails whole (every request
    pending, exact after the retry) or, for a request's own booking, fails that request
    alone while the others finish exact; what was produced before the fault is returned
    by the next step."""
    eng = Engine(MODEL, CacheConfig(page_size=16, device_tokens=1024, debug_poison=True),
                 step_tokens=40)
    ps = prompts()
    ids = [eng.add_request(p, P, return_logits=True) for p in ps]
    seen = {rid: Tracked(p, P) for rid, p in zip(ids, ps, strict=True)}
    collect(seen, eng.step())  # the first chunks ran: the fault lands mid-prefill or decode
    nth = 3 if attr in INSIDE_THE_FORWARD else 1  # some requests' states advanced already
    with fault(owner, attr, nth, kind) as calls:  # armed until it fired
        while calls[0] < nth and eng.has_unfinished():
            with contextlib.suppress(Injected, Interrupt):
                collect(seen, eng.step())
    while eng.has_unfinished():
        collect(seen, eng.step())
    eng.check_integrity()
    assert not eng.manager.leases and not eng._requests
    for p, rid in zip(ps, ids, strict=True):
        t = seen[rid]
        assert t.finished == 1, f"{rid}: finished {t.finished} times"
        if t.error is not None:
            assert kind is Injected
            continue
        assert t.streamed == t.result.output_ids and len(t.streamed) == P.max_new_tokens
        ref = reference_logits(MODEL, p + t.streamed)[len(p) - 1:len(p) - 1 + len(t.streamed)]
        diff = (ref - t.result.logits).abs().max().item()
        LOGIT_DIFFS.append(diff)
        assert diff <= TOL, (rid, diff)
